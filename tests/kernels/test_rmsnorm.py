"""Batch-invariant RMSNorm: the reference equals layers.RMSNorm, and the Triton kernel under the
interpreter (child process, see _interp.py) matches it and is bitwise invariant to the row count.
The fused residual add + RMSNorm (bi_add_rmsnorm): its sum is torch's h + d (bit for bit in fp32; in
16 bits within the interpreter's truncating cast, 1 ulp) and its normed row is bi_rmsnorm of that sum,
bit for bit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.rmsnorm import bi_add_rmsnorm, bi_rmsnorm, rmsnorm_reference  # noqa: E402
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
    with pytest.raises(ValueError):
        bi_add_rmsnorm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(TypeError):
        bi_add_rmsnorm(torch.randn(2, 8), torch.randn(2, 8).double(), torch.ones(8), 1e-6)


def test_residual_without_triton_is_add_then_norm():
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    norm = RMSNorm(40, 1e-6).to(torch.bfloat16)
    h, d = (torch.randn(7, 40, generator=g).to(torch.bfloat16) for _ in range(2))
    s, y = norm.residual(h, d)
    assert torch.equal(s, h + d) and torch.equal(y, norm(h + d))
    s, y = norm.residual(h, None)
    assert s is h and torch.equal(y, norm(h))


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
    "add_fp32_m5_h100": (5, 100, "fp32", "fp32", {"add": "fp32"}),
    "add_bf16_m7_h257": (7, 257, "bf16", "bf16", {"add": "bf16"}),
    "add_bf16_fp32w_m3_h96_rowstride": (3, 96, "bf16", "fp32", {"add": "bf16", "rowstride": True}),
    "add_fp16_m4_h33": (4, 33, "fp16", "fp16", {"add": "fp16"}),
    "add_bf16h_fp32d_m6_h64": (6, 64, "bf16", "bf16", {"add": "fp32"}),
    "add_inv_bf16_h576": (129, 576, "bf16", "bf16", {"add": "bf16", "invariance": True}),
}


def _ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """max |y - ref| / ulp(ref) elementwise, ulp of `dtype` (x's dtype: where the normed row is rounded)."""
    d = (y.double() - ref.double()).abs()
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return float((d / ulp).max())


def _run_add(M, H, xdt, wdt, opt, seed, gen):
    eps = 1e-6
    width = 2 * H if opt.get("rowstride") else H
    h = (torch.randn(M, width, generator=gen) * 3).to(DT[xdt])[:, :H]
    d = torch.randn(M, width, generator=gen).to(DT[opt["add"]])[:, :H]
    w = (torch.rand(H, generator=gen) + 0.5).to(DT[wdt])
    s, y = bi_add_rmsnorm(h, d, w, eps)
    ref_s = h + d
    sdt = ref_s.dtype
    exact_sum = sdt == torch.float32  # the interpreter truncates fp32 -> bf16/fp16 (torch rounds to nearest)
    rec = {"meta": s.dtype == sdt and s.shape == ref_s.shape and y.dtype == torch.promote_types(w.dtype, sdt)
           and y.shape == ref_s.shape,
           "nonfinite": int((~torch.isfinite(y.double())).sum() + (~torch.isfinite(s.double())).sum()),
           "ulps": 0.0, "seed": seed, "bad": []}
    sum_ulps = _ulps(s, ref_s, sdt)
    if (exact_sum and not torch.equal(s, ref_s)) or sum_ulps > 1:
        rec["bad"].append(f"sum {sum_ulps:.3g} ulps from torch's h + d")
    if not torch.equal(y, bi_rmsnorm(s, w, eps)):
        rec["bad"].append("normed row != bi_rmsnorm(sum)")
    rec["ulps"] = _ulps(y, rmsnorm_reference(s, w, eps), sdt)
    if opt.get("invariance"):
        for i in (0, 1, 17, 64, 128):
            a = bi_add_rmsnorm(h[i:i + 1], d[i:i + 1], w, eps)
            if not (torch.equal(a[0][0], s[i]) and torch.equal(a[1][0], y[i])):
                rec["bad"].append(f"row {i}: M=1 != M={M}")
        for m in (2, 17, 65):
            a = bi_add_rmsnorm(h[:m], d[:m], w, eps)
            if not (torch.equal(a[0], s[:m]) and torch.equal(a[1], y[:m])):
                rec["bad"].append(f"M={m} != M={M} on shared rows")
    return rec


def _run_one(name, spec):
    M, H, xdt, wdt, opt = spec
    if "add" in opt:
        seed = int.from_bytes(os.urandom(4), "little")
        return _run_add(M, H, xdt, wdt, opt, seed, torch.Generator().manual_seed(seed))
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
    _interp.assert_ulps(interp_results[name], "layers.RMSNorm", {"ulps": ULPS[CASES[name][2]]})


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
