"""Logits to tokens: greedy, temperature, top-k, top-p, with seeded generators.

The one place where a distribution over the vocabulary is formed from logits. The accept walk of
speculative decoding samples the target through :func:`sample` at every tree node, so plain decoding
and speculative decoding share the same rule and, for greedy, the same tie-breaking (lowest id).
The drafter's top-k log-probs (:func:`topk_logprobs`) are formed here too. ``policy``: the model's kernel
policy (``target.policy``), which picks the row kernels (kernels/dispatch.py). ``vocab``: the target's
vocabulary slice when it is tensor parallel (``target.vocab``; the logits are then that slice, parallel/vocab.py
reduces across the ranks); None (one device) runs the code below unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SamplingError
from .kernels.dispatch import draft_topk, row_argmax
from .kernels.policy import KernelPolicy
from .parallel.vocab import VocabShard, rule_probs_shard, vocab_argmax, vocab_race, vocab_topk_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. ``temperature == 0`` means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise SamplingError(f"sampling field 'max_tokens' must be an integer >= 0, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0.0 or t == float("inf"):
            raise SamplingError(f"sampling field 'temperature' must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0:
            raise SamplingError(f"sampling field 'top_p' must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"sampling field 'top_k' must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingError(f"sampling field 'seed' must be an integer or None, got {self.seed!r}")
        for s in self.stop_token_ids:
            if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                raise SamplingError(f"sampling field 'stop_token_ids' must hold token ids >= 0, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"sampling field 'ignore_eos' must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device``: seeded when ``seed`` is given, else from fresh entropy."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def greedy(logits: torch.Tensor, *, policy: KernelPolicy, vocab: VocabShard | None = None) -> torch.Tensor:
    """Argmax over the last axis; ties go to the lowest token id.  [..., V] -> [...]"""
    if vocab is not None:
        return vocab_argmax(policy, vocab, logits)
    # torch.argmax returns the first maximal index on every backend (documented); on CUDA the dispatch's
    # one-program-per-row kernel returns the same index
    return row_argmax(policy, logits)


def topk_logprobs(logits: torch.Tensor, k: int, *, policy: KernelPolicy,
                  vocab: VocabShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k log-probabilities of raw drafter logits (no temperature).

    logits [L, V] -> (lp [L, k] float32, descending; ids [L, k] long), k capped at V. The kernel choice is
    the dispatch's (kernels/dispatch.py draft_topk); kernels/reference.py topk_logprobs_torch is the torch path.
    Tensor parallel (``vocab``): the ranks' candidates merged in a fixed order, ties to the lowest id, so every
    rank builds the same tree.
    """
    if vocab is not None:
        return vocab_topk_logprobs(vocab, logits, k)
    return draft_topk(policy, logits, k)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams, *, policy: KernelPolicy) -> torch.Tensor:
    """float32 probabilities [..., V] of the token the rule would emit.

    Greedy gives a one-hot at the argmax. Otherwise softmax(logits / temperature) restricted to the
    top-k tokens and then to the smallest top-p nucleus (the top token is always kept), renormalized.
    """
    if params.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter_(-1, greedy(logits, policy=policy).unsqueeze(-1), 1.0)
    return rule_probs(logits, float(params.temperature), params.top_k,
                      float(params.top_p) if params.top_p < 1.0 else None)


def rule_probs(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int,
               top_p: float | torch.Tensor | None) -> torch.Tensor:
    """The sampling rule's float32 probabilities [..., V] (see :func:`probs_from_logits`); ``top_p`` None:
    no nucleus. ``temperature`` and ``top_p`` may be 0-d tensors, so that a CUDA graph reads the values
    they hold at each replay (``top_k`` sets shapes: it stays a Python int)."""
    x = logits.float() / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p is not None:
        sp, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass strictly before each sorted entry
        drop_sorted = before >= top_p  # the first entry has before == 0 and is always kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
           policy: KernelPolicy, vocab: VocabShard | None = None) -> torch.Tensor:
    """One token per row: logits [V] -> LongTensor [] ; [T, V] -> LongTensor [T]. No host sync."""
    if params.greedy:
        return greedy(logits, policy=policy, vocab=vocab)
    if vocab is not None:
        return sample_shard(logits, params, generator, vocab)
    probs = probs_from_logits(logits, params, policy=policy)
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    tok = torch.multinomial(flat, 1, generator=generator).squeeze(-1)  # [R]
    return tok.reshape(probs.shape[:-1])


def sample_shard(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 vocab: VocabShard) -> torch.Tensor:
    """:func:`sample` from this rank's vocabulary slice [..., V / N]: the rule's probabilities over the whole
    vocabulary (parallel/vocab.py), then the exponential race with noise drawn for the WHOLE vocabulary from
    ``generator``, which every rank seeds alike, so every rank picks the same token. torch.multinomial draws
    one sample by this race with the same noise, so the tokens are those of one device up to the rounding of
    the softmax normaliser."""
    flat = logits.reshape(-1, logits.shape[-1])  # [R, V / N]
    probs = rule_probs_shard(vocab, flat, float(params.temperature), params.top_k,
                             float(params.top_p) if params.top_p < 1.0 else None)
    noise = torch.empty(flat.shape[0], vocab.total, dtype=torch.float32, device=flat.device)
    tok = vocab_race(vocab, probs, noise.exponential_(generator=generator))  # [R]
    return tok.reshape(logits.shape[:-1])


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row by the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d.

    probs [..., V] (the rule's probabilities), noise [..., V] float32 (the caller draws it:
    ``noise.exponential_(generator=g)``) -> LongTensor [...]. The winner is distributed as p (p_i = 0
    never wins), and no random number is drawn here, so a CUDA graph can replay it with fresh noise
    written into the same buffer each time.
    """
    return torch.argmax(probs / noise.clamp_min(1e-30), dim=-1)  # E = 0 (u = 0) must not give 0 / 0


def race_rule(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int, top_p: float | torch.Tensor | None,
              noise: torch.Tensor, vocab: VocabShard | None = None) -> torch.Tensor:
    """The rule's pick per row by the race with the given noise [..., V] (no random number drawn here; see
    :func:`race`); ``vocab``: this rank's vocabulary slice of the logits (the noise covers the whole vocabulary)."""
    if vocab is None:
        return race(rule_probs(logits, temperature, top_k, top_p), noise)
    return vocab_race(vocab, rule_probs_shard(vocab, logits, temperature, top_k, top_p), noise)
