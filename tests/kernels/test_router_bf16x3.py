"""The tensor-core router for bfloat16 activations (kernels/router_gemm.py: split_bf16x3, router_logits_bf16x3):
the float32 gate split exactly into three bf16 parts, bad inputs refused by name, the Router module's cached
parts, the dispatch's choice; and the Triton kernel under the interpreter (a child process, see _interp.py):
accuracy against float64 at small odd shapes with fresh random inputs and NaN-poisoned outputs, and bitwise
batch invariance (a row alone equals the same row inside calls of M = 2..40, whose tiles differ)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.gemm import Reduction  # noqa: E402
from kdtree_engine.kernels.bf16x3 import split_bf16x3  # noqa: E402
from kdtree_engine.kernels.router_gemm import BF16X3_BLOCK_K, BF16X3_SPLITS, router_logits_bf16x3  # noqa: E402

TOL = 2e-6   # float32 accumulation of exact bf16 products, against float64 on the same inputs


def _fresh(seed: int | None = None) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") if seed is None else seed)


# ---------------------------------------------------------------------------------- in process


def test_split_is_exact_over_the_float32_range():
    """hi + mid + lo == w for magnitudes from 2^-100 to 2^100 (fresh values each run: signs, exponents, mantissas)."""
    g = _fresh()
    mant = 1.0 + torch.rand(64, 257, generator=g)                       # [1, 2)
    sign = torch.where(torch.rand(64, 257, generator=g) < 0.5, -1.0, 1.0)
    w = sign * mant * torch.pow(2.0, torch.randint(-100, 100, (64, 257), generator=g).float())
    p = split_bf16x3(w)
    assert p.shape == (3, 64, 257) and p.dtype == torch.bfloat16
    assert torch.equal((p[2].float() + p[1].float()) + p[0].float(), w)
    assert torch.equal(p[2], w.to(torch.bfloat16))   # hi is the bf16 rounding; mid and lo the exact rest
    assert bool((p[0].float().abs() <= p[1].float().abs()).all() and (p[1].float().abs() <= p[2].float().abs()).all())


def test_bad_inputs_are_refused_by_name():
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match="float32"):
        split_bf16x3(w.bfloat16())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        split_bf16x3(w[None])
    parts = split_bf16x3(w)
    with pytest.raises(TypeError, match="bfloat16"):
        router_logits_bf16x3(torch.randn(2, 16), parts)
    with pytest.raises(TypeError, match="bfloat16"):
        router_logits_bf16x3(torch.randn(2, 16).bfloat16(), parts.float())
    with pytest.raises(ValueError, match="same K"):
        router_logits_bf16x3(torch.randn(2, 17).bfloat16(), parts)
    with pytest.raises(ValueError, match=r"\[3, N, K\]"):
        router_logits_bf16x3(torch.randn(2, 16).bfloat16(), parts[:2])


def _router():
    from kdtree_engine.config import preset
    from kdtree_engine.model.moe import Router
    return Router(preset("k2-tiny"))


def test_router_parts_are_cached_and_follow_the_weight():
    r = _router()
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=_fresh()))
    a = r.bf16x3_parts()
    assert r.bf16x3_parts() is a   # built once
    assert torch.equal((a[2].float() + a[1].float()) + a[0].float(), r.weight)
    with torch.no_grad():
        r.weight.mul_(3.0)          # written in place: rebuilt
    b = r.bf16x3_parts()
    assert b is not a and torch.equal((b[2].float() + b[1].float()) + b[0].float(), r.weight)
    r.reset_parts()
    assert r.bf16x3_parts() is not b


# ---------------------------------------------------------------------------------- interpreter

# name: (M, N, K, options)
CASES: dict[str, tuple] = {
    "acc_m1_n24_k1000": (1, 24, 1000, {}),
    "acc_m5_n10_k33": (5, 10, 33, {}),            # K under one MMA step: one split
    "acc_m17_n70_k1300": (17, 70, 1300, {}),      # row tiles past N, a ragged last split
    "inv_m40_n12_k700": (40, 12, 700, {"invariance": True}),
    "dispatch": (3, 16, 200, {"dispatch": True}),
}
_INV_M = (2, 17, 33, 40)
_INV_ROWS = (0, 1, 16, 32, 39)


def _run_one(name, spec):
    M, N, K, opt = spec
    gen = _fresh()
    seed = gen.initial_seed()
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    parts = split_bf16x3(w)
    y = router_logits_bf16x3(x, parts)
    S = Reduction(BF16X3_BLOCK_K, BF16X3_SPLITS).n_splits(K)
    logits = y[0].clone()
    for p in y[1:]:
        logits = logits + p
    ref = x.double() @ w.double().T
    rec = {"ok_meta": y.dtype == torch.float32 and tuple(y.shape) == (3 * S, M, N),
           "nonfinite": int((~torch.isfinite(y)).sum()), "rel": float((logits.double() - ref).norm() / ref.norm()),
           "seed": seed, "bad": []}
    if opt.get("invariance"):
        alone = {i: router_logits_bf16x3(x[i:i + 1], parts)[:, 0] for i in _INV_ROWS}
        for m in _INV_M:
            ym = router_logits_bf16x3(x[:m], parts)
            if not torch.equal(ym, y[:, :m]):
                rec["bad"].append(f"M={m} differs from M={M} on shared rows")
            rec["bad"] += [f"row {i}: M={m} != M=1" for i in _INV_ROWS if i < m and not torch.equal(ym[:, i], alone[i])]
        rec["bad"] = rec["bad"][:10]
    if opt.get("dispatch"):
        from kdtree_engine.kernels import dispatch
        from kdtree_engine.kernels.policy import KernelPolicy
        policy = KernelPolicy(dense="triton")   # KDTREE_DENSE_BACKEND=triton, as the CPU tests force it
        got = dispatch.router_matmul(policy, x, w, partials=True, bf16x3=lambda: parts)
        rec["dispatch_same"] = bool(torch.equal(got, y))
        rec["dispatch_logits"] = bool(torch.equal(dispatch.router_matmul(policy, x, w, bf16x3=lambda: parts), logits))
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("acc_")])
def test_bf16x3_router_accuracy_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["ok_meta"] and rec["nonfinite"] == 0, f"seed {rec['seed']}"
    assert rec["rel"] < TOL, f"relative error {rec['rel']:.3g} (seed {rec['seed']})"


def test_bf16x3_router_batch_invariant_interpreted(interp_results):
    rec = interp_results["inv_m40_n12_k700"]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0 and rec["rel"] < TOL, f"seed {rec['seed']}"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


def test_dispatch_takes_bf16x3_for_bf16_activations_interpreted(interp_results):
    rec = interp_results["dispatch"]
    _interp.check_ran(rec)
    assert rec["dispatch_same"], "router_matmul(partials=True) is not the bf16x3 kernel's partials"
    assert rec["dispatch_logits"], "router_matmul's logits are not the partials added in index order"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
