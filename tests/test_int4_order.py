"""INT4 word order of modules (model/int4_order.py) and the INT4 kernel choice (kernels/dispatch.int4_kernel)
on the CPU: in-place reorder round trips, the torch paths read checkpoint order from a reordered module,
loading restores checkpoint order, the choice names its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import load_target
from kdtree_engine.kernels import dispatch
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.int4_order import CHECKPOINT, FRAG, checkpoint_int4, order_of, set_order
from kdtree_engine.model.layers import Linear
from kdtree_engine.model.moe import MoE
from kdtree_engine.quant import k2_quantization_config
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import save_checkpoint

CFG = preset("k2-tiny")


def _linear(n: int = 64, k: int = 96) -> Linear:
    layer = Linear(k, n, group_size=32)
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    layer.weight_packed.copy_(torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32))
    layer.weight_scale.copy_(torch.rand(n, k // 32, generator=g) * 0.1 + 0.01)
    return layer


@pytest.mark.parametrize("n,k", [(64, 96), (192, 512)])
def test_linear_reorder_round_trip_and_checkpoint_view(n, k):
    """Fragment order (nibbles permuted in each row's blocks, then blocks of 64 rows made contiguous; the scales'
    blocks of 64 rows made contiguous too) and back: the checkpoint's words and scales, and the same dense weight
    through checkpoint_int4."""
    layer = _linear(n, k)
    words = layer.weight_packed.clone()
    scales = layer.weight_scale.clone()
    dense = layer.dense_weight().clone()
    set_order(layer, FRAG)
    assert order_of(layer) == FRAG and not torch.equal(layer.weight_packed, words)
    assert not torch.equal(layer.weight_scale, scales)   # more than one block per row: the tiles move them
    view_words, view_scales = checkpoint_int4(layer, "weight_packed")
    assert torch.equal(view_words, words)
    assert torch.equal(view_scales, scales)
    assert torch.equal(layer.dense_weight(), dense)
    set_order(layer, CHECKPOINT)
    assert torch.equal(layer.weight_packed, words) and torch.equal(layer.weight_scale, scales)


def test_expert_checkpoint_view_is_the_experts_own():
    """An Experts module in fragment order: one expert's checkpoint view (converted alone) equals that expert's
    words and scales as loaded, for both matrices."""
    from kdtree_engine.model.moe import Experts
    ex = Experts(CFG, dtype=torch.float32, group_size=32)
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    for name in ("w13", "w2"):
        w, s = getattr(ex, f"{name}_packed"), getattr(ex, f"{name}_scale")
        w.copy_(torch.randint(-2**31, 2**31 - 1, w.shape, generator=g, dtype=torch.int32))
        s.copy_(torch.rand(s.shape, generator=g) * 0.1 + 0.01)
    want = {n: (getattr(ex, f"{n}_packed").clone(), getattr(ex, f"{n}_scale").clone()) for n in ("w13", "w2")}
    set_order(ex, FRAG)
    for name, (w, s) in want.items():
        assert not torch.equal(getattr(ex, f"{name}_packed"), w)
        for e in (0, w.shape[0] - 1):
            view_w, view_s = checkpoint_int4(ex, f"{name}_packed", e)
            assert torch.equal(view_w, w[e]) and torch.equal(view_s, s[e]), f"{name} expert {e}"


def test_torch_path_on_a_reordered_module_gives_the_same_output():
    layer = _linear()
    x = torch.randn(5, 96)
    want = layer(x)
    set_order(layer, FRAG)
    assert torch.equal(layer(x), want)          # the CPU kernel choice ("torch") restores checkpoint order
    assert order_of(layer) == CHECKPOINT


def test_int4_kernel_reasons():
    cpu = torch.device("cpu")
    assert dispatch.int4_kernel(KernelPolicy(), cpu, torch.bfloat16, "linear [64 x 96]", None) == "torch"
    assert dispatch.int4_kernel(KernelPolicy(int4="triton"), cpu, torch.bfloat16, "linear [64 x 96]", None) == "triton"
    with pytest.raises(ValueError, match="not on cuda"):
        dispatch.int4_kernel(KernelPolicy(int4="frag"), cpu, torch.bfloat16, "linear [64 x 96]", None)


def test_frag_shape_reasons():
    from kdtree_engine.kernels.layouts import frag_gpb, frag_moe_unsupported, frag_unsupported
    assert frag_unsupported(4096, 7168, 32) is None
    assert "group size 64" in frag_unsupported(4096, 7168, 64)
    assert "not a multiple of 64" in frag_unsupported(100, 7168, 32)
    assert frag_moe_unsupported(7168, 2048, 32) is None and frag_moe_unsupported(256, 192, 32) is None
    assert (frag_gpb(7168), frag_gpb(2048), frag_gpb(192), frag_gpb(32)) == (8, 8, 2, 1)


def test_loading_restores_checkpoint_order_and_model_matches_reference(tmp_path):
    """Experts reordered in place, then weights loaded again: the loader writes checkpoint order, and the
    model decodes the reference's greedy tokens."""
    seed = int(np.random.default_rng().integers(1 << 30))
    qcfg = CFG.replace(quantization=k2_quantization_config(32))
    wq = reference.random_weights(CFG, seed, quantize_experts_group=32)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in wq.items()}
    tensors = {k: (v.to(torch.bfloat16).float() if k.endswith("weight_scale") else v) for k, v in tensors.items()}
    save_checkpoint(tmp_path / "q", qcfg, tensors)
    model = load_target(tmp_path / "q", device=torch.device("cpu"), dtype=torch.float32, progress=False)
    experts = [layer.mlp.experts for layer in model.layers if isinstance(layer.mlp, MoE)]
    prompt = [5, 9, 2, 33]
    want = generate(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    for ex in experts:
        set_order(ex, FRAG)
    model.load_weights(tensors.items())
    assert all(order_of(ex) == CHECKPOINT for ex in experts)
    for ex in experts:
        set_order(ex, FRAG)                       # the CPU forward reads them back in checkpoint order
    assert generate(model, prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids == want


def test_forced_frag_error_names_the_linear():
    """Forcing the fragment kernels where they cannot run is an error that names the weight and the reason."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="KDTREE_INT4_BACKEND=frag.*linear \\[64 x 96\\].*not on cuda"):
        dispatch.int4_kernel(KernelPolicy(int4="frag"), cpu, torch.bfloat16, "linear [64 x 96]", None)
