"""One request inside the continuous batch: what was asked, where it is in its life, and what it produced.

Life: waiting (validated, no cache yet) -> prefill (its cache blocks taken, prompt chunks still to run) -> running
(one round per batched forward) -> done. Cancelled requests end at the next round boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling import SamplingParams
from ..speculative.budget import AcceptanceCalibration
from ..speculative.config import RoundShape
from ..speculative.decode import Emitter, GenerationResult
from ..speculative.host_rounds import HostRounds

WAITING, PREFILL, RUNNING, DONE = "waiting", "prefill", "running", "done"


@dataclass(eq=False)
class Sequence:
    """A request submitted to the :class:`~.scheduler.Scheduler`; ``result`` is set when it ends."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    shape: RoundShape
    limit: int                      # tokens it may generate (the stop rule's length cap)
    emit: Emitter
    state: str = WAITING
    rounds: HostRounds | None = None
    chunks: list[tuple[int, int, Any]] = field(default_factory=list)  # (start, end, ChunkStep | None) left to run
    prompt_aux: list[torch.Tensor] = field(default_factory=list)
    calibration: AcceptanceCalibration | None = None   # load-aware budgets: observed / predicted accepted drafts
    predicted: float = 0.0
    skip: int = 0       # load-aware budgets: plain rounds left before the next draft pass
    backoff: int = 0    # the length of the last skip
    draft_slot: tuple[int, int] | None = None   # its slot of the batched draft passes (.draft_slots), while held
    tree_slot: tuple[tuple, int] | None = None  # its device-resident rounds' (group, slot) (.tree_slots), while held
    cancelled: bool = False
    result: GenerationResult | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    first_token: float = 0.0

    @property
    def done(self) -> bool:
        return self.state == DONE

    def cancel(self) -> None:
        """End the request at the next round boundary (finish_reason "abort"); its blocks go back then."""
        self.cancelled = True
