"""The paged latent cache (kdtree_engine/cache.py): a block pool per target, a block table per request.

Oracles: a contiguous buffer (the cache before paging) for the torch attention paths, written out here; the same
target on a fresh pool (blocks in order) for whole forwards on a pool whose free list was shuffled (non-contiguous
block ids); plain set arithmetic for the pool's accounting. Seeds are printed."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kdtree_engine.cache import BLOCK, CachePool, LatentCache
from kdtree_engine.cli import main
from kdtree_engine.config import preset
from kdtree_engine.errors import BadInput, PoolFullError, PromptError
from kdtree_engine.kernels.dispatch import mla_attention, mla_attention_static
from kdtree_engine.kernels.mla_attention import mla_attention as kernel_attention
from kdtree_engine.kernels.mla_attention import mla_attention_device as kernel_attention_device
from kdtree_engine.kernels.paged import gather_slots, page_rows
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.context import static_visibility
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate, generate_device
from kdtree_engine.speculative.graph import ROUNDS

C, R = 16, 8
POLICY = KernelPolicy.from_env()


def seeded() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def shuffle_free_list(pool: CachePool, gen: torch.Generator) -> None:
    """Take every free block one at a time and give them back in a random order: the next requests get
    non-contiguous, shuffled block ids."""
    blocks = [pool.take(1)[0] for _ in range(pool.free_blocks)]
    for i in torch.randperm(len(blocks), generator=gen).tolist():
        pool.give([blocks[i]])


def contiguous_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The absorbed attention over a contiguous buffer kv [S, C+R], visible [T, S] (the cache before paging)."""
    s = (torch.einsum("tnc,sc->nts", q_lat.double(), kv[:, :C].double())
         + torch.einsum("tnr,sr->nts", q_pe.double(), kv[:, C:].double())) * scale
    p = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("nts,sc->tnc", p, kv[:, :C].double())


def tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        mask[i, i] = True
    return mask


