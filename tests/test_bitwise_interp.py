"""Batch invariance of the whole target forward with the CUDA kernel choices, run on the CPU through
the Triton interpreter (batch-invariant GEMM, per-head GEMM, RMSNorm, MLA attention, W4A16 MoE): a
token's logits computed alone equal, bit for bit, its row inside causal blocks and tree-masked verify
blocks (tests/bitwise_checks.py; the GPU version is tests/gpu/test_bitwise_gpu.py). In a child
process: Triton decides at import whether a kernel is interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent('''
    import json, sys, torch
    torch.set_num_threads(1)
    from bitwise_checks import check_target
    from kdtree_engine import reference
    from kdtree_engine.config import preset
    from kdtree_engine.engine import target_from_weights
    from kdtree_engine.kernels import dispatch
    from kdtree_engine.quant import k2_quantization_config
    seed, quant = int(sys.argv[1]), sys.argv[2] == "w4a16"
    cfg = preset("k2-tiny").replace(num_hidden_layers=2)
    if quant:
        cfg = cfg.replace(quantization=k2_quantization_config(32))
    w = reference.random_weights(cfg, seed, quantize_experts_group=32 if quant else None)
    model = target_from_weights(cfg, {k: torch.from_numpy(v) for k, v in w.items()}, device="cpu",
                                dtype=torch.bfloat16)
    dev = torch.device("cpu")
    p = model.policy
    used = [dispatch.dense_backend(p, dev), dispatch.attn_backend(p, dev), dispatch.int4_backend(p, dev)]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=g).tolist()
    bad = check_target(model, prompt, [1, 5], seed)
    print(json.dumps({"bad": bad, "backends": used}))
''')


def run_child(seed: int, quant: str) -> dict:
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", KDTREE_DENSE_BACKEND="triton", KDTREE_ATTN_BACKEND="triton",
               KDTREE_INT4_BACKEND="triton", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", CHILD, str(seed), quant], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["dense", "w4a16"])
def test_target_rows_bitwise_invariant_interpreted(quant: str) -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    rec = run_child(seed, quant)
    assert rec["backends"] == ["triton", "triton", "triton"]
    assert not rec["bad"], f"seed {seed}: " + "\n".join(rec["bad"])
