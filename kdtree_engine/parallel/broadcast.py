"""The ranks' request loop: rank 0 sends each request (a few small integer tensors: the prompt ids and the
sampling parameters) before running it; every other rank receives it and runs the same generation, so all ranks
take the same collectives in the same order. The emitted tokens are identical on every rank (the vocabulary
reductions give every rank the same picks); only rank 0 returns them to the user.

A continuous batch (parallel/batch.py) opens with one message (BATCH: its row budget and prompt chunk); then before
each of its steps rank 0 sends what changed since the last (the requests submitted, with their method and budget,
and the ids of those cancelled), and every rank applies it and runs the step; END closes it. A no-op (NOOP, or
STEP_NOOP inside a batch) only restarts the ranks' wait (parallel/keepalive.py); the receivers skip it."""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, replace

import torch

from ..sampling import SamplingParams
from .comm import Communicator

STOP, GENERATE, BATCH, NOOP = 0, 1, 2, 3   # NOOP: rank 0 keeps the idle ranks in the group (keepalive.py)
STEP, END, STEP_NOOP = 1, 0, 2      # a batch step's message, the batch's end, or the batch's keep-alive
METHODS = ("none", "dflash", "ddtree")   # a submitted request's method, sent as its index
HEADER = 11  # op, prompt length, max_tokens, top_k, seed, ignore_eos, stop ids, plain, stoppable, temperature, top_p


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    plain: bool = False  # plain decoding whatever the engine's speculative method (the CLI's --compare)
    stoppable: bool = False  # rank 0 may end it after any round (the server: a stop string, a client gone)


def float_bits(x: float) -> int:
    """A float64 as the int64 of its bits (the header is one integer tensor; the value arrives exactly)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


def with_seed(params: SamplingParams) -> SamplingParams:
    """A sampled request without a seed gets one here (rank 0): every rank must draw the same noise."""
    if params.greedy or params.seed is not None:
        return params
    return replace(params, seed=secrets.randbits(62))


def send_request(comm: Communicator, req: Request, device: torch.device) -> Request:
    """Rank 0: send the request to every rank (returns it with the seed the ranks use)."""
    p = with_seed(req.params)
    req = replace(req, params=p)
    head = [GENERATE, len(req.prompt_ids), p.max_tokens, p.top_k, -1 if p.seed is None else p.seed,
            int(p.ignore_eos), len(p.stop_token_ids), int(req.plain), int(req.stoppable),
            float_bits(float(p.temperature)), float_bits(float(p.top_p))]
    comm.broadcast(torch.tensor(head, dtype=torch.long, device=device))
    comm.broadcast(torch.tensor(req.prompt_ids + list(p.stop_token_ids), dtype=torch.long, device=device))
    return req


def send_stop(comm: Communicator, device: torch.device) -> None:
    comm.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long, device=device))


@dataclass(frozen=True)
class BatchOpen:
    """Rank 0 opened a continuous batch: every rank makes the same scheduler."""
    token_budget: int
    prefill_chunk: int | None


@dataclass(frozen=True)
class Submitted:
    """A request submitted to the batch, as every rank submits it."""
    request: Request
    method: str
    budget: int | None


def send_batch_open(comm: Communicator, token_budget: int, prefill_chunk: int | None, device: torch.device) -> None:
    head = [BATCH, token_budget, -1 if prefill_chunk is None else prefill_chunk] + [0] * (HEADER - 3)
    comm.broadcast(torch.tensor(head, dtype=torch.long, device=device))


def send_noop(comm: Communicator, device: torch.device, in_batch: bool) -> None:
    """Rank 0, idle: a message the ranks skip (inside an open batch: its step-message form)."""
    if in_batch:
        comm.broadcast(torch.tensor([STEP_NOOP, 0, 0], dtype=torch.long, device=device))
    else:
        comm.broadcast(torch.tensor([NOOP] + [0] * (HEADER - 1), dtype=torch.long, device=device))


def send_step(comm: Communicator, submitted: list[Submitted], cancelled: list[int], device: torch.device,
              end: bool = False) -> None:
    """Rank 0, before a batch step (``end``: instead of one, the batch closes): the requests submitted since the last
    step, then the ids of those cancelled."""
    comm.broadcast(torch.tensor([END if end else STEP, len(submitted), len(cancelled)], dtype=torch.long,
                                device=device))
    if end:
        return
    for sub in submitted:
        send_request(comm, sub.request, device)
        comm.broadcast(torch.tensor([METHODS.index(sub.method), -1 if sub.budget is None else sub.budget],
                                    dtype=torch.long, device=device))
    if cancelled:
        comm.broadcast(torch.tensor(cancelled, dtype=torch.long, device=device))


def recv_step(comm: Communicator, device: torch.device) -> tuple[list[Submitted], list[int]] | None:
    """Ranks > 0: the next batch step's submissions and cancelled ids, or None when the batch closes."""
    op = STEP_NOOP
    while op == STEP_NOOP:
        op, n_sub, n_cancel = comm.broadcast(torch.zeros(3, dtype=torch.long, device=device)).tolist()
    if op == END:
        return None
    submitted = []
    for _ in range(n_sub):
        req = recv_message(comm, device)
        method, budget = comm.broadcast(torch.zeros(2, dtype=torch.long, device=device)).tolist()
        submitted.append(Submitted(req, METHODS[method], None if budget < 0 else budget))
    cancelled = comm.broadcast(torch.zeros(n_cancel, dtype=torch.long, device=device)).tolist() if n_cancel else []
    return submitted, cancelled


def recv_message(comm: Communicator, device: torch.device) -> Request | BatchOpen | None:
    """Ranks > 0: rank 0's next message: a request, a continuous batch opening, or None when rank 0 stops."""
    head = [NOOP]
    while head[0] == NOOP:
        head = comm.broadcast(torch.zeros(HEADER, dtype=torch.long, device=device)).tolist()
    if head[0] == STOP:
        return None
    if head[0] == BATCH:
        return BatchOpen(head[1], None if head[2] < 0 else head[2])
    _, n, max_tokens, top_k, seed, ignore_eos, n_stop, plain, stoppable, temp, top_p = head
    ids = comm.broadcast(torch.zeros(n + n_stop, dtype=torch.long, device=device)).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=bits_float(temp), top_p=bits_float(top_p),
                            top_k=top_k, seed=None if seed < 0 else seed, stop_token_ids=tuple(ids[n:]),
                            ignore_eos=bool(ignore_eos))
    return Request(ids[:n], params, bool(plain), bool(stoppable))


def send_round_verdict(comm: Communicator, stop: bool, device: torch.device) -> bool:
    """Rank 0, after each round of a stoppable request: whether the request ends here, told to every rank (the
    ranks then leave the generation loop after the same round)."""
    comm.broadcast(torch.tensor([int(stop)], dtype=torch.long, device=device))
    return stop


def recv_round_verdict(comm: Communicator, device: torch.device) -> bool:
    """Ranks > 0, after each round of a stoppable request: rank 0's verdict."""
    return bool(comm.broadcast(torch.zeros(1, dtype=torch.long, device=device)).item())
