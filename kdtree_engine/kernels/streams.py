"""Two independent pieces of work side by side on one CUDA device (a fork and a join on streams).

    side_by_side(dev, on_side, here):  on_side() on a side stream forked from the current one, here() on
                                       the current stream, then the current stream waits for the side.

Captured into CUDA graphs as a fork / join (the graph's two branches run concurrently). Off CUDA, or
with nothing for the side, the two run one after the other (on_side first). Each piece must only write
its own outputs; what the side allocates is only used on the current stream after the join.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


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


__all__ = ["side_by_side"]
