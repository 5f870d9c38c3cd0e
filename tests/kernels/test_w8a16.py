"""W8A16 (FP8 block-quantized weights): the Triton kernel under the interpreter (child process, _interp.py)
against the torch reference (dequantize, float32 matmul), at odd shapes with partial scale blocks; and the
split along K chosen from (N, K) only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.fp8 import Fp8Block, quantize_fp8  # noqa: E402
from kdtree_engine.kernels.reference import w8a16_linear_reference  # noqa: E402
from kdtree_engine.kernels import split_sum  # noqa: E402
from kdtree_engine.kernels.w8a16 import tile_k, w8_split, w8a16_linear  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The reference dequantizes in fp32 and multiplies in fp32; the kernel multiplies the exact FP8 values and
# scales each tile's dot: fp32 agrees to rounding, bf16 / fp16 to the activations' rounding of the output
# (the interpreter truncates fp32 -> bf16, tests/kernels/test_w4a16.py).
TOL = {"fp32": 2e-5, "fp16": 5e-3, "bf16": 2e-2}


def rand_fp8(*shape, block: Fp8Block, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n, k = shape
    w = torch.randn(*lead, n, k, generator=gen) / k ** 0.5
    return quantize_fp8(w, block)


CASES = {
    # name: (M, N, K, block (bn, bk), dtype)
    "m1_fp32_b32": (1, 96, 160, (32, 32), "fp32"),
    "m5_bf16_partial_blocks": (5, 72, 208, (32, 64), "bf16"),
    "m16_fp16_b128": (16, 130, 256, (128, 128), "fp16"),
    "m3_fp32_split": (3, 16, 1024, (16, 16), "fp32"),      # one N tile: split along K (split_sum)
    "m40_bf16_two_m_tiles": (40, 64, 96, (16, 32), "bf16"),
}


def _run_one(name, spec):
    M, N, K, (bn, bk), dt = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    block = Fp8Block(bn, bk)
    w, s = rand_fp8(N, K, block=block, gen=gen)
    x = torch.randn(M, K, generator=gen).to(DT[dt])
    y = w8a16_linear(x, w, s, block)
    ref = w8a16_linear_reference(x, w, s, block)
    rec = _interp.output_record(y, ref, y.dtype == x.dtype and tuple(y.shape) == (M, N)) | {"seed": seed}
    # batch invariance: each row alone gives the bits it has among all M rows
    rec["row_bits"] = all(torch.equal(w8a16_linear(x[i:i + 1], w, s, block), y[i:i + 1]) for i in (0, M - 1))
    # split partials summed by a second launch (no arrival counters): the bits of the tiles' last programs' sums
    keep = split_sum.SERIAL_TILES
    split_sum.SERIAL_TILES = 0
    try:
        rec["launch_sum_bits"] = torch.equal(w8a16_linear(x, w, s, block), y)
    finally:
        split_sum.SERIAL_TILES = keep
    rec["counters_zero"] = all(int(c.abs().sum()) == 0 for c in split_sum._COUNTERS.values())
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_w8a16_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.assert_close(rec, TOL[CASES[name][4]])
    assert rec["row_bits"], f"a row alone differs from the same row among {CASES[name][0]} (seed {rec['seed']})"
    assert rec["launch_sum_bits"], f"split sums by the last program differ from split_sum's (seed {rec['seed']})"
    assert rec["counters_zero"], "arrival counters not back at 0"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])


def test_tile_and_split_depend_on_the_weight_only():
    assert tile_k(Fp8Block(128, 128), 128) == 128
    assert tile_k(Fp8Block(128, 96), 128) == 32
    assert tile_k(Fp8Block(16, 16), 128) == 16
    with pytest.raises(ValueError, match="bk"):
        tile_k(Fp8Block(16, 24), 128)
    # K2's q_a_proj (1536 x 7168): few N tiles, so K is split; enough rows fill the GPU unsplit; never below
    # MIN_TILES_PER_SPLIT tiles per split
    assert w8_split(1536, 7168, 128, 64) == 8
    assert w8_split(163840, 7168, 128, 64) == 1
    assert w8_split(64, 512, 128, 64) == 1


def test_refuses_bad_operands():
    gen = torch.Generator().manual_seed(0)
    block = Fp8Block(32, 32)
    w, s = rand_fp8(64, 64, block=block, gen=gen)
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="float8"):
        w8a16_linear(x, w.float(), s, block)
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        w8a16_linear(x, w, s[:1], block)
    with pytest.raises(ValueError, match="K=32"):
        w8a16_linear(x[:, :32], w, s, block)
