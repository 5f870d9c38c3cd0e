"""Router logits kernel (kernels/router_gemm.py): config rules in process, and the Triton kernel under the
interpreter (in a child process, see _interp.py): accuracy against float64 at small odd shapes with fresh
random inputs and NaN-poisoned outputs, bitwise batch invariance (a row computed alone equals the same row
inside calls of M = 2..70, whatever the tokens per program), and the dispatch's choice."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.router_gemm import (  # noqa: E402
    ROUTER_CONFIGS, RouterGemmConfig, router_config, router_logits, router_logits_reference)

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 2e-6   # float32 accumulation of exactly upcast inputs, against float64 on the same inputs


# ---------------------------------------------------------------------------------- in process


def test_config_rules():
    assert router_config(384, 7168) is ROUTER_CONFIGS[(384, 7168)]
    for n, k in [(8, 16), (16, 100), (64, 7168), (3, 5000)]:
        c = router_config(n, k)
        assert c == router_config(n, k) and c.KS >= 16 and c.KS & (c.KS - 1) == 0
    with pytest.raises(ValueError, match="KS"):
        RouterGemmConfig(BN=8, KS=500)
    with pytest.raises(ValueError, match="TM"):
        RouterGemmConfig(TM=0)


def test_rejects_bad_inputs():
    x = torch.randn(2, 16)
    with pytest.raises(TypeError, match="float32 gate"):
        router_logits(x, torch.randn(4, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="activations"):
        router_logits(x.double(), torch.randn(4, 16))
    with pytest.raises(ValueError, match="same K"):
        router_logits(x, torch.randn(4, 17))
    with pytest.raises(ValueError, match="same K"):
        router_logits(x[None], torch.randn(4, 16))


def test_reference_matches_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 33, generator=g).bfloat16(), torch.randn(9, 33, generator=g)
    ref = x.double() @ w.double().T
    assert float((router_logits_reference(x, w).double() - ref).norm() / ref.norm()) < 1e-6


# ---------------------------------------------------------------------------------- interpreter

# name: (M, N, K, dtype, options)
CASES: dict[str, tuple] = {
    "acc_bf16_m1_n24_k1000": (1, 24, 1000, "bf16", {}),
    "acc_bf16_m5_n10_k33": (5, 10, 33, "bf16", {}),
    "acc_fp32_m17_n33_k130": (17, 33, 130, "fp32", {}),
    "acc_fp16_m3_n8_k64": (3, 8, 64, "fp16", {}),
    "acc_bf16_noncontig": (6, 20, 300, "bf16", {"noncontig": True}),
    "acc_bf16_small_ks_split": (4, 12, 200, "bf16", {"config": (4, 32, 2, 3)}),
    # bitwise: rows alone (M = 1) vs inside calls of M = 2..70, tokens per program 1 / 3 / 16 / 64
    "inv_bf16_default": (70, 24, 1000, "bf16", {"invariance": True}),
    "inv_bf16_split": (70, 12, 200, "bf16", {"invariance": True, "config": (4, 32, 2, 16)}),
}
_INV_M = (2, 3, 17, 33, 64, 70)
_INV_ROWS = (0, 1, 16, 31, 63, 69)
_TMS = (1, 3, 16, 64)


def _run_one(name, spec):
    M, N, K, dt, opt = spec
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; reported on failure
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if opt.get("noncontig") else K, generator=gen).to(DT[dt])
    if opt.get("noncontig"):
        x = x[:, ::2]
    w = torch.randn(N, K, generator=gen)
    cfg = RouterGemmConfig(*opt["config"]) if "config" in opt else router_config(N, K)
    y = router_logits(x, w, config=cfg)
    ref = x.double() @ w.double().T
    rec = {"ok_meta": y.dtype == torch.float32 and tuple(y.shape) == (M, N),
           "nonfinite": int((~torch.isfinite(y)).sum()), "rel": float((y.double() - ref).norm() / ref.norm()),
           "splits": -(-K // cfg.KS), "seed": seed, "bad": []}
    part = router_logits(x, w, config=cfg, partials=True)
    summed = part[0].clone()
    for p in part[1:]:
        summed = summed + p
    rec["partials_ok"] = tuple(part.shape) == (rec["splits"], M, N) and bool(torch.equal(summed, y))
    if opt.get("invariance"):
        def tiled(j):
            return RouterGemmConfig(cfg.BN, cfg.KS, cfg.num_warps, _TMS[j % len(_TMS)])
        alone = {i: router_logits(x[i:i + 1], w, config=tiled(i))[0] for i in _INV_ROWS}
        for j, m in enumerate(_INV_M):
            ym = router_logits(x[:m], w, config=tiled(j + 1))
            if not torch.equal(ym, y[:m]):
                rec["bad"].append(f"M={m} differs from M={M} on shared rows")
            rec["bad"] += [f"row {i}: M={m} != M=1" for i in _INV_ROWS if i < m and not torch.equal(ym[i], alone[i])]
        rec["bad"] = rec["bad"][:10]
    return rec


def _run_dispatch(name, spec):
    """The MoE router through the dispatch with the Triton backend forced: the router kernel's bits."""
    from kdtree_engine.kernels import dispatch
    from kdtree_engine.kernels.policy import KernelPolicy
    policy = KernelPolicy(dense="triton")   # KDTREE_DENSE_BACKEND=triton, as the CPU tests force it
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x, w = torch.randn(3, 200, generator=gen).bfloat16(), torch.randn(16, 200, generator=gen)
    return {"same": bool(torch.equal(dispatch.router_matmul(policy, x, w), router_logits(x, w)))}


CASES["dispatch_forced_triton"] = (0, 0, 0, "bf16", {"dispatch": True})


def _child(name, spec):
    if spec[4].get("dispatch"):
        return _run_dispatch(name, spec)
    return _run_one(name, spec)


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("acc_")])
def test_router_kernel_accuracy_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["ok_meta"] and rec["nonfinite"] == 0, f"seed {rec['seed']}"
    assert rec["rel"] < TOL, f"relative error {rec['rel']:.3g} (seed {rec['seed']})"
    assert rec["partials_ok"], f"the split partials [S, M, N] do not add up (in split order) to the logits (seed {rec['seed']})"
    if "config" in CASES[name][4]:
        assert rec["splits"] > 1


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("inv_")])
def test_router_kernel_batch_invariant_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0 and rec["rel"] < TOL, f"seed {rec['seed']}"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


def test_router_dispatch_takes_the_kernel_interpreted(interp_results):
    rec = interp_results["dispatch_forced_triton"]
    _interp.check_ran(rec)
    assert rec["same"]


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _child, sys.argv[sys.argv.index("--interp-cases") + 1:])
