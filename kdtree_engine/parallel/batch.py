"""Continuous batching at tensor parallel: every rank runs the same scheduler, step for step.

The ranks' forwards hold collectives, so every rank must run the same steps over the same requests in the same
order. The scheduler's choices are a function of what was submitted and cancelled, and when: the row budget, the
cache pool (sized the same on every rank), the admissions, the rounds and the tokens (the vocabulary reductions give
every rank the same picks; a sampled request draws from the seed rank 0 gives it). So rank 0 keeps the batch the
user sees (:class:`RankedScheduler`), and before each step sends what changed since the last (broadcast.py): the
requests submitted (their ids, parameters, method and budget) and the ids of those cancelled. Every other rank
(:func:`follow_batch`) applies them to its own scheduler and runs the same step.

Two things a single process does at once wait for the next step here, so that every rank does them at the same
point: a cancel (rank 0's: counted when the next step starts), and a request's ``on_tokens`` verdict (its True ends the request, "abort", at the next
step rather than within this one; its tokens are those up to the round the verdict was given on). The load-aware
budget (``budget="auto"``) is refused: it chooses from timings, which differ between ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

import torch

from ..batch.scheduler import Scheduler
from ..batch.sequence import Sequence
from ..errors import BadInput, RankFailure
from ..logs import log_once
from ..sampling import SamplingParams
from ..speculative.decode import OnTokens
from .broadcast import (BatchOpen, Request, Submitted, recv_step, send_batch_open, send_step, with_seed)
from .comm import Communicator
from .keepalive import unguarded
from .launch import collective_error


class RankedScheduler(Scheduler):
    """Rank 0's continuous batch at tp > 1: a :class:`Scheduler` whose every step is first told to the other ranks
    (the submissions and cancels since the last). Open until :meth:`close` (or :meth:`drop_all`), which ends the
    batch on every rank."""

    def __init__(self, target: Any, drafter: Any, comm: Communicator, device: torch.device, *, token_budget: int,
                 prefill_chunk: int | None = None, on_failure: Callable[[], None] | None = None,
                 guard: Callable[[], ContextManager[None]] = unguarded) -> None:
        super().__init__(target, drafter, token_budget=token_budget, prefill_chunk=prefill_chunk)
        self.comm, self.device, self.on_failure, self.guard = comm, device, on_failure, guard
        self.open = True
        self._submitted: list[Submitted] = []
        with guard():
            send_batch_open(comm, token_budget, prefill_chunk, device)
        log_once(f"tp-batch:{comm.world_size}", f"continuous batching over {comm.world_size} ranks: rank 0 sends each "
                 "step's new requests and cancels, every rank runs the step")

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *, spec: str = "none",
               budget: int | str | None = None, on_tokens: OnTokens | None = None) -> Sequence:
        """:meth:`Scheduler.submit`, told to the other ranks at the next step; ``on_tokens``' True ends the request at
        the next step (module docstring)."""
        self._check_open()
        if budget == "auto":
            raise BadInput("budget='auto' chooses from timings, which differ between ranks: give a fixed budget at "
                           f"tp={self.comm.world_size}")
        params = with_seed(params or SamplingParams())   # every rank draws the same noise
        holder: list[Sequence] = []

        def verdict(tokens: list[int]) -> bool:
            if on_tokens is not None and on_tokens(tokens) and holder:
                holder[0].cancel()   # told to the ranks at the next step
            return False   # no rank ends it inside this step: all of them at the next

        seq = super().submit(prompt_ids, params, spec=spec, budget=budget, on_tokens=verdict)
        holder.append(seq)
        self._submitted.append(Submitted(Request(list(seq.prompt_ids), params), spec, budget))
        return seq

    def step(self) -> list[Sequence]:
        """Tell the ranks the submissions since the last step and the requests cancelled (through
        :meth:`Scheduler.cancel`, ``Sequence.cancel`` or an ``on_tokens`` verdict), then run the step."""
        self._check_open()
        submitted, self._submitted = self._submitted, []
        cancelled = [s.id for s in [*self.waiting, *self.active] if s.cancelled]
        try:
            with self.guard():   # the step's collectives follow its message with no keep-alive between
                send_step(self.comm, submitted, cancelled, self.device)
                return super().step()
        except RuntimeError as e:
            if not collective_error(e):
                raise
            self.open = False
            if self.on_failure is not None:
                self.on_failure()
            raise RankFailure(f"a tensor-parallel collective failed ({str(e).splitlines()[0]})") from None

    def drop_all(self) -> list[Sequence]:
        """End every request ("abort") and the batch on every rank (after a failed step: a new batch takes over)."""
        ended = super().drop_all()
        self._end_batch()
        return ended

    def close(self) -> None:
        super().close()
        self._end_batch()

    def _end_batch(self) -> None:
        if self.open:
            self.open = False
            with self.guard():
                send_step(self.comm, [], [], self.device, end=True)

    def _check_open(self) -> None:
        if not self.open:
            raise BadInput("this tensor-parallel batch is closed (its ranks left it): make a new one with "
                           "LLM.scheduler()")


def follow_batch(target: Any, drafter: Any, comm: Communicator, device: torch.device, opened: BatchOpen) -> None:
    """Ranks > 0: rank 0's continuous batch, step for step, until it closes (each request comes with its method and
    budget)."""
    sched = Scheduler(target, drafter, token_budget=opened.token_budget, prefill_chunk=opened.prefill_chunk)
    try:
        while (msg := recv_step(comm, device)) is not None:
            submitted, cancelled = msg
            for sub in submitted:
                sched.submit(sub.request.prompt_ids, sub.request.params, spec=sub.method, budget=sub.budget)
            if cancelled:   # rank 0 sends the ids of its live requests, live here too (the same steps)
                live = {s.id: s for s in [*sched.waiting, *sched.active]}
                for i in cancelled:
                    live[i].cancel()
            sched.step()
    finally:
        sched.close()


__all__ = ["RankedScheduler", "follow_batch"]
