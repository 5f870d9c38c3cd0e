"""Capturing a step into a CUDA graph, and the tensors outside it that a replay relies on (shared by the decoding
rounds, the batched steps and the prompt steps)."""

from __future__ import annotations

from typing import Any, Callable

import torch

WARMUP_ROUNDS = 2


def capture_graph(step: Callable[[], None], device: torch.device, restore: Callable[[], None] = lambda: None,
                  pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step`` captured into a CUDA graph (in ``pool``, or a new private pool): WARMUP_ROUNDS runs on a side stream
    first (lazy initialisation, Triton compilation, the allocator), then ``restore()`` undoes what they changed, then
    the capture (which runs nothing). Returns (graph, pool)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_ROUNDS):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    restore()
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph, pool


def derived_owners(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that cache tensors derived from their weights (found once: walking every module costs time)."""
    return [m for model in models for m in model.modules() if hasattr(m, "derived_weights")]


def watched(target: Any, owners: list[torch.nn.Module]) -> tuple:
    """Addresses of tensors a captured step reads that live outside it and may be replaced (rope tables grown by an
    eager step; absorbed attention weights, the routers' bf16 parts and stacked linears rebuilt after a reload): a
    graph whose addresses changed is captured again."""
    ptrs = [target.rope.cos.data_ptr(), target.rope.sin.data_ptr()]
    for m in owners:
        ptrs += [w.data_ptr() for w in m.derived_weights()] + [None]   # None: where one owner's list ends
    return tuple(ptrs)

