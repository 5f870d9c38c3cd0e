"""Toy targets and drafters for the speculative decoding tests.

PrefixTarget: a target whose next-token logits are a fixed random function of the *whole* prefix,
implemented with the Target interface (tree mask, pending entries, commit). Its exact sequence
distribution is computable by enumeration and a forward costs microseconds, so distribution tests
can draw thousands of samples through the real harness. Its aux features encode (position, token)
of each prefix so drafters can check the context they are fed.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch

from kdtree_engine.config import preset
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.prefill import PrefillOutput
from kdtree_engine.model.target import TargetOutput
from kdtree_engine.sampling import SamplingParams, probs_from_logits

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


class PrefixCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens: list[int] = []
        self.pending: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def commit(self, keep: torch.Tensor) -> None:
        k = keep.tolist()
        assert k and k[0] == 0 and k == sorted(set(k)), k
        self.tokens += [self.pending[i] for i in k]
        self.pending = []

    def crop(self, n: int) -> None:
        self.tokens = self.tokens[:n]
        self.pending = []


class ToyPool:
    """What the continuous-batch scheduler reads of a target's cache pool: room enough for every request."""

    total_tokens = max_context = free_tokens = 1 << 20
    free_blocks = num_blocks = 1 << 14


class PrefixTarget:
    def __init__(self, vocab: int, seed: int = 0, scale: float = 1.5, eos: int = 0, hidden: int = 4) -> None:
        self.cfg = preset("k2-tiny").replace(vocab_size=vocab, eos_token_ids=(eos,), hidden_size=64)
        self.vocab, self.seed, self.scale, self.hidden = vocab, seed, scale, hidden
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.policy = POLICY   # the kernel policy a target holds (its greedy / sampling picks)
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}
        g = torch.Generator().manual_seed(seed + 1)
        self.embed_table = torch.randn(vocab, hidden, generator=g)
        self.head = torch.randn(hidden, vocab, generator=g)
        self.forwards = 0

    def logits_of(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._memo:
            g = torch.Generator().manual_seed(_seed_of(self.seed, prefix))
            self._memo[prefix] = torch.randn(self.vocab, generator=g) * self.scale
        return self._memo[prefix]

    def new_cache(self, max_tokens: int) -> PrefixCache:
        return PrefixCache(max_tokens)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_table[ids]

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.head).float()

    def __call__(self, *a, **k) -> TargetOutput:
        return self.forward(*a, **k)

    def forward(self, ids, cache, positions=None, tree_mask=None, aux_layers=()) -> TargetOutput:
        self.forwards += 1
        toks = ids.tolist()
        T = len(toks)
        base = list(cache.tokens)
        assert len(base) + T <= cache.capacity
        pos = list(range(len(base), len(base) + T)) if positions is None else positions.tolist()
        rows, aux = [], []
        for i in range(T):
            if tree_mask is None:
                prefix = base + toks[:i + 1]
            else:
                m = tree_mask[i].tolist()
                assert m[i] and all(not m[j] for j in range(i + 1, T)), "mask must be ancestor-or-self"
                prefix = base + [toks[j] for j in range(T) if m[j]]
            assert pos[i] == len(prefix) - 1, (pos[i], len(prefix))
            rows.append(self.logits_of(tuple(prefix)))
            aux.append(torch.tensor([float(pos[i]), float(prefix[-1])] * len(aux_layers)))
        if tree_mask is None:
            cache.tokens += toks
        else:
            cache.pending = toks
        return TargetOutput(logits=torch.stack(rows), aux=torch.stack(aux) if aux_layers else None)

    def pool(self) -> ToyPool:
        return ToyPool()

    def forward_batch(self, parts, aux_layers=()) -> list[TargetOutput]:
        """Each part through :meth:`forward`, its logits rows as the part asks (Target.forward_batch's contract)."""
        outs = []
        for p in parts:
            out = self.forward(p.ids, p.cache, p.positions, p.tree_mask, aux_layers)
            rows = {"all": out.logits, "last": out.logits[-1:], "none": out.logits[:0]}[p.logits]
            outs.append(TargetOutput(logits=rows, aux=out.aux))
        return outs

    def prefill(self, ids, cache, aux_layers=(), chunk=None) -> PrefillOutput:
        out = self.forward(ids, cache, aux_layers=aux_layers)
        return PrefillOutput(out.logits[-1:], out.aux, chunks=1, chunk=len(ids), peak_bytes=0)

    def sequence_distribution(self, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
        """Exact P(first n emitted tokens) under the target's own rule (ignore_eos assumed)."""
        out: dict[tuple[int, ...], float] = {}
        for seq in itertools.product(range(self.vocab), repeat=n):
            p = 1.0
            for i in range(n):
                p *= float(probs_from_logits(self.logits_of(tuple(prompt) + seq[:i]), params, policy=POLICY)[seq[i]])
                if p == 0.0:
                    break
            if p > 0:
                out[seq] = p
        return out


class SimpleDraftCache:
    def __init__(self) -> None:
        self.length = 0
        self.history: list[int] = []  # ToyDrafter with decode_ctx: the tokens fed so far (one request's)

    def crop(self, n: int) -> None:
        self.length = n


class ToyDrafter:
    """Drafter with the DFlashDrafter protocol whose proposals come from a callable.

    ``fn(start, bonus, B, history) -> logits [B-1, V]``; ``history`` = committed tokens + bonus when
    ``decode_ctx`` (PrefixTarget features encode (position, token)), else None. It checks the
    harness's context bookkeeping: each call is fed exactly the tokens at positions
    cache.length .. start-1 (positions verified when ``decode_ctx``; ``check_ctx`` for more).
    """

    def __init__(self, block_size: int, fn, target_layer_ids=(0,), decode_ctx: bool = False, check_ctx=None) -> None:
        self.block_size = block_size
        self.target_layer_ids = tuple(target_layer_ids)
        self.fn = fn
        self.decode_ctx = decode_ctx
        self.check_ctx = check_ctx
        self.calls = 0

    def new_cache(self, max_tokens: int) -> SimpleDraftCache:
        return SimpleDraftCache()

    def propose(self, target, ctx, bonus, cache, start) -> torch.Tensor:
        self.calls += 1
        assert ctx is not None and ctx.shape[0] == start - cache.length, (ctx.shape, start, cache.length)
        if self.check_ctx is not None:
            self.check_ctx(ctx, cache.length, start)
        hist = None
        if self.decode_ctx:
            assert ctx[:, 0].tolist() == list(range(cache.length, start)), (ctx[:, 0], cache.length, start)
            assert len(cache.history) == cache.length
            cache.history += [int(t) for t in ctx[:, 1].tolist()]
            hist = cache.history + [int(bonus)]
        cache.length = start
        return self.fn(start, int(bonus), self.block_size, hist)


def random_proposals(vocab: int, seed: int, scale: float = 3.0):
    def fn(start: int, bonus: int, B: int, hist=None) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed_of("draft", seed, start, bonus))
        return torch.randn(B - 1, vocab, generator=g) * scale
    return fn


