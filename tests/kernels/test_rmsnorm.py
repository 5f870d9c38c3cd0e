"""Batch-invariant RMSNorm: the reference equals layers.RMSNorm, and the Triton kernel under the
interpreter (child process, see _interp.py) matches it and is bitwise invariant to the row count."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.rmsnorm import bi_rmsnorm, rmsnorm_reference  # noqa: E402
from kdtree_engine.model.layers import RMSNorm  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# max |kernel - reference| in units of the output's ulp at the element (the interpreter truncates
# fp32 -> bf16/fp16 where the reference rounds to nearest, so 16-bit outputs may be 1-2 ulp apart;
# fp32 differs only in the rsqrt / mean rounding)
ULPS = {"fp32": 8, "bf16": 3, "fp16": 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_layers_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(3, 5, 96, generator=g).to(dtype)
    assert torch.equal(norm(x), rmsnorm_reference(x, norm.weight.detach(), 1e-6))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        bi_rmsnorm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(TypeError):
        bi_rmsnorm(torch.randn(2, 8).double(), torch.ones(8), 1e-6)


# ---------------------------------------------------------------------------------- interpreter

# name: (M, H, x dtype, weight dtype, options)
CASES = {
    "fp32_m1_h7": (1, 7, "fp32", "fp32", {}),
    "fp32_m5_h100": (5, 100, "fp32", "fp32", {}),
    "fp32_m3_h1000_lead": (3, 1000, "fp32", "fp32", {"lead": True}),
    "bf16_m17_h512": (17, 512, "bf16", "bf16", {}),
    "bf16x_fp32w_m4_h130": (4, 130, "bf16", "fp32", {}),
    "fp16_m9_h96_rowstride": (9, 96, "fp16", "fp16", {"rowstride": True}),
    "inv_bf16_h576": (129, 576, "bf16", "bf16", {"invariance": True}),
    "inv_fp32_h1536": (129, 1536, "fp32", "fp32", {"invariance": True}),
}


def _ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """max |y - ref| / ulp(ref) elementwise, ulp of `dtype` (x's dtype: where the normed row is rounded)."""
    d = (y.double() - ref.double()).abs()
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return float((d / ulp).max())


def _run_one(name, spec):
    M, H, xdt, wdt, opt = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    eps = 1e-6
    x = (torch.randn(M, 2 * H if opt.get("rowstride") else H, generator=gen) * 3).to(DT[xdt])
    if opt.get("rowstride"):
        x = x[:, :H]
    if opt.get("lead"):
        x = torch.randn(2, M, H, generator=gen).to(DT[xdt])
    w = (torch.rand(H, generator=gen) + 0.5).to(DT[wdt])
    y = bi_rmsnorm(x, w, eps)
    ref = rmsnorm_reference(x, w, eps)
    rec = {"meta": y.dtype == ref.dtype and y.shape == ref.shape,
           "nonfinite": int((~torch.isfinite(y.double())).sum()),
           "ulps": _ulps(y, ref, DT[xdt]), "seed": seed, "bad": []}
    if opt.get("invariance"):
        for i in (0, 1, 17, 64, 128):
            if not torch.equal(bi_rmsnorm(x[i:i + 1], w, eps)[0], y[i]):
                rec["bad"].append(f"row {i}: M=1 != M={M}")
        for m in (2, 17, 65):
            if not torch.equal(bi_rmsnorm(x[:m], w, eps), y[:m]):
                rec["bad"].append(f"M={m} != M={M} on shared rows")
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["meta"], "dtype or shape differs from layers.RMSNorm"
    lim = ULPS[CASES[name][2]]
    assert rec["ulps"] <= lim, f"{rec['ulps']:.3g} ulps > {lim} (seed {rec['seed']})"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
