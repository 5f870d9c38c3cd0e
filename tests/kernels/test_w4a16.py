"""W4A16 dense linear: torch reference vs an independent unpack, and the Triton kernel under the
interpreter (in a child process, see _interp.py) vs the reference, at small odd shapes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.w4a16 import W4Config, _split_k, w4a16_linear, w4a16_linear_reference  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error bounds. The interpreter of triton 3.9 casts fp32 -> bf16 by truncation (the GPU
# rounds to nearest), so bf16 gets a looser bound here than on the GPU (1e-2).
TOL = {"fp32": 2e-5, "fp16": 5e-3, "bf16": 2e-2}


def rand_w4(*shape_nk, group_size, gen=None, device="cpu"):
    """Random packed int32 [..., N, K/8] over all 16 nibble values, scales in [0.01, 0.1] bf16."""
    *lead, n, k = shape_nk
    packed = torch.randint(-2**31, 2**31 - 1, (*lead, n, k // 8), dtype=torch.int32, generator=gen)
    scale = (torch.rand((*lead, n, k // group_size), generator=gen) * 0.09 + 0.01).to(torch.bfloat16)
    return packed.to(device), scale.to(device)


def pack_local(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [-8, 7] -> int32 [N, K/8]: element j of 8 in bits 4j..4j+3, stored q + 8."""
    u = (q + 8).to(torch.int64).reshape(q.shape[0], -1, 8)
    word = torch.zeros(u.shape[:2], dtype=torch.int64)
    for j in range(8):
        word |= u[..., j] << (4 * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# ---------------------------------------------------------------------------------- in process


def test_reference_matches_independent_unpack():
    g = torch.Generator().manual_seed(1)
    N, K, G = 24, 96, 32
    q = torch.randint(-8, 8, (N, K), generator=g)
    scale = (torch.rand(N, K // G, generator=g) * 0.09 + 0.01).to(torch.bfloat16)
    packed = pack_local(q)
    # the same bytes as uint8 [N, K/2], even k in the low nibble
    b = packed.view(torch.uint8).to(torch.int64)
    q2 = torch.stack([(b & 15) - 8, (b >> 4) - 8], dim=-1).reshape(N, K)
    assert torch.equal(q2, q)
    w = q.double() * scale.double().repeat_interleave(G, 1)
    x = torch.randn(5, K, generator=g, dtype=torch.float64)
    ref = w4a16_linear_reference(x.float(), packed, scale, G).double()
    want = x @ w.T
    assert ((ref - want).norm() / want.norm()).item() < 1e-6


def test_split_k_depends_on_shape_only():
    assert _split_k(36864, 7168, 256) == 2     # 576 tiles of 64 rows: two K halves fill 8 programs per SM
    assert _split_k(73728, 7168, 256) == 1
    assert _split_k(4096, 7168, 256) > 1
    for n, k in [(4096, 7168), (7168, 2048), (64, 2048), (128, 96)]:
        s = _split_k(n, k, 256)
        assert s >= 1 and (k + 255) // 256 // s >= 1


def test_config_validation_and_tables():
    from kdtree_engine.kernels.w4a16 import check_table
    with pytest.raises(ValueError):
        W4Config(BLOCK_M=4)                        # tl.dot needs >= 16 rows per tile
    with pytest.raises(ValueError):
        W4Config(DEQUANT="int8")
    dot, x2 = W4Config(), W4Config(DEQUANT="bf16x2")
    check_table([(16, dot), (1 << 62, W4Config(BLOCK_M=64, BLOCK_N=128, num_warps=8))], "ok")
    with pytest.raises(ValueError):                # DEQUANT changes the k order of the dot
        check_table([(16, x2), (1 << 62, dot)], "mixed")
    noswap = W4Config(SWAP_AB=False)
    check_table([(16, noswap), (1 << 62, W4Config(SWAP_AB=False, BLOCK_N=128, num_warps=8))], "noswap")
    with pytest.raises(ValueError):                # tokens on the MMA's M side: mma.sync vs wgmma
        check_table([(16, noswap), (1 << 62, W4Config(SWAP_AB=False, BLOCK_M=64))], "noswap tile rows")


def test_pair_order():
    from kdtree_engine.kernels.w4_dequant import pair_order
    x = torch.arange(32.0).reshape(2, 16)
    assert pair_order(x)[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(pair_order(x)[1], pair_order(x)[0] + 16)


def test_rejects_bad_inputs():
    x = torch.randn(2, 64)
    p, s = rand_w4(16, 64, group_size=32)
    with pytest.raises(ValueError):
        w4a16_linear(x, p, s, 64)  # scale has K/32 groups
    with pytest.raises(TypeError):
        w4a16_linear(x, p.view(torch.float32), s, 32)
    with pytest.raises(ValueError):
        w4a16_linear(torch.randn(2, 72), p, s, 32)


# ---------------------------------------------------------------------------------- interpreter

CASES = {
    # name: (M, N, K, group, dtype, config overrides)
    "m1_fp32_g32": (1, 96, 256, 32, "fp32", {}),
    "m3_fp32_k160_noswap": (3, 80, 160, 32, "fp32", {"SWAP_AB": False}),
    "m17_bf16_g64_splitk": (17, 64, 2048, 64, "bf16", {}),
    "m5_fp16_g128": (5, 72, 384, 128, "fp16", {}),
    "m33_fp32_bucket64_splitk": (33, 48, 1024, 32, "fp32", {}),
    "m2_fp32_uneven_split3_bk128": (2, 40, 1280, 32, "fp32", {"BLOCK_K": 128, "split_k": 3}),
    "m7_fp32_noncontig_x": (7, 56, 512, 32, "fp32", {"_noncontig": True}),
    "m4_bf16_noswap_bn32": (4, 100, 320, 32, "bf16", {"SWAP_AB": False, "BLOCK_N": 32}),
    # bf16x2 dequant (its plain-Triton twin under the interpreter), pair column order, EVEN tiles
    "m3_bf16_x2_uneven": (3, 96, 320, 32, "bf16", {"DEQUANT": "bf16x2"}),
    "m17_bf16_x2_even_g64_splitk": (17, 64, 2048, 64, "bf16", {"DEQUANT": "bf16x2"}),
    "m2_fp32_x2_is_float": (2, 40, 256, 32, "fp32", {"DEQUANT": "bf16x2"}),
    "m4_bf16_x2_noswap_bn32": (4, 100, 320, 32, "bf16", {"DEQUANT": "bf16x2", "SWAP_AB": False, "BLOCK_N": 32}),
}


def _run_one(name, spec):
    from dataclasses import replace

    from kdtree_engine.kernels.w4a16 import dense_config

    M, N, K, G, dt, over = spec
    over = dict(over)
    noncontig = over.pop("_noncontig", False)
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; reported on failure
    gen = torch.Generator().manual_seed(seed)
    packed, scale = rand_w4(N, K, group_size=G, gen=gen)
    x = torch.randn(M, 2 * K if noncontig else K, generator=gen).to(DT[dt])
    if noncontig:
        x = x[:, ::2]
    cfg = replace(dense_config(M), **over) if over else None
    y = w4a16_linear(x, packed, scale, G, config=cfg)
    ref = w4a16_linear_reference(x, packed, scale, G)
    return _interp.output_record(y, ref, y.dtype == x.dtype and tuple(y.shape) == (M, N)) | {"seed": seed}


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    _interp.assert_close(interp_results[name], TOL[CASES[name][4]])


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
