import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: thread start-up costs more than the work; also keeps timings stable on busy hosts.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
