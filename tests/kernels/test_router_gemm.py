"""The router-logit GEMM (kernels/router_gemm.py) under the interpreter (child process, see _interp.py)
against a float64 product on fresh random inputs: close to it, and every row bit-identical whatever
rows share the launch (M = 1 .. full), with bf16 activations equal to their exact float32 upcast."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _interp  # noqa: E402

CASES = {
    # name: (M, N, K)
    "m1_n8_k64": (1, 8, 64),
    "m6_n24_k200_ragged": (6, 24, 200),   # K not a multiple of the block, N not of the row tile
    "m21_n40_k1024": (21, 40, 1024),      # several splits and token tiles
    "m9_n20_k3000": (9, 20, 3000),
}


def _run_one(name, spec):
    from kdtree_engine.kernels.router_gemm import router_logits, router_split

    M, N, K = spec
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    full = router_logits(x, w)
    ref = x.double() @ w.double().T
    err = float(((full.double() - ref).abs().max() / ref.abs().max()))
    rows_equal = all(torch.equal(router_logits(x[:m], w), full[:m]) for m in sorted({1, 2, 3, 5, M}) if m <= M)
    tail_equal = torch.equal(router_logits(x[M // 2:], w), full[M // 2:])
    xb = x.to(torch.bfloat16)
    bf16_equal = torch.equal(router_logits(xb, w), router_logits(xb.float(), w))
    return {"seed": seed, "err": err, "rows_equal": rows_equal, "tail_equal": tail_equal,
            "bf16_equal": bf16_equal, "finite": bool(torch.isfinite(full).all()), "splits": router_split(N, K)[1]}


interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_router_gemm_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["finite"], f"unwritten outputs (seed {rec['seed']})"
    assert rec["err"] < 1e-5, f"relative error {rec['err']:.2e} (seed {rec['seed']})"
    for key in ("rows_equal", "tail_equal", "bf16_equal"):
        assert rec[key], f"{key} failed (seed {rec['seed']}, {rec['splits']} splits)"


def test_bad_inputs_are_refused():
    from kdtree_engine.kernels.router_gemm import router_logits
    with pytest.raises(ValueError, match="same K"):
        router_logits(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(TypeError, match="float32 gate"):
        router_logits(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
