"""The paged latent cache on the GPU (bf16, batch invariance on):

1. the Triton MLA attention launches (chunk kernel, warpgroup decode and verify kernels) reading a pool of shuffled
   pages through a block table equal the same launches on the contiguous buffer bit for bit (host- and
   device-length), and the float reference within bf16 error, at K2's latent widths;
2. greedy ``dflash`` / ``ddtree`` emit exactly the tokens of ``none`` with prompts spanning many blocks, on a pool
   whose free list was shuffled (every request's block table non-contiguous), eager rounds and graph replays.

    python3 -m pytest -m gpu tests/gpu/test_paged_gpu.py -v -s
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kdtree_engine.cache import BLOCK, CachePool
from kdtree_engine.kernels.mla_attention import default_config, mla_attention, mla_attention_device
from kdtree_engine.kernels.reference import mla_attention_reference
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate

from test_bitwise_gpu import MODES, OracleDrafter, tiny_target
from test_mla_attention_gpu import SCALE, inputs, random_tree_mask, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

C, R = 512, 64
CONFIGS = {"default": {}, "decode_wg": dict(DECODE_WG=2), "verify_wg": dict(VERIFY_WG=2, DECODE_MAX_T=1),
           "chunk": dict(DECODE_WG=0, VERIFY_WG=0)}


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(np.random.default_rng().integers(1 << 30))
    print(f"\npaged GPU tests: seed {s}")
    return s


def paged(kv: torch.Tensor, gen: torch.Generator, spare: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv [S, D] in a pool layer [pages + spare, BLOCK, D] of finite junk through a shuffled table; also the
    contiguous view of the table's pages (the oracle buffer of a device-length launch)."""
    pages = -(-kv.shape[0] // BLOCK)
    pool = torch.randn(pages + spare, BLOCK, kv.shape[1], generator=gen, device="cuda").to(kv.dtype)
    table = torch.randperm(pages + spare, generator=gen, device="cuda")[:pages].to(torch.int32)
    flat = pool[table.long()].reshape(pages * BLOCK, kv.shape[1])
    flat[: kv.shape[0]] = kv
    pool[table.long()] = flat.view(pages, BLOCK, kv.shape[1])
    return pool, table, flat


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("N", [8, 64])
@pytest.mark.parametrize("S,T", [(3000, 1), (5000, 16), (700, 65), (4096, 64)])
def test_paged_kernels_equal_contiguous_bf16(seed, config, N, S, T):
    q_lat, q_pe, kv = inputs(T, N, S, seed + S + T + N)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    tree = random_tree_mask(T, torch.Generator().manual_seed(seed)).cuda()
    mask = None if T == 1 else tree
    cfg = replace(default_config(N), **CONFIGS[config])
    pool, table, flat = paged(kv, gen)
    host = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=cfg)
    host_p = mla_attention(q_lat, q_pe, pool, S, mask, SCALE, C, config=cfg, table=table)
    dev = mla_attention_device(q_lat, q_pe, flat, torch.tensor(S, device="cuda"), tree, SCALE, C, config=cfg)
    dev_p = mla_attention_device(q_lat, q_pe, pool, torch.tensor(S, device="cuda"), tree, SCALE, C, config=cfg,
                                 table=table, capacity=flat.shape[0])
    torch.cuda.synchronize()
    assert torch.equal(host, host_p), f"host-length launch differs paged vs contiguous (seed {seed}, {config})"
    assert torch.equal(dev, dev_p), f"device-length launch differs paged vs contiguous (seed {seed}, {config})"
    ref = mla_attention_reference(q_lat.float(), q_pe.float(), kv.float(), S, mask, SCALE, C)
    assert rel(host_p, ref) < 1e-2, f"seed {seed}"


def test_greedy_spec_equals_plain_many_blocks_shuffled_table(seed):
    target = tiny_target(False, seed)
    vocab = target.cfg.vocab_size
    target.cache_pool = CachePool(target.cfg, 512, dtype=target.dtype, device=target.device)
    pool = target.cache_pool
    blocks = [pool.take(1)[0] for _ in range(pool.free_blocks)]
    for i in torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed)).tolist():
        pool.give([blocks[i]])   # every later request gets shuffled, non-contiguous block ids
    g = torch.Generator().manual_seed(seed + 3)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    bad = []
    for n in (1500, 3 * BLOCK + 1):
        prompt = torch.randint(2, vocab, (n,), generator=g).tolist()
        ref = generate(target, prompt, params).token_ids
        drafter = OracleDrafter(prompt + ref, vocab, seed=seed)
        for spec, budget in MODES:
            for eager in (True, None):
                r = generate(target, prompt, params, spec=spec, drafter=drafter, budget=budget, eager=eager)
                if r.token_ids != ref:
                    bad.append(f"{spec} {budget} eager={eager} prompt of {n}: {r.token_ids[:8]} vs {ref[:8]}")
        assert pool.free_blocks == 512, "a request kept its blocks"
    assert not bad, f"seed {seed}:\n" + "\n".join(bad)
