"""Independent pieces of work side by side on one CUDA device (a fork and a join on streams).

    side_by_side(dev, on_side, here):  on_side() on a side stream forked from the current one, here() on
                                       the current stream, then the current stream waits for the side.
    fan_out(dev, works):               each work on one of FAN_OUT streams forked from the current one (in turn),
                                       then the current stream waits for them all; their results in order.

Captured into CUDA graphs as a fork / join (the graph's two branches run concurrently). Off CUDA, or
with nothing for the side, the two run one after the other (on_side first). Each piece must only write
its own outputs; what the side allocates is only used on the current stream after the join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

R = TypeVar("R")
FAN_OUT = 4  # streams of a fan-out: enough to fill the device with small attention launches side by side

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}
_FAN_STREAMS: dict[torch.device, list["torch.cuda.Stream"]] = {}


def side_by_side(dev: torch.device, on_side: Callable[[], None] | None, here: Callable[[], None]) -> None:
    if on_side is None or dev.type != "cuda":
        if on_side is not None:
            on_side()
        here()
        return
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)
    current = torch.cuda.current_stream(dev)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        on_side()
    here()
    current.wait_stream(side)


def fan_out(dev: torch.device, works: Sequence[Callable[[], R]]) -> list[R]:
    """Run ``works`` side by side (each on one of FAN_OUT forked streams, in turn) and join; their results in order.
    Off CUDA, or with one piece, one after the other on the current stream. Each work must only write its own
    outputs (what it allocates is used on the current stream after the join)."""
    if dev.type != "cuda" or len(works) < 2:
        return [w() for w in works]
    streams = _FAN_STREAMS.get(dev)
    if streams is None:
        streams = _FAN_STREAMS[dev] = [torch.cuda.Stream(device=dev) for _ in range(FAN_OUT)]
    used = streams[:min(len(works), FAN_OUT)]
    current = torch.cuda.current_stream(dev)
    for s in used:
        s.wait_stream(current)
    out = []
    for i, w in enumerate(works):
        with torch.cuda.stream(used[i % len(used)]):
            out.append(w())
    for s in used:
        current.wait_stream(s)
    return out


__all__ = ["FAN_OUT", "fan_out", "side_by_side"]
