"""The generation loop. ``spec="none"``: plain decoding, one token a round.

Stop rule: a round's tokens are emitted in order; the first EOS (unless ``ignore_eos``) or stop
token ends the request and is itself included in ``token_ids`` (finish_reason "stop"); reaching
``max_tokens`` or the context limit ends it with finish_reason "length". Nothing after the stop
point is emitted.

Timing: ``prefill_s`` covers the prompt forward that yields the first token; ``decode_s`` the rest;
``tokens_per_s`` = tokens produced after the first / decode_s (decode speed, prefill excluded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..model.target import Target
from ..sampling import SamplingParams, make_generator, sample


class PromptError(ValueError):
    """The prompt cannot be run (empty, too long, ids outside the vocabulary)."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: dict[str, Any] = field(default_factory=dict)
    text: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(target: Target, prompt_ids: list[int]) -> None:
    cfg = target.cfg
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) >= cfg.max_position_embeddings:
        raise PromptError(f"prompt has {len(prompt_ids)} tokens; max_position_embeddings is "
                          f"{cfg.max_position_embeddings}")
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})")


class Emitter:
    """Applies the stop rule to a round's tokens and forwards what is emitted."""

    def __init__(self, target: Target, params: SamplingParams, limit: int,
                 on_tokens: Callable[[list[int]], None] | None) -> None:
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(target.cfg.eos_token_ids))
        self.limit = limit
        self.on_tokens = on_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    def push(self, toks: list[int]) -> bool:
        """Emit tokens in order; returns True when the request is finished."""
        out: list[int] = []
        for t in toks:
            if len(self.tokens) + len(out) >= self.limit:
                self.finish_reason = "length"
                break
            out.append(t)
            if t in self.stops:
                self.finish_reason = "stop"
                break
        if len(self.tokens) + len(out) >= self.limit and self.finish_reason is None:
            self.finish_reason = "length"
        self.tokens.extend(out)
        if out and self.on_tokens is not None:
            self.on_tokens(out)
        return self.finish_reason is not None


def generate(target: Target, prompt_ids: list[int], params: SamplingParams, *,
             on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Plain decoding of one request."""
    check_prompt(target, prompt_ids)
    cfg = target.cfg
    dev = target.device
    limit = min(params.max_tokens, cfg.max_position_embeddings - len(prompt_ids))
    emit = Emitter(target, params, limit, on_tokens)
    gen = make_generator(params.seed, dev)
    cache = target.new_cache(len(prompt_ids) + max(limit, 1))
    stats: dict[str, Any] = {"prompt_tokens": len(prompt_ids)}
    if limit == 0:
        return GenerationResult([], "length", {**stats, "generated_tokens": 0, "prefill_s": 0.0,
                                               "decode_s": 0.0, "tokens_per_s": 0.0})
    _sync(dev)
    t0 = time.perf_counter()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
    logits = target(ids, cache).logits[-1]
    tok = int(sample(logits, params, gen))
    _sync(dev)
    t1 = time.perf_counter()
    done = emit.push([tok])
    rounds = 0
    while not done:
        logits = target(torch.tensor([tok], device=dev), cache).logits[-1]
        tok = int(sample(logits, params, gen))
        rounds += 1
        done = emit.push([tok])
    _sync(dev)
    t2 = time.perf_counter()
    decode_s = t2 - t1
    n = len(emit.tokens)
    stats.update(generated_tokens=n, prefill_s=t1 - t0, decode_s=decode_s,
                 tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, rounds=rounds)
    return GenerationResult(emit.tokens, emit.finish_reason or "length", stats)
