"""The per-row selections in Triton (kernels/row_select.py) under the interpreter (child process, see
_interp.py): argmax_rows equals torch.argmax (ties to the lowest column, the first NaN winning) and
topk_logprobs_rows gives the stable descending sort's ids (ties to the lower id) with log-probs within a
few fp32 ulps of the sort minus torch.logsumexp, at small odd shapes, fp32 / bf16 / fp16, rows with
deliberate ties, strided row views, fresh random inputs (seed reported). Argument checks run here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.common import interpreting  # noqa: E402
from kdtree_engine.kernels.row_select import (TOPK_MAX_K, TOPK_MAX_V, argmax_rows, topk_logprobs_rows,  # noqa: E402
                                              topk_logprobs_torch)

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LP_TOL = 1e-5  # |lp - oracle| <= LP_TOL * max(1, |oracle|): the logsumexp sums in another order

# name: (kind, L, V, dtype, ks (top-k only), options)
CASES = {
    "argmax_fp32_l1_v5": ("argmax", 1, 5, "fp32", (), {}),
    "argmax_fp32_l3_v1000_ties": ("argmax", 3, 1000, "fp32", (), {"ties": True}),
    "argmax_bf16_l17_v4096_ties": ("argmax", 17, 4096, "bf16", (), {"ties": True}),
    "argmax_fp32_l17_v5000_strided": ("argmax", 17, 5000, "fp32", (), {"ties": True, "strided": True}),
    "argmax_bf16_l3_v5000_strided": ("argmax", 3, 5000, "bf16", (), {"strided": True}),
    "argmax_fp16_l3_v1000": ("argmax", 3, 1000, "fp16", (), {}),
    "argmax_fp32_l5_v37_special": ("argmax", 5, 37, "fp32", (), {"special": True}),
    "topk_fp32_l3_v7": ("topk", 3, 7, "fp32", (1, 4, 7), {"ties": True}),
    "topk_bf16_l3_v7": ("topk", 3, 7, "bf16", (1, 4, 7), {}),
    "topk_fp32_l2_v300": ("topk", 2, 300, "fp32", (1, 4, 16, 37), {}),
    "topk_bf16_l3_v300_ties": ("topk", 3, 300, "bf16", (1, 4, 16, 37), {"ties": True, "strided": True}),
    "topk_fp16_l2_v300": ("topk", 2, 300, "fp16", (4, 37), {}),
    "topk_bf16_l3_v4096_ties": ("topk", 3, 4096, "bf16", (1, 4, 16), {"ties": True}),
    "topk_fp32_l2_v4096_strided": ("topk", 2, 4096, "fp32", (4, 16), {"strided": True}),
    "topk_bf16_l1_v4096_k37": ("topk", 1, 4096, "bf16", (37,), {"ties": True}),
    "topk_fp32_l4_v37_special": ("topk", 4, 37, "fp32", (1, 5, 37), {"special": True}),
    "dispatch_wiring": ("dispatch", 3, 300, "fp32", (8, 200), {}),
}


def _run_dispatch(L: int, V: int, dt: torch.dtype, ks: tuple, gen: torch.Generator, rec: dict) -> dict:
    """The engine's entry points with the Triton row kernels forced (as on CUDA): greedy() of 1-D and 3-D
    logits is torch.argmax's; topk_logprobs takes the kernel up to TOPK_MAX_K (ids of the stable-sort
    oracle) and torch's topk beyond (k = 200 here: its exact result)."""
    from kdtree_engine.kernels.policy import KernelPolicy
    from kdtree_engine.kernels.reference import topk_logprobs_torch as reference_topk_torch
    from kdtree_engine.sampling import greedy, topk_logprobs
    policy = KernelPolicy(dense="triton")
    x = (torch.randn(2, L, V, generator=gen) * 3).to(dt)
    for logits in (x[0, 0], x):
        if not torch.equal(greedy(logits, policy=policy), torch.argmax(logits, dim=-1)):
            rec["bad"].append(f"greedy of {tuple(logits.shape)}")
    for k in ks:
        lp, ids = topk_logprobs(x[0], k, policy=policy)
        want_lp, want_ids = (topk_logprobs_torch if k <= TOPK_MAX_K else reference_topk_torch)(x[0], k)
        if not torch.equal(ids, want_ids) or (lp - want_lp).abs().max() > LP_TOL * max(1.0, float(want_lp.abs().max())):
            rec["bad"].append(f"topk_logprobs k={k}")
    return rec


