"""The drafter's one-launch attention (kernels/draft_attention.py) under the interpreter (child process, see
_interp.py) against a float64 oracle written from the definition (keys = context slots < start at their
slot positions, then the block at start + b; a query at start + i sees a key at p when p > start + i - window),
at small odd shapes: no context, several context tiles, sliding windows narrower than the block, GQA,
strided block keys / values (views of a stacked k|v GEMM), a head dim that is not a power of two; fp32 and
bf16, fresh random inputs. Also the drafter layer's wiring: DraftAttention.forward with ``start`` (the
kernel) against the same layer without it (the torch path) on cached context."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.draft_attention import draft_attention  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 2e-2}   # relative (Frobenius) error against the float64 oracle

# name: (B, H, Hkv, d, S_cap, start, window, dtype, options)
CASES = {
    "fp32_no_context": (16, 4, 2, 16, 40, 0, None, "fp32", {}),
    "fp32_tiles": (16, 4, 2, 16, 200, 137, None, "fp32", {}),
    "fp32_window3": (16, 4, 2, 16, 80, 37, 3, "fp32", {}),
    "fp32_odd_window20": (6, 3, 1, 12, 90, 70, 20, "fp32", {}),
    "bf16_strided": (16, 4, 2, 64, 150, 130, None, "bf16", {"strided": True}),
    "bf16_window_tiles": (16, 8, 2, 64, 300, 257, 100, "bf16", {"strided": True}),
    "module_fp32": (6, 4, 2, 16, 32, 9, None, "fp32", {"module": True}),
}


def oracle(q, k_ctx, v_ctx, kb, vb, start: int, window: int | None) -> torch.Tensor:
    B, H, d = q.shape
    Hkv = k_ctx.shape[0]
    rep = H // Hkv
    k = torch.cat([k_ctx[:, :start], kb.transpose(0, 1)], dim=1).double()   # [Hkv, start + B, d]
    v = torch.cat([v_ctx[:, :start], vb.transpose(0, 1)], dim=1).double()
    kpos = torch.cat([torch.arange(start), start + torch.arange(B)])
    qpos = start + torch.arange(B)
    vis = torch.ones(B, start + B, dtype=torch.bool)
    if window is not None:
        vis = kpos[None, :] > qpos[:, None] - window
    out = torch.empty(B, H, d, dtype=torch.float64)
    for h in range(H):
        s = q[:, h].double() @ k[h // rep].T / math.sqrt(d)
        s = s.masked_fill(~vis, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[h // rep]
    return out


def _inputs(B, H, Hkv, d, S, dt, strided, gen):
    q = torch.randn(B, H, d, generator=gen).to(dt)
    k_ctx = torch.randn(Hkv, S, d, generator=gen).to(dt)
    v_ctx = torch.randn(Hkv, S, d, generator=gen).to(dt)
    if strided:   # k | v of one GEMM output [B, 2 * Hkv * d]
        kv = torch.randn(B, 2 * Hkv * d, generator=gen).to(dt)
        kb, vb = (t.view(B, Hkv, d) for t in kv.chunk(2, dim=-1))
    else:
        kb, vb = torch.randn(B, Hkv, d, generator=gen).to(dt), torch.randn(B, Hkv, d, generator=gen).to(dt)
    return q, k_ctx, v_ctx, kb, vb


def _run_module(B, H, Hkv, d, S, start, dt, gen, seed):
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.kernels.policy import KernelPolicy
    from kdtree_engine.model.dflash import DFlashDrafter, rope_tables
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
                       num_key_value_heads=Hkv, head_dim=d, block_size=B, mask_token_id=255,
                       target_layer_ids=(0, 3), num_target_layers=4, vocab_size=256, sliding_windows=(3, None))
    # the same weights under the torch paths and under the Triton kernels
    drafters = {b: DFlashDrafter.random(dcfg, seed=seed % 1000, policy=KernelPolicy(dense=b)) for b in ("torch", "triton")}
    x = torch.randn(B, 64, generator=gen)
    k_ctx, v_ctx = torch.randn(Hkv, S, d, generator=gen), torch.randn(Hkv, S, d, generator=gen)
    q_pos = start + torch.arange(B)
    k_pos = torch.arange(start + B)
    cos, sin = rope_tables(q_pos, d, 10000.0, dt)
    rels = []
    for ref, tri in zip(drafters["torch"].layers, drafters["triton"].layers):   # layer 0: a window of 3; 1: none
        want = ref.self_attn(x, cos, sin, k_ctx[:, :start], v_ctx[:, :start], q_pos, k_pos)
        got = tri.self_attn(x, cos, sin, k_ctx, v_ctx, q_pos, k_pos, None, torch.tensor(start))
        rels.append(float((got.double() - want.double()).norm() / want.double().norm()))
    return {"ok_meta": True, "nonfinite": int((~got.isfinite()).sum()), "rel": max(rels), "seed": seed}


def _run_one(name, spec):
    B, H, Hkv, d, S, start, window, dts, opt = spec
    dt = DT[dts]
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    if opt.get("module"):
        return _run_module(B, H, Hkv, d, S, start, dt, gen, seed)
    q, k_ctx, v_ctx, kb, vb = _inputs(B, H, Hkv, d, S, dt, opt.get("strided", False), gen)
    y = draft_attention(q, k_ctx, v_ctx, kb, vb, torch.tensor(start), window)
    ref = oracle(q, k_ctx, v_ctx, kb, vb, start, window)
    yd = y.double()
    return {"ok_meta": y.dtype == q.dtype and y.shape == q.shape, "nonfinite": int((~yd.isfinite()).sum()),
            "rel": float((yd - ref).norm() / ref.norm()), "seed": seed}


def test_rejects_bad_inputs():
    q = torch.zeros(4, 2, 8)
    kc = torch.zeros(1, 10, 8)
    kb = torch.zeros(4, 1, 8)
    start = torch.tensor(3)
    with pytest.raises(ValueError, match="k_ctx"):
        draft_attention(q, torch.zeros(1, 10, 4), kc, kb, kb, start)
    with pytest.raises(ValueError, match="kb"):
        draft_attention(q, kc, kc, torch.zeros(3, 1, 8), kb, start)
    with pytest.raises(ValueError, match="multiple"):
        draft_attention(torch.zeros(4, 3, 8), torch.zeros(2, 10, 8), torch.zeros(2, 10, 8), torch.zeros(4, 2, 8),
                        torch.zeros(4, 2, 8), start)
    with pytest.raises(ValueError, match="start"):
        draft_attention(q, kc, kc, kb, kb, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="window"):
        draft_attention(q, kc, kc, kb, kb, start, 0)
    with pytest.raises(ValueError, match="unit last stride"):
        draft_attention(q, kc, kc, kb, torch.zeros(4, 1, 16)[..., ::2], start)


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    _interp.assert_close(interp_results[name], TOL[CASES[name][7]])


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