def paged_copy(kv: torch.Tensor, gen: torch.Generator, spare: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [S, D] scattered into a pool layer [blocks, BLOCK, D] of junk through a shuffled table."""
    pages = -(-kv.shape[0] // BLOCK)
    pool = 1e3 * torch.randn(pages + spare, BLOCK, kv.shape[1], generator=gen)
    table = torch.randperm(pages + spare, generator=gen)[:pages].to(torch.int32)
    if pages > 1 and bool((table[1:] > table[:-1]).all()):
        table = table.flip(0)  # a draw in ascending order would not test the table's order
    flat = pool.view(-1, kv.shape[1])
    slots = torch.arange(kv.shape[0])
    flat[table.long()[slots // BLOCK] * BLOCK + slots % BLOCK] = kv
    return pool, table


def test_page_rows_and_gather_follow_the_table() -> None:
    gen = torch.Generator().manual_seed(seeded())
    kv = torch.randn(300, 5, generator=gen)
    pool, table = paged_copy(kv, gen)
    assert table.tolist() != sorted(table.tolist())
    slots = torch.randperm(300, generator=gen)[:40]
    assert torch.equal(pool.view(-1, 5)[page_rows(table, slots, BLOCK)], kv[slots])
    assert torch.equal(gather_slots(pool, table, 300), kv)
    assert torch.equal(gather_slots(pool, table, 250, 70), kv[70:250])


@pytest.mark.parametrize("T,S,kind", [(1, 150, "decode"), (7, 200, "tree"), (5, 0, "tree"), (9, 64, "causal")])
def test_paged_attention_equals_the_contiguous_oracle(T: int, S: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(seeded())
    N = 3
    q_lat, q_pe = torch.randn(T, N, C, generator=gen), torch.randn(T, N, R, generator=gen)
    kv = torch.randn(S + T, C + R, generator=gen)
    pool, table = paged_copy(kv, gen)
    mask = tree_mask(T, gen) if kind == "tree" else torch.ones(T, T, dtype=torch.bool).tril()
    visible = torch.cat([torch.ones(T, S, dtype=torch.bool), mask], dim=1)
    want = contiguous_attention(q_lat, q_pe, kv, visible, 0.3)
    eager = mla_attention(POLICY, q_lat, q_pe, pool, table, S, mask if kind == "tree" else None, 0.3, C)
    torch.testing.assert_close(eager.double(), want, rtol=1e-5, atol=1e-5)
    # the device-resident form: all the request's slots, the length on the device (junk past S + T)
    cap = table.numel() * BLOCK
    vis = static_visibility(torch.tensor(S), mask, cap)
    static = mla_attention_static(POLICY, q_lat, q_pe, pool, table, cap, torch.tensor(S), mask, vis, 0.3, C)
    torch.testing.assert_close(static.double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.random(preset("k2-tiny"), seed=3)


def shuffled_target(target: Target, gen: torch.Generator, blocks: int = 40) -> Target:
    """The same weights over a pool of shuffled blocks (the target's pool is replaced for the test)."""
    target.cache_pool = CachePool(target.cfg, blocks, dtype=target.dtype, device=target.device)
    shuffle_free_list(target.cache_pool, gen)
    return target


def test_forwards_on_shuffled_blocks_equal_a_fresh_pool(target: Target) -> None:
    """Prefill in chunks (both forms), a tree step, commit, decode: logits and committed latents bit for bit
    those of a pool whose blocks are handed out in order."""
    seed = seeded()
    gen = torch.Generator().manual_seed(seed)
    T = 3 * BLOCK + 17
    ids = torch.randint(0, target.cfg.vocab_size, (T,), generator=gen)
    tree_ids = torch.randint(0, target.cfg.vocab_size, (6,), generator=gen)
    mask = tree_mask(6, gen)
    keep = torch.tensor([0, 2, 3])
    runs = []
    for shuffled in (False, True):
        target.cache_pool = CachePool(target.cfg, 40, dtype=target.dtype, device=target.device)
        if shuffled:
            shuffle_free_list(target.cache_pool, torch.Generator().manual_seed(seed + 1))
        cache = target.new_cache(T + 16)
        assert (cache.table.tolist() == list(range(cache.table.numel()))) != shuffled
        pre = target.prefill(ids, cache, chunk=BLOCK + 5, all_logits=True)
        pos = T + mask.sum(1) - 1
        tree = target(tree_ids, cache, positions=pos, tree_mask=mask).logits
        cache.commit(keep)
        dec = target(tree_ids[:1], cache).logits
        runs.append((pre.logits, tree, dec, cache.kv[:, :cache.length]))
        cache.release()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_compact_static_moves_entries_within_the_request_blocks(target: Target) -> None:
    gen = torch.Generator().manual_seed(seeded())
    shuffled_target(target, gen)
    a, b = target.new_cache(200), target.new_cache(200)
    values = torch.randn(target.cfg.num_hidden_layers, 200, target.cfg.kv_cache_dim, generator=gen)
    a.load_slots(values)
    b.load_slots(values)
    a.length = 120
    a.reserve(10)
    a.commit(torch.tensor([0, 3, 4, 9]))
    b.compact_static(torch.tensor(120), torch.tensor([0, 3, 4, 9, 1, 2]))
    want = torch.cat([values[:, :120], values[:, [120, 123, 124, 129]]], dim=1)
    assert torch.equal(a.kv[:, :124], want) and torch.equal(b.kv[:, :124], want)
    a.release()
    b.release()


def test_pool_accounting_over_1000_random_requests() -> None:
    seed = seeded()
    rng = random.Random(seed)
    pool = CachePool(preset("k2-tiny"), 50, dtype=torch.float32, device="cpu")
    start = sorted(pool.free_ids())
    live: list[LatentCache] = []
    for _ in range(1000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).release()
            continue
        ask = rng.randint(1, 12 * BLOCK)
        if -(-ask // BLOCK) > pool.free_blocks:
            with pytest.raises(PoolFullError, match=f"{ask} tokens asked, {pool.free_tokens} free"):
                LatentCache(pool, ask)
            continue
        cache = LatentCache(pool, ask)
        assert len(set(cache.table.tolist())) == cache.table.numel()
        held = {b for c in live for b in c.blocks}
        assert not held & set(cache.blocks)  # no block is handed out twice
        live.append(cache)
    for cache in live:
        cache.release()
        cache.release()  # twice: a no-op
    assert sorted(pool.free_ids()) == start and pool.free_blocks == 50


def test_generate_returns_the_blocks_at_the_end_and_on_error(target: Target) -> None:
    gen = torch.Generator().manual_seed(seeded())
    pool = shuffled_target(target, gen).cache_pool
    free = pool.free_blocks
    prompt = torch.randint(0, target.cfg.vocab_size, (70,), generator=gen).tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = generate(target, prompt, params)
    assert len(ref.token_ids) == 5 and pool.free_blocks == free

    def fail(tokens: list[int]) -> bool:
        raise RuntimeError("client gone")

    with pytest.raises(RuntimeError, match="client gone"):
        generate(target, prompt, params, on_tokens=fail)
    assert pool.free_blocks == free
    assert generate(target, prompt, params).token_ids == ref.token_ids  # blocks reused, the same tokens
    cancelled = generate(target, prompt, params, on_tokens=lambda tokens: True)  # the client ends it
    assert cancelled.finish_reason == "abort" and pool.free_blocks == free


def test_a_cached_device_round_takes_fresh_blocks_per_request(target: Target) -> None:
    """Device-resident rounds keep their block table tensor between requests and take blocks into it again."""
    gen = torch.Generator().manual_seed(seeded())
    pool = shuffled_target(target, gen).cache_pool
    free = pool.free_blocks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for n in (90, 20, 130):
        prompt = torch.randint(0, target.cfg.vocab_size, (n,), generator=gen).tolist()
        got = generate_device(target, prompt, params, method="none", graph=False)
        assert got.token_ids == generate(target, prompt, params).token_ids
        assert pool.free_blocks == free
        pool.take(1)  # the next request's blocks differ from this one's
        free -= 1
    ROUNDS.clear(target)


def test_a_prompt_past_the_pool_is_refused_before_any_forward(target: Target, monkeypatch) -> None:
    target.cache_pool = CachePool(target.cfg, 2, dtype=target.dtype, device=target.device)
    monkeypatch.setattr(Target, "prefill", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(PromptError, match="prompt has 300 tokens; .* latent cache of 128 tokens"):
        generate(target, [1] * 300, SamplingParams(max_tokens=4))
    with pytest.raises(PoolFullError, match="300 tokens asked, 128 free"):
        target.new_cache(300)
    assert target.cache_pool.free_blocks == 2


def test_pool_sizing() -> None:
    cfg = preset("k2-tiny")
    t = Target(cfg)
    with pytest.raises(BadInput, match="memory_fraction=0.5"):
        t.init_cache_pool(fraction=0.5)  # CPU: host memory is not accounted
    with pytest.raises(BadInput, match="cache_tokens=3"):
        t.init_cache_pool(tokens=3)
    pool = t.init_cache_pool(tokens=1000)
    # 16 blocks for requests, and the trash block past them (padded rows of replayed steps write there)
    assert pool.total_tokens == 16 * BLOCK and pool.kv.shape == (cfg.num_hidden_layers, 17, BLOCK, cfg.kv_cache_dim)
    assert pool.trash == 16 and pool.trash not in pool.free_ids()
    with pytest.raises(ValueError, match="already made"):
        t.init_cache_pool(tokens=1000)
    default = Target(cfg).new_cache(10).pool  # made on first use: 2 x max_position_embeddings on the CPU
    assert default.total_tokens == 2 * cfg.max_position_embeddings


def test_cli_prompt_past_the_pool_exits_2_with_one_line(capsys) -> None:
    ids = ",".join(["5"] * 200)
    assert main(["generate", "--prompt-ids", ids, "--cache-tokens", "128", "--spec", "none", "--max-tokens", "3",
                 "--no-compare"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kdtree: error: prompt has 200 tokens") and "128" in err[-1], err
    with pytest.raises(SystemExit) as exited:  # argparse's own exit
        main(["generate", "--prompt-ids", "1,2", "--gpu-memory-fraction", "1.5"])
    assert exited.value.code == 2
    assert "--gpu-memory-fraction must be a number in (0, 1]" in capsys.readouterr().err


def test_the_kernel_entry_refuses_bad_tables() -> None:
    # the Triton entry's checks run before any launch
    q_lat, q_pe = torch.zeros(2, 3, C), torch.zeros(2, 3, R)
    pool = torch.zeros(4, BLOCK, C + R)
    with pytest.raises(ValueError, match="covers 1 x 64 slots, fewer than 100"):
        kernel_attention(q_lat, q_pe, pool, 98, None, 0.1, C, table=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 table"):
        kernel_attention(q_lat, q_pe, pool, 10, None, 0.1, C, table=torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="capacity"):
        kernel_attention_device(q_lat, q_pe, pool, torch.tensor(10), torch.ones(2, 2, dtype=torch.bool), 0.1, C,
                                    table=torch.tensor([2, 1], dtype=torch.int32))
