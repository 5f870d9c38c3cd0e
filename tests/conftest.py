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


@pytest.fixture
def warpgroup_launches(monkeypatch):
    """Count the attention launcher's warpgroup decode launches: the list grows by one per launch."""
    import kdtree_engine.kernels.mla_attention as mod
    calls: list = []
    real = mod.decode_wg

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "decode_wg", counted)
    return calls
