"""Capturing a step into a CUDA graph, and the tensors outside it that a replay relies on (shared by the decoding
rounds, the batched steps and the prompt steps)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..logs import log

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


Addresses = tuple[tuple[int, ...], ...]


def watched(target: Any, owners: list[torch.nn.Module], rope: bool = True) -> Addresses:
    """Addresses of tensors a captured step may read that live outside it and may be replaced: the rope tables
    (grown by an eager step or a longer round; ``rope=False`` for a step that reads none of them), then each owner's
    derived weights (absorbed attention weights, the routers' bf16 parts, stacked linears: rebuilt after a reload, and
    made on first use)."""
    tables = (target.rope.cos.data_ptr(), target.rope.sin.data_ptr()) if rope else ()
    return (tables,) + tuple(tuple(w.data_ptr() for w in m.derived_weights()) for m in owners)


def replaced(captured: Addresses, now: Addresses) -> bool:
    """Whether a tensor a graph read was replaced since its capture (then it is captured again): the rope tables
    moved, or a weight derived at capture is no longer among its owner's. A weight derived after the capture was
    never read by the graph (the capture's own runs made whatever it reads), so it changes nothing."""
    if len(captured) != len(now) or captured[0] != now[0]:
        return True
    return any(not set(c) <= set(n) for c, n in zip(captured[1:], now[1:]))


class CapturedStep:
    """A step replayed from a CUDA graph: captured on its first replay, and again when a tensor it read was replaced.
    ``addresses()``: what it may read now (:func:`watched`); ``save()`` before a capture returns what undoes its
    warm-up runs (a round's state); ``name`` names it in the log line of a capture again."""

    def __init__(self, body: Callable[[], None], device: torch.device, addresses: Callable[[], Addresses], name: str,
                 save: Callable[[], Callable[[], None]] = lambda: (lambda: None)) -> None:
        self.body, self.device, self.addresses, self.name, self.save = body, device, addresses, name, save
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: Addresses = ()

    def replay(self, pool: Any = None) -> tuple[Any, bool]:
        """Replay, capturing first (into ``pool``: None for a private one) when needed; returns (the graph's memory
        pool, whether it captured now)."""
        if self.graph is not None and replaced(self.inputs, self.addresses()):
            log.info("%s graph: a tensor it reads was replaced; capturing again", self.name)
            self.graph = None
        captured = self.graph is None
        if captured:
            self.graph, pool = capture_graph(self.body, self.device, self.save(), pool)
            self.inputs = self.addresses()
        self.graph.replay()
        return pool, captured
