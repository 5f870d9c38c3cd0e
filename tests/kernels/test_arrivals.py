"""Arrival counters (kernels/arrivals.py): zeroed, shared per role while large enough, grown without
freeing the buffer a captured graph may hold."""

from __future__ import annotations

import torch

from kdtree_engine.kernels import arrivals


def test_counters_are_zero_shared_and_grow(monkeypatch):
    monkeypatch.setattr(arrivals, "_BUFFERS", {})
    monkeypatch.setattr(arrivals, "_RETIRED", [])
    dev = torch.device("cpu")
    a = arrivals.arrival_counters(dev, "gemm", 100)
    assert a.dtype == torch.int32 and a.numel() >= 100 and not a.any()
    assert arrivals.arrival_counters(dev, "gemm", a.numel()) is a
    assert arrivals.arrival_counters(dev, "other", 10) is not a          # one buffer per role
    n = a.numel() + 1
    b = arrivals.arrival_counters(dev, "gemm", n)
    assert b.numel() >= n and not b.any() and b is not a
    assert any(r is a for r in arrivals._RETIRED)                          # the outgrown buffer stays alive
    assert arrivals.arrival_counters(dev, "gemm", 5) is b
