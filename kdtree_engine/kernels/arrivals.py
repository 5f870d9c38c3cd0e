"""Arrival counters for last-program epilogues: a kernel whose output tile is reduced over several programs
(split-K partials, a token's top-k expert rows) lets the last program to arrive do the reduction, in a fixed
order, instead of a separate launch.

    program:  store its fp32 partial; barrier; old = atomic_add(counter[tile], 1, acq_rel, gpu)
    last (old == arrivals - 1):  load every partial of the tile in order (L2, .cg), reduce, store, counter = 0

The counters are int32, zero between launches (the last program of each tile resets its own), and owned by
one role per device: launches of one role run one at a time (the same stream, or one branch of a fork: the
engine's side-by-side pairs never put one role on both branches). Buffers are never freed (a captured CUDA
graph keeps the address) and never allocated during capture: a capture needing more counters than the eager
runs before it allocated is an error.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

MIN_COUNTERS = 1 << 15          # 128 KB: every K2 launch up to 256 tokens needs fewer
_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []   # outgrown buffers, kept alive for the graphs that captured them


def arrival_counters(device: torch.device, role: str, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for `role` on `device` (the same buffer on every call
    while it is large enough)."""
    key = (torch.device(device), role)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if buf is None else buf.numel()
        raise RuntimeError(f"arrival counters '{role}': {n} needed during CUDA-graph capture, {have} allocated; "
                           f"run the same shapes once eagerly before capturing")
    size = max(MIN_COUNTERS, 1 << max(n - 1, 0).bit_length())
    if buf is not None:
        _RETIRED.append(buf)
    buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=key[0])
    log.info("arrival counters '%s' on %s: %d", role, key[0], size)
    return buf


__all__ = ["arrival_counters", "MIN_COUNTERS"]
