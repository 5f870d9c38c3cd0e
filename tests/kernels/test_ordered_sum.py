"""The cross-rank sum's fixed order (kernels/dispatch.py ordered_sum): the one-launch kernel (kernels/split_sum.py)
under the interpreter (child process, see _interp.py) against the torch loop (kernels/reference.py
ordered_sum_torch: float32 additions in rank order): the float32 sums bit for bit, for bfloat16 / float32 partials of
2..8 ranks, and the bfloat16 result within one ulp (the interpreter's float32 -> bfloat16 cast truncates where the
GPU and torch round; tests/gpu/test_ordered_sum_gpu.py checks those bits); a row's sum does not depend on how many
rows share the message."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels import dispatch  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.kernels.reference import ordered_sum_torch  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_torch_reference_is_a_rank_order_loop() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    parts = (torch.randn(4, 3, 17, generator=g) * 1e3).to(torch.bfloat16)
    want = ((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()
    assert torch.equal(ordered_sum_torch(parts), want)
    assert torch.equal(dispatch.ordered_sum(KernelPolicy(), parts, torch.bfloat16), want.to(torch.bfloat16))


# name: (ranks, rows, width, dtype of the partials, dtype of the result)
CASES = {
    "bf16_w2_r1": (2, 1, 7168, "bf16", "bf16"),
    "bf16_w8_r5": (8, 5, 300, "bf16", "bf16"),
    "fp32_w4_r3": (4, 3, 1000, "fp32", "bf16"),
    "fp32_w3_r2_out_fp32": (3, 2, 129, "fp32", "fp32"),
}


def _run_one(name, spec):
    W, R, H, dt, out_dt = spec
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    parts = (torch.randn(W, R, H, generator=g) * 50).to(DT[dt])
    policy = KernelPolicy(dense="triton")
    got32 = dispatch.ordered_sum(policy, parts, torch.float32)
    want32 = ordered_sum_torch(parts)
    got = dispatch.ordered_sum(policy, parts, DT[out_dt])
    want = want32.to(DT[out_dt])
    rec = {"seed": seed, "bad": []}
    if not torch.equal(got32, want32):
        rec["bad"].append(f"float32 sums differ (max diff {float((got32 - want32).abs().max())})")
    ulp = torch.finfo(DT[out_dt]).eps * want.float().abs().clamp_min(1.0)
    if not bool(((got.float() - want.float()).abs() <= ulp).all()):
        rec["bad"].append("the result is more than one ulp from the torch loop's")
    if R > 1 and not torch.equal(dispatch.ordered_sum(policy, parts[:, 1:2], DT[out_dt])[0], got[1]):
        rec["bad"].append("row 1 alone != row 1 among the others")
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    assert not rec["bad"], f"seed={rec['seed']}: {rec['bad']}"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
