"""INT4 routed experts in the model: against the numpy reference, and proof that quantization is applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import greedy_from_weights, load_target
from kdtree_engine.model.moe import MoE
from kdtree_engine.quant import k2_quantization_config
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import save_checkpoint

CFG = preset("k2-tiny")


def as_torch(w: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}


@pytest.mark.parametrize("group", [32])
def test_int4_experts_match_reference_and_differ_from_dense(group: int) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    qcfg = CFG.replace(quantization=k2_quantization_config(group))
    wq = reference.random_weights(CFG, seed, quantize_experts_group=group)
    prompt = np.random.default_rng(seed).integers(2, CFG.vocab_size, 6).tolist()
    want = reference.greedy(CFG, wq, prompt, 32)
    got = greedy_from_weights(qcfg, as_torch(wq), prompt, 32, "cpu", torch.float32)
    assert got == want, f"seed={seed}"
    # The experts really are INT4 in the engine, and their logits differ from the dense weights'.
    wd = reference.random_weights(CFG, seed)
    ids = np.array(prompt)
    lq = reference.forward(CFG, wq, ids)
    ld = reference.forward(CFG, wd, ids)
    assert np.abs(lq - ld).max() > 1e-3


def test_quantize_at_load_equals_reference_quantizer(tmp_path) -> None:
    seed = int(np.random.default_rng().integers(1 << 30))
    dense = reference.random_weights(CFG, seed)
    save_checkpoint(tmp_path / "dense", CFG, as_torch(dense))
    model = load_target(tmp_path / "dense", device=torch.device("cpu"), dtype=torch.float32, quantize="w4a16",
                        progress=False)
    moe_layers = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    assert moe_layers and all(m.experts.group_size == 32 for m in moe_layers)
    assert all(not l.self_attn.o_proj.quantized for l in model.layers)  # experts only
    prompt = [7, 3, 9, 12, 40]
    got = generate(model, prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    want = reference.greedy(CFG, reference.random_weights(CFG, seed, quantize_experts_group=32), prompt, 24)
    assert got == want, f"seed={seed}"


def test_int4_checkpoint_round_trip_and_already_quantized_refused(tmp_path) -> None:
    qcfg = CFG.replace(quantization=k2_quantization_config(32))
    wq = reference.random_weights(CFG, 4, quantize_experts_group=32)
    # Scales are stored in bfloat16 in the released checkpoints; keep exact values by rounding here.
    tensors = {k: (v.to(torch.bfloat16) if k.endswith("weight_scale") else v) for k, v in as_torch(wq).items()}
    save_checkpoint(tmp_path / "q", qcfg, tensors, layout="k25", shard_bytes=300_000)
    model = load_target(tmp_path / "q", device=torch.device("cpu"), dtype=torch.float32, progress=False)
    ref_w = {k: (v.to(torch.bfloat16).float().numpy() if k.endswith("weight_scale") else v.numpy())
             for k, v in as_torch(wq).items()}
    prompt = [5, 6, 7]
    assert generate(model, prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids == \
        reference.greedy(CFG, ref_w, prompt, 16)
    from kdtree_engine.quant import QuantError
    with pytest.raises(QuantError, match="already quantized"):
        load_target(tmp_path / "q", device=torch.device("cpu"), dtype=torch.float32, quantize="w4a16",
                    progress=False)
