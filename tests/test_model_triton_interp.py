"""The model's CUDA dispatch (Triton W4A16 linear, fused MoE, MLA attention, and with the dense backend
forced too: GEMMs, RMSNorm and residual + norm, router tail (grouped), SwiGLU, the drafter's head norm +
rope) run through the Triton interpreter on the CPU, against the torch paths: the wiring, shapes and
strides of the real kernels; the device-resident tree step (whole cache buffer, device-side length) and
the drafter's eager and static passes included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import json, sys, torch
    from kdtree_engine import reference
    from kdtree_engine.config import preset
    from kdtree_engine.engine import target_from_weights
    from kdtree_engine.quant import k2_quantization_config
    seed = int(sys.argv[1])
    cfg = preset("k2-tiny").replace(num_hidden_layers=2, quantization=k2_quantization_config(32))
    w = {k: torch.from_numpy(v) for k, v in reference.random_weights(cfg, seed, quantize_experts_group=32).items()}
    model = target_from_weights(cfg, w, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=g)
    cache = model.new_cache(32)
    first = model(ids[:5], cache).logits
    T = 6
    parents = [-1, 0, 0, 1, 2, 2]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    tree = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    depth = mask.sum(1) - 1
    out = model(tree, cache, positions=5 + depth, tree_mask=mask).logits
    cache2 = model.new_cache(40)  # the device-resident step: whole buffer, length on the device
    model(ids[:5], cache2)
    model.rope.ensure(64)
    st = model(tree, cache2, 5 + depth, mask, start=torch.tensor(5)).logits
    print(json.dumps({"first": first.tolist(), "tree": out.tolist(), "static": st.tolist()}))
''')


DRAFT_CHILD = textwrap.dedent('''
    import json, sys, torch
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.model.dflash import DFlashDrafter
    seed = int(sys.argv[1])
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=6, mask_token_id=255,
                       target_layer_ids=(0, 3), num_target_layers=4, vocab_size=256, sliding_windows=(3, None))
    drafter = DFlashDrafter.random(dcfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    S, F = 9, 2 * 64
    ctx = torch.randn(S, F, generator=g)
    block = torch.randn(6, 64, generator=g)
    eager = drafter(ctx, block, drafter.new_cache(32), S)
    c2 = drafter.new_cache(32)
    drafter.append_context(ctx[: S - 3], c2)
    rows = torch.cat([ctx[S - 3:], torch.randn(3, F, generator=g)])
    st = drafter(rows, block, c2, torch.tensor(S), torch.tensor(3))
    print(json.dumps({"first": eager.tolist(), "tree": eager.tolist(), "static": st.tolist()}))
''')


def run(seed: int, triton: bool | str, child: str = CHILD) -> dict:
    env = dict(os.environ)
    for k in ("TRITON_INTERPRET", "KDTREE_INT4_BACKEND", "KDTREE_ATTN_BACKEND", "KDTREE_DENSE_BACKEND"):
        env.pop(k, None)
    if triton:
        env.update(TRITON_INTERPRET="1", KDTREE_INT4_BACKEND="triton", KDTREE_ATTN_BACKEND="triton")
    if triton == "all":
        env.update(KDTREE_DENSE_BACKEND="triton")
    r = subprocess.run([sys.executable, "-c", child, str(seed)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", [True, "all", "drafter"])
def test_triton_dispatch_matches_torch_paths(which: bool | str) -> None:
    import torch

    seed = int(torch.randint(0, 1 << 30, ()).item())
    child = DRAFT_CHILD if which == "drafter" else CHILD
    which = "all" if which == "drafter" else which
    a, b = run(seed, triton=False, child=child), run(seed, triton=which, child=child)
    for key, ref in (("first", "first"), ("tree", "tree"), ("static", "tree")):
        x, y = torch.tensor(a[ref]), torch.tensor(b[key])
        assert torch.isfinite(y).all()
        assert float((x - y).norm() / x.norm()) < 1e-4, (key, seed)
