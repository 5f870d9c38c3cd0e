import pytest


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every test here runs its tiny models on one torch thread (tests/conftest.py)."""
    yield
