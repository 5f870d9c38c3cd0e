"""MLA tails in Triton (kernels/rope.py) under the interpreter (child process, see _interp.py) against the
model's torch arithmetic (layers.apply_rope, layers.rms_norm_torch, index_copy_): query rope and the latent
cache write at small odd shapes, strided inputs, fp32 bit for bit (no FMA: each product and sum rounded as
torch rounds it; the norm to a few ulps, its mean is summed in another order), 16-bit to the interpreter's
truncating conversion; a row's result does not depend on the rows sharing the launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.rope import (latent_write, latent_write_torch, rope_heads,  # noqa: E402
                                        rope_heads_torch)

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |kernel - torch| in ulps of the output dtype at the element: fp32 rope is exact; the interpreter
# truncates fp32 -> bf16 where torch rounds to nearest (1 ulp); the norm's mean may differ in its last bit
ULPS_ROPE = {"fp32": 0, "bf16": 1}
ULPS_NORM = {"fp32": 8, "bf16": 3}

# name: (kind, T, N or None, nope / C, R, dtype, options)
CASES = {
    "rope_fp32_t5_n3": ("rope", 5, 3, 7, 6, "fp32", {}),
    "rope_fp32_t1_n1_p0": ("rope", 1, 1, 0, 2, "fp32", {}),
    "rope_fp32_strided": ("rope", 9, 5, 11, 10, "fp32", {"strided": True}),
    "rope_bf16_t17_n4": ("rope", 17, 4, 32, 32, "bf16", {}),
    "rope_bf16_invariance": ("rope", 33, 3, 5, 14, "bf16", {"invariance": True}),
    "latent_fp32_t5_c13": ("latent", 5, None, 13, 6, "fp32", {}),
    "latent_fp32_strided": ("latent", 7, None, 64, 32, "fp32", {"strided": True}),
    "latent_bf16_t9_c100": ("latent", 9, None, 100, 18, "bf16", {"strided": True}),
    "latent_bf16_invariance": ("latent", 33, None, 64, 32, "bf16", {"invariance": True}),
}


def _ulps(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    d = (y.double() - ref.double()).abs()
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return float((d / ulp).max()) if d.numel() else 0.0


def _tables(gen: torch.Generator, T: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows gathered from a table (as Rope.gather), float32."""
    ang = torch.rand(64, R // 2, generator=gen, dtype=torch.float64) * 6.3
    pos = torch.randint(0, 64, (T,), generator=gen)
    return ang.cos().float().index_select(0, pos), ang.sin().float().index_select(0, pos)


def _run_rope(T, N, P, R, dt, opt, gen):
    width = P + R
    q = torch.randn(T, N, width + (3 if opt.get("strided") else 0), generator=gen).to(dt)
    q = q[..., :width]
    cos, sin = _tables(gen, T, R)
    y = rope_heads(q, P, cos, sin)
    ref = rope_heads_torch(q, P, cos, sin)
    rec = {"meta": y.dtype == ref.dtype and y.shape == ref.shape, "nonfinite": int((~y.isfinite()).sum()),
           "ulps_rope": _ulps(y, ref, dt), "ulps_norm": 0.0, "bad": []}
    if opt.get("invariance"):
        for t in (0, 1, 16, T - 1):
            if not torch.equal(rope_heads(q[t:t + 1], P, cos[t:t + 1], sin[t:t + 1])[0], y[t]):
                rec["bad"].append(f"row {t}: T=1 != T={T}")
    return rec


def _run_latent(T, C, R, dt, opt, gen):
    S = 2 * T + 5
    extra = 7 if opt.get("strided") else 0
    kva = (torch.randn(T, C + R + extra, generator=gen) * 2).to(dt)[:, extra:]  # a view, row stride > width
    w = (torch.rand(C, generator=gen) + 0.5).to(dt)
    cos, sin = _tables(gen, T, R)
    slots = torch.randperm(S, generator=gen)[:T]
    base = torch.randn(S, C + R, generator=gen).to(dt)
    kv, ref = base.clone(), base.clone()
    latent_write(kva, w, 1e-6, cos, sin, kv, slots)
    latent_write_torch(kva, w, 1e-6, cos, sin, ref, slots)
    others = torch.ones(S, dtype=torch.bool)
    others[slots] = False
    rec = {"meta": True, "nonfinite": int((~kv.isfinite()).sum()),
           "ulps_rope": _ulps(kv[:, C:], ref[:, C:], dt), "ulps_norm": _ulps(kv[:, :C], ref[:, :C], dt),
           "bad": [] if torch.equal(kv[others], base[others]) else ["slots outside `slots` were written"]}
    if opt.get("invariance"):
        for t in (0, 1, 16, T - 1):
            one = base.clone()
            latent_write(kva[t:t + 1], w, 1e-6, cos[t:t + 1], sin[t:t + 1], one, slots[t:t + 1])
            if not torch.equal(one[slots[t]], kv[slots[t]]):
                rec["bad"].append(f"row {t}: T=1 != T={T}")
    return rec


def _run_one(name, spec):
    kind, T, N, P, R, dts, opt = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    rec = _run_rope(T, N, P, R, DT[dts], opt, gen) if kind == "rope" else _run_latent(T, P, R, DT[dts], opt, gen)
    rec["seed"] = seed
    return rec


def test_rejects_bad_inputs():
    cos = sin = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        rope_heads(torch.zeros(2, 1, 7), 0, cos, sin)  # odd rope width
    with pytest.raises(ValueError):
        rope_heads(torch.zeros(3, 1, 6), 0, cos, sin)  # tables for 2 rows, 3 queries
    with pytest.raises(TypeError):
        latent_write(torch.zeros(2, 10), torch.zeros(4, dtype=torch.bfloat16), 1e-6, cos, sin,
                     torch.zeros(5, 10), torch.arange(2))
    with pytest.raises(ValueError):
        latent_write(torch.zeros(2, 10), torch.zeros(4), 1e-6, cos, sin, torch.zeros(5, 10),
                     torch.arange(3))


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    dts = CASES[name][5]
    _interp.assert_ulps(interp_results[name], "the torch path",
                        {"ulps_rope": ULPS_ROPE[dts], "ulps_norm": ULPS_NORM[dts]})


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
