"""SwiGLU activation (kernels/swiglu.py) under the interpreter (child process, see _interp.py) against
torch's F.silu(gate) * up: within a few ulps (the exp is numpy's, and the interpreter's fp32 -> 16-bit
casts truncate where torch rounds), on column slices of one GEMM output as the MLP passes them; a row
alone gives the same bits as inside a block."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels import dispatch  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ULPS = {"fp32": 4, "bf16": 2, "fp16": 2}


def test_dispatch_cpu_is_torch() -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    gu = torch.randn(5, 2 * 37, generator=g).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(dispatch.silu_mul(KernelPolicy(), gate, up), F.silu(gate) * up)


def test_rejects_bad_inputs() -> None:
    from kdtree_engine.kernels.swiglu import silu_mul
    with pytest.raises(TypeError):
        silu_mul(torch.randn(2, 8), torch.randn(2, 8).bfloat16())
    with pytest.raises(ValueError):
        silu_mul(torch.randn(2, 8), torch.randn(2, 9))


# ---------------------------------------------------------------------------------- interpreter

# name: (T, N, dtype, options)
CASES = {
    "bf16_t5_n97_chunks": (5, 97, "bf16", {"chunks": True}),
    "fp32_t3_n1500": (3, 1500, "fp32", {}),
    "fp16_t4_n33_chunks": (4, 33, "fp16", {"chunks": True}),
    "bf16_lead_n40": (6, 40, "bf16", {"lead": True}),
    "inv_bf16_t33_n300_chunks": (33, 300, "bf16", {"chunks": True, "invariance": True}),
}


def _ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    d = (y.double() - ref.double()).abs()
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return float((d / ulp).max())


def _run_one(name, spec):
    from kdtree_engine.kernels.swiglu import silu_mul

    T, N, dt, opt = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    if opt.get("chunks"):
        gate, up = (torch.randn(T, 2 * N, generator=gen) * 3).to(DT[dt]).chunk(2, dim=-1)
    elif opt.get("lead"):
        gate, up = ((torch.randn(2, T, N, generator=gen) * 3).to(DT[dt]) for _ in range(2))
    else:
        gate, up = ((torch.randn(T, N, generator=gen) * 3).to(DT[dt]) for _ in range(2))
    y = silu_mul(gate, up)
    ref = F.silu(gate) * up
    rec = {"meta": y.dtype == ref.dtype and y.shape == ref.shape, "nonfinite": int((~torch.isfinite(y)).sum()),
           "ulps": _ulps(y, ref, DT[dt]), "seed": seed, "bad": []}
    if opt.get("invariance"):
        for i in (0, 1, 32):
            if not torch.equal(silu_mul(gate[i:i + 1], up[i:i + 1])[0], y[i]):
                rec["bad"].append(f"row {i}: T=1 != T={T}")
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    _interp.assert_ulps(interp_results[name], "torch", {"ulps": ULPS[CASES[name][2]]})


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
