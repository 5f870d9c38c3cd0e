"""The ranks' request loop: rank 0 sends each request (a few small integer tensors: the prompt ids and the
sampling parameters) before running it; every other rank receives it and runs the same generation, so all ranks
take the same collectives in the same order. The emitted tokens are identical on every rank (the vocabulary
reductions give every rank the same picks); only rank 0 returns them to the user."""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, replace

import torch

from ..sampling import SamplingParams
from .comm import Communicator

STOP, GENERATE = 0, 1
HEADER = 10  # op, prompt length, max_tokens, top_k, seed, ignore_eos, stop ids, plain, temperature, top_p


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    plain: bool = False  # plain decoding whatever the engine's speculative method (the CLI's --compare)


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
            int(p.ignore_eos), len(p.stop_token_ids), int(req.plain), float_bits(float(p.temperature)),
            float_bits(float(p.top_p))]
    comm.broadcast(torch.tensor(head, dtype=torch.long, device=device))
    comm.broadcast(torch.tensor(req.prompt_ids + list(p.stop_token_ids), dtype=torch.long, device=device))
    return req


def send_stop(comm: Communicator, device: torch.device) -> None:
    comm.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long, device=device))


def recv_request(comm: Communicator, device: torch.device) -> Request | None:
    """Ranks > 0: the next request from rank 0, or None when rank 0 stops."""
    head = comm.broadcast(torch.zeros(HEADER, dtype=torch.long, device=device)).tolist()
    if head[0] == STOP:
        return None
    _, n, max_tokens, top_k, seed, ignore_eos, n_stop, plain, temp, top_p = head
    ids = comm.broadcast(torch.zeros(n + n_stop, dtype=torch.long, device=device)).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=bits_float(temp), top_p=bits_float(top_p),
                            top_k=top_k, seed=None if seed < 0 else seed, stop_token_ids=tuple(ids[n:]),
                            ignore_eos=bool(ignore_eos))
    return Request(ids[:n], params, bool(plain))
