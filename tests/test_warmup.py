"""The start-up warm-up (kdtree_engine/warmup.py) on the CPU: its prompt lengths meet every kernel-variant class of
the lengths below the chunk (checked against an independent enumeration of the classes), it runs each through the
request path it is given, and it leaves the latent cache pool as it found it (every block free)."""

from __future__ import annotations

import gc
import pytest

from kdtree_engine import LLM, SamplingParams
from kdtree_engine.config import preset
from kdtree_engine.model.target import Target
from kdtree_engine.speculative.decode import generate
from kdtree_engine.warmup import DENSE, ROUND_TOKENS, longest_prompt, warm_up, warmup_lengths


def v2(n: int) -> int:
    """The 2-adic order of n, capped at 4: which multiples c x n are multiples of 16."""
    k = 0
    while n % 2 == 0 and k < 4:
        n //= 2
        k += 1
    return k


def quarter(n: int) -> tuple[int, int]:
    """(power of two p <= n, which quarter of [p, 2p) holds n): the bucket edges a length can cross."""
    p = 1 << (n.bit_length() - 1)
    return p, (n - p) * 4 // p


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield
    gc.unfreeze()   # the warm-up freezes what start-up made; the other tests' objects stay collectable


@pytest.mark.parametrize("longest", [1, 7, 64, 65, 100, 1000, 4096, 4000])
def test_lengths_meet_every_class(longest: int) -> None:
    lengths = warmup_lengths(longest)
    assert lengths == sorted(set(lengths)) and lengths[0] == 1 and lengths[-1] == longest
    warmed = set(lengths)
    have = {(quarter(w), v2(w)) for w in warmed if w > DENSE}
    for T in range(1, longest + 1):
        # a length up to DENSE is warmed itself; a longer one has a warmed length of its quarter and 2-adic order
        assert T in warmed if T <= DENSE else (quarter(T), v2(T)) in have, T


def test_longest_prompt_leaves_room() -> None:
    assert longest_prompt(4096, 10**6, 4096, 17) < 4096 - ROUND_TOKENS
    assert longest_prompt(4096, 10**6, 512, 17) == 512
    assert longest_prompt(4096, 2000, 4096, 17) < 1000
    assert longest_prompt(8, 8, 4096, 17) == 1


def test_warm_up_runs_each_length_and_frees_the_pool() -> None:
    target = Target.random(preset("k2-tiny"), seed=3)
    pool = target.init_cache_pool(tokens=4096)
    free = pool.free_ids()
    seen: list[tuple[int, int, bool]] = []

    def run(ids: list[int], params: SamplingParams, plain: bool):
        seen.append((len(ids), params.max_tokens, plain))
        res = generate(target, ids, params)
        assert len(res.token_ids) == params.max_tokens   # EOS ignored: the tokens asked for
        return res

    report = warm_up(run, vocab_size=target.cfg.vocab_size, max_position_embeddings=target.cfg.max_position_embeddings,
                     free_tokens=pool.free_tokens, round_nodes=1, device=target.device, chunk=80, drafting=False)
    assert report.lengths == tuple(warmup_lengths(80)) and report.decode_requests == 1
    assert seen == [(T, 1, False) for T in report.lengths] + [(DENSE, ROUND_TOKENS, False)]
    assert report.compiled in (None, 0) and report.seconds > 0   # the CPU path compiles nothing
    assert pool.free_ids() == free and pool.free_blocks == pool.num_blocks and gc.get_freeze_count() > 0
    assert "80 prompt lengths" not in report.line() and f"{len(report.lengths)} prompt lengths" in report.line()


def test_llm_warm_up_with_the_drafter_leaves_the_pool_free() -> None:
    llm = LLM(device="cpu", progress=False, cache_tokens=8192, threads=1)   # the demo: DDTree 16, no warm-up on the CPU
    assert llm.warm_up_report is None
    pool = llm.target.pool()
    free = pool.free_ids()
    report = llm.warm_up(chunk=70)
    assert report.lengths == tuple(warmup_lengths(70)) and report.decode_requests == 2
    assert pool.free_ids() == free and pool.free_blocks == pool.num_blocks
    before = llm.generate([list(range(5, 40))], SamplingParams(max_tokens=8))[0]
    assert len(before.token_ids) == 8 and pool.free_blocks == pool.num_blocks