def oracle_proposals(future: list[int], vocab: int, seed: int = 0, miss: float = 0.0):
    """Logits that rank the true future token first (or, with prob ``miss``, second)."""
    def fn(start: int, bonus: int, B: int, hist=None) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed_of("oracle", seed, start, bonus))
        logits = torch.randn(B - 1, vocab, generator=g)
        for k in range(1, B):
            if start + k < len(future):
                t = future[start + k]
                if float(torch.rand((), generator=g)) < miss:
                    other = (t + 1 + int(torch.randint(0, vocab - 1, (), generator=g))) % vocab
                    logits[k - 1, other] = 12.0
                    logits[k - 1, t] = 11.0
                else:
                    logits[k - 1, t] = 12.0
        return logits
    return fn


def target_chain_proposals(target: "PrefixTarget", temperature: float = 1.0):
    """A good drafter for PrefixTarget: position k gets the target's own logits along the greedy
    chain of the target (so drafts are often, but not always, accepted when the target samples)."""
    def fn(start: int, bonus: int, B: int, hist=None) -> torch.Tensor:
        assert hist is not None
        prefix, rows = list(hist), []
        for _ in range(B - 1):
            lg = target.logits_of(tuple(prefix)) / temperature
            rows.append(lg)
            prefix.append(int(torch.argmax(lg)))
        return torch.stack(rows)
    return fn


def first_tokens_distribution(target, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """Exact distribution of the first n sampled tokens of a real target, enumerated with plain forwards
    (the oracle for sampled speculative output; the rule must keep few tokens per step, e.g. top_k)."""
    out: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple, float] = {}
        for seq, pr in out.items():
            ids = prompt + list(seq)
            logits = target(torch.tensor(ids, device=target.device), target.new_cache(len(ids) + 1)).logits[-1]
            probs = probs_from_logits(logits, params, policy=POLICY)
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (tok,)] = pr * float(probs[tok])
        out = nxt
    return out


def chi_square_pvalue(counts: dict, probs: dict[tuple, float], n: int) -> tuple[float, float]:
    """Pearson chi-square of observed counts against exact probabilities; bins with expected < 5
    are pooled. Returns (statistic, p-value)."""
    observed_outside = sum(c for k, c in counts.items() if k not in probs)
    if observed_outside:
        return math.inf, 0.0
    small_e, small_o, stat, bins = 0.0, 0, 0.0, 0
    for k, p in probs.items():
        e = p * n
        o = counts.get(k, 0)
        if e < 5:
            small_e += e
            small_o += o
        else:
            stat += (o - e) ** 2 / e
            bins += 1
    if small_e > 0:
        stat += (small_o - small_e) ** 2 / small_e
        bins += 1
    df = max(bins - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p
