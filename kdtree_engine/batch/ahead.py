"""Plain greedy steps one ahead: while every running request decodes plainly and greedily over the static batched
steps (load-aware requests skipping their draft passes included), the scheduler queues step N+1 before the host reads step N's tokens, so the host's work between steps (the
read, the stop rules, streaming, laying out the next step) overlaps the device instead of leaving it idle.

Step N+1 needs only step N's tokens as its inputs, and they stay on the device: each request's next input is its
row of step N's batched pick. The host reads step N's picks from a copy queued right behind them (two host buffers
in turn, pinned on CUDA, so step N+1's copy cannot overwrite step N's before it is read). A request whose length
step N reaches takes no row of step N+1; one that a stop token ends at step N (seen only when the host reads it) has
had one more row computed by step N+1, dropped with the request (its cache keeps room for it: admission reserves
the widest round past the limit). The tokens are those of the step-by-step loop: the same forwards, the same
row-wise picks, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from ..model.target import TargetOutput
from ..speculative.host_rounds import RoundPlan
from .sequence import RUNNING, Sequence


@dataclass
class Pending:
    """A step whose forward and picks are queued but whose tokens the host has not read yet."""

    running: list[Sequence]
    plans: list[RoundPlan]
    outs: list[TargetOutput]
    picks: torch.Tensor                 # [n] device: each request's next token
    host: torch.Tensor                  # [>= n] host: the picks' copy, queued behind them
    event: torch.cuda.Event | None      # recorded after that copy (CUDA)


def steady(seqs: Seq[Sequence]) -> bool:
    """Requests whose next step is one row picked greedily: plain greedy decoding, or a greedy load-aware request
    skipping its draft passes for at least that step (its aux row still feeds its drafter)."""
    return all(s.rounds is not None and s.params.greedy and (s.rounds.drafter is None or (s.shape.auto and s.skip > 0))
               for s in seqs)


class StepsAhead:
    """The host buffers of the picks' copies (two, used in turn) and the pending step."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.buffers = self._buffers(slots)
        self.turn = 0
        self.pending: Pending | None = None
        self.steps = 0   # steps queued ahead of the host's read (a count for the benchmarks and tests)

    def pend(self, running: list[Sequence], plans: list[RoundPlan], outs: list[TargetOutput],
             picks: torch.Tensor) -> Pending:
        """Step N with its picks [n] (device) and their copy to the host queued; nothing waits."""
        if picks.numel() > self.buffers[0].numel():   # more requests than the static slots (an eager step)
            self.buffers = self._buffers(picks.numel())   # a pending step keeps its own buffer
        host = self.buffers[self.turn]
        self.turn ^= 1
        cuda = self.device.type == "cuda"
        host[:picks.numel()].copy_(picks, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return Pending(list(running), list(plans), list(outs), picks, host, event)

    def _buffers(self, n: int) -> list[torch.Tensor]:
        pinned = self.device.type == "cuda"
        return [torch.empty(n, dtype=torch.long, pin_memory=pinned) for _ in range(2)]

    @staticmethod
    def hand_on(pend: Pending) -> None:
        """Each request's next input: its row of the pending step's picks (on the device)."""
        for k, seq in enumerate(pend.running):
            if seq.state == RUNNING:
                seq.rounds.bonus = pend.picks[k]

    def settle(self, pend: Pending, end) -> list[Sequence]:
        """Read the pending step's tokens and hand them to its requests (``end(seq)`` for each that its stop rule
        ends; requests ended meanwhile are skipped); returns the ended ones."""
        if pend.event is not None:
            pend.event.synchronize()
        tokens = pend.host[:len(pend.running)].tolist()
        ended = []
        for k, (seq, plan, out) in enumerate(zip(pend.running, pend.plans, pend.outs)):
            if seq.state != RUNNING:
                continue
            seq.rounds.absorb(plan, out, (pend.picks[k], tokens[k]))
            if seq.emit.push(seq.rounds.collect()):
                ended.append(end(seq))
        return ended
