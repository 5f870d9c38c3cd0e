import sys
from pathlib import Path

import pytest
import torch

# Test helpers (hf_oracle, helpers_ckpt) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def single_thread():
    """Tiny models: one torch thread (thread start-up costs more than the work; timings stay stable on a
    busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
