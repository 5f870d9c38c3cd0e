"""A GPU test helper: a launch captured in a CUDA graph right after a kernel that writes its input (so a dependent
launch must wait for that kernel, pdl.py), replayed with new values, against eager calls on the same values."""

from __future__ import annotations

from typing import Callable

import torch


def replays_match_eager(fn: Callable[[torch.Tensor], torch.Tensor], M: int, K: int, replays: int,
                        what: str) -> torch.Tensor:
    """fn(x) on x [M, K] bf16 (fresh random values per replay): every replay's output equals fn on a copy of the same
    values, bit for bit. Returns the graph's output buffer (the last replay's values)."""
    src = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    xb = torch.empty_like(src)
    torch.mul(src, 1.0, out=xb)
    fn(xb)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 1.0, out=xb)     # a kernel writing fn's input
        y = fn(xb)
    for r in range(replays):
        src.copy_(torch.randn(M, K, device="cuda").to(torch.bfloat16))
        graph.replay()
        assert torch.equal(y, fn(src.clone())), f"{what} M={M} replay {r} differs from eager"
    return y
