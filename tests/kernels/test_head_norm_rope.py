"""The drafter's per-head RMSNorm + rotate-half rope in Triton (kernels/head_norm_rope.py) under the
interpreter (child process, see _interp.py) against the drafter's torch arithmetic (layers.rms_norm_torch
then dflash.apply_rope_half) at small odd shapes, strided inputs (the k half of a stacked k/v GEMM),
fp32 and bf16, fresh random inputs; a row's result does not depend on the rows sharing the launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.head_norm_rope import head_norm_rope, head_norm_rope_torch  # noqa: E402
from kdtree_engine.model.dflash import rope_tables  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |kernel - torch| in ulps of the output dtype at the row's largest |value|: the norm's mean is summed
# in another order (last bits of r), and in bf16 the interpreter truncates fp32 -> bf16 where torch rounds
# to nearest, at each of the 5 roundings (norm, weight, two products, sum); the sum of the two rounded
# products can cancel, so the element's own magnitude is no scale for its error
ULPS = {"fp32": 4, "bf16": 6}

# name: (T, H, d, dtype, options)
CASES = {
    "fp32_t5_h3_d8": (5, 3, 8, "fp32", {}),
    "fp32_t1_h1_d2": (1, 1, 2, "fp32", {}),
    "fp32_strided_t7_h2_d12": (7, 2, 12, "fp32", {"strided": True}),
    "bf16_t17_h4_d64": (17, 4, 64, "bf16", {}),
    "bf16_strided_invariance": (33, 2, 64, "bf16", {"strided": True, "invariance": True}),
}


def _ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    d = (y.double() - ref.double()).abs()
    scale = ref.double().abs().amax(dim=-1, keepdim=True)
    ulp = torch.finfo(dtype).eps * scale.clamp_min(torch.finfo(dtype).tiny)
    return float((d / ulp).max()) if d.numel() else 0.0


def _run_one(name, spec):
    T, H, d, dts, opt = spec
    dt = DT[dts]
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    if opt.get("strided"):  # the k half of [T, 2 * H * d] (k | v), viewed [T, H, d]
        x = (torch.randn(T, 2 * H * d, generator=gen) * 3).to(dt)[:, : H * d].view(T, H, d)
    else:
        x = (torch.randn(T, H, d, generator=gen) * 3).to(dt)
    w = (torch.rand(d, generator=gen) + 0.5).to(dt)
    pos = torch.randint(0, 4096, (T,), generator=gen)
    cos, sin = rope_tables(pos, d, 10000.0, dt)
    y = head_norm_rope(x, w, 1e-6, cos, sin)
    ref = head_norm_rope_torch(x, w, 1e-6, cos, sin)
    rec = {"meta": y.dtype == ref.dtype and y.shape == ref.shape and y.is_contiguous(),
           "nonfinite": int((~y.isfinite()).sum()), "ulps": _ulps(y, ref, dt), "bad": [], "seed": seed}
    if opt.get("invariance"):
        for t in (0, 1, 16, T - 1):
            if not torch.equal(head_norm_rope(x[t:t + 1], w, 1e-6, cos[t:t + 1], sin[t:t + 1])[0], y[t]):
                rec["bad"].append(f"row {t}: T=1 != T={T}")
    return rec


def test_rejects_bad_inputs():
    cos = sin = torch.zeros(2, 4)
    w = torch.ones(4)
    with pytest.raises(ValueError, match="head dim"):
        head_norm_rope(torch.zeros(2, 1, 4), torch.ones(3), 1e-6, cos, sin)  # weight of the wrong width
    with pytest.raises(ValueError, match="cos"):
        head_norm_rope(torch.zeros(3, 1, 4), w, 1e-6, cos, sin)  # tables for 2 rows, 3 queries
    with pytest.raises(TypeError, match="dtype"):
        head_norm_rope(torch.zeros(2, 1, 4), w.to(torch.bfloat16), 1e-6, cos, sin)
    with pytest.raises(ValueError, match="unit last stride"):
        head_norm_rope(torch.zeros(2, 1, 8)[..., ::2], w, 1e-6, cos, sin)


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    _interp.assert_ulps(interp_results[name], "the torch path", {"ulps": ULPS[CASES[name][3]]})


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