def _inputs(L: int, V: int, dt: torch.dtype, opt: dict, gen: torch.Generator) -> torch.Tensor:
    """[L, V] in dt: randn * 3 (bf16 rounds many near the top to equal values), optionally a view of the
    first V columns of a wider tensor, with deliberate ties / special values in some rows."""
    wide = V + 37 if opt.get("strided") else V
    full = (torch.randn(L, wide, generator=gen) * 3).to(dt)
    x = full[:, :V]
    for r in range(L):
        row = x[r]
        if opt.get("ties") and V > 2:
            if r % 3 == 0:    # the max copied to a later and to an earlier column, some a chunk apart
                j = int(row.float().argmax())
                top = row[j].clone()
                row[min(j + 1 + int(torch.randint(0, V, (1,), generator=gen)) % (V - j), V - 1)] = top
                row[int(torch.randint(0, max(j, 1), (1,), generator=gen))] = top
                for d in (-2048, -1024, -256, 256, 1024, 2048):  # argmax_rows' chunks (same lane)
                    if 0 <= j + d < V:
                        row[j + d] = top
            elif r % 3 == 1:  # one value of the row's middle copied to many columns, the max to two
                pos = torch.randperm(V, generator=gen)[: max(V // 4, 2)]
                row[pos] = row[int(pos[0])].clone()
                row[pos[-2:]] = row.max()
            else:             # few distinct values: many ties everywhere
                row.copy_((row.float() / 2).round().to(dt))
        if opt.get("special"):
            nan, inf = float("nan"), float("inf")
            if r == 0:    # NaN counts as the largest, the first NaN winning
                row[V // 2], row[V // 3], row[V - 1] = nan, nan, nan
            elif r == 1:  # -inf everywhere but a few: the -inf ties fill the top-k in column order
                row[:] = -inf
                row[3], row[V - 2], row[7] = 1.5, 1.5, -2.0
            elif r == 2:  # -0.0 equals +0.0
                row[:] = -1.0
                row[5], row[2], row[9] = 0.0, -0.0, 0.0
            elif r == 3:  # all -inf: the first column
                row[:] = -inf
            else:         # +inf
                row[11], row[4] = inf, inf
    return x


def _same_nonfinite(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.isnan() == b.isnan()) & (a.isinf() == b.isinf()) & (~a.isinf() | (a == b))).all())


def _run_one(name, spec):
    kind, L, V, dts, ks, opt = spec
    dt = DT[dts]
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(L, V, dt, opt, gen)
    rec = {"seed": seed, "bad": [], "nonfinite": 0}
    if kind == "dispatch":
        return _run_dispatch(L, V, dt, ks, gen, rec)
    if kind == "argmax":
        y = argmax_rows(x)
        ref = torch.argmax(x, dim=-1)
        if y.dtype != torch.int64 or y.shape != (L,):
            rec["bad"].append(f"output {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(y, ref):
            rows = (y != ref).nonzero().flatten().tolist()[:4]
            rec["bad"].append(f"rows {rows}: {y[rows].tolist()} != torch {ref[rows].tolist()}")
        return rec
    for k in ks:
        lp, ids = topk_logprobs_rows(x, k)
        rlp, rids = topk_logprobs_torch(x, k)
        if lp.dtype != torch.float32 or ids.dtype != torch.int64 or lp.shape != (L, k) or ids.shape != (L, k):
            rec["bad"].append(f"k={k}: output {lp.dtype} {tuple(lp.shape)}, {ids.dtype} {tuple(ids.shape)}")
            continue
        if not torch.equal(ids, rids):
            r = int((ids != rids).any(dim=-1).nonzero()[0])
            rec["bad"].append(f"k={k} row {r}: ids {ids[r].tolist()} != sort {rids[r].tolist()}")
        fin = rlp.isfinite()
        if opt.get("special"):  # non-finite log-probs where the oracle's are, the same ones
            if not _same_nonfinite(lp, rlp):
                rec["bad"].append(f"k={k}: non-finite log-probs differ: {lp.tolist()} vs {rlp.tolist()}")
        else:
            rec["nonfinite"] += int((~lp.isfinite()).sum())
        err = ((lp - rlp).abs() / rlp.abs().clamp_min(1))[fin & lp.isfinite()]
        if err.numel() and float(err.max()) > LP_TOL:
            rec["bad"].append(f"k={k}: log-prob error {float(err.max()):.3g} x max(1, |lp|) > {LP_TOL}")
    return rec


def test_rejects_bad_inputs():
    x = torch.zeros(3, 10)
    with pytest.raises(ValueError, match=f"V={TOPK_MAX_V + 1}"):
        topk_logprobs_rows(torch.zeros(2, TOPK_MAX_V + 1), 4)
    for k in (0, 11):
        with pytest.raises(ValueError, match=f"k={k}"):
            topk_logprobs_rows(x, k)
    with pytest.raises(ValueError, match=f"k={TOPK_MAX_K + 1}"):   # beyond the GPU-tested range
        topk_logprobs_rows(torch.zeros(2, 1000), TOPK_MAX_K + 1)
    for fn in (argmax_rows, lambda t: topk_logprobs_rows(t, 2)):
        with pytest.raises(ValueError, match=r"\[L, V\]"):
            fn(torch.zeros(10))
        with pytest.raises(ValueError, match=r"\[L, V\]"):
            fn(torch.zeros(2, 3, 10))
        with pytest.raises(TypeError, match="int32"):
            fn(torch.zeros(3, 10, dtype=torch.int32))
        with pytest.raises(ValueError, match="unit last stride"):
            fn(torch.zeros(3, 20)[:, ::2])
        with pytest.raises(ValueError, match="V=0"):
            fn(torch.zeros(3, 0))
        if not interpreting():  # a CPU tensor reaches no kernel outside the interpreter
            with pytest.raises(ValueError, match="cpu"):
                fn(x)


def test_oracle_is_stable_sort_minus_logsumexp():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -0.0, float("-inf"), 0.0, -1.0]])
    lp, ids = topk_logprobs_torch(x.bfloat16(), 4)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 3, 4]]
    assert torch.equal(lp, x.sort(dim=-1, descending=True, stable=True)[0][:, :4] - x.logsumexp(-1, keepdim=True))


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
