"""The numpy reference against transformers' DeepseekV3ForCausalLM, and its W4A16 / init helpers."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree_engine import reference as ref
from kdtree_engine.config import preset

hf_oracle = pytest.importorskip("hf_oracle")

CFG = preset("k2-tiny")  # YaRN on, n_group 2 / topk_group 1, first_k_dense_replace 1
CFG_DENSE2 = CFG.replace(first_k_dense_replace=2)
CFG_NO_QLORA = CFG.replace(q_lora_rank=None, rope_scaling=None)


def _hf_logits(cfg, weights, ids: np.ndarray, dtype=torch.float32) -> np.ndarray:
    model = hf_oracle.hf_model(cfg, {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}, dtype)
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None]).logits[0].double().numpy()  # [T, V]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with HF's own cache (prefill, then one token a step)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([[out[-1]]]), cache=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return ref.random_weights(CFG, 0)


def test_reference_imports_no_torch_or_model() -> None:
    tree = ast.parse(Path(ref.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= {"__future__", "math", "typing", "numpy", "kdtree_engine.config"}, imported


@pytest.mark.parametrize("cfg", [CFG, CFG_DENSE2, CFG_NO_QLORA], ids=["k2-tiny", "dense2", "no-qlora-no-yarn"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logits_match_hf(cfg, dtype) -> None:
    w = ref.random_weights(cfg, 1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 24)
    ours = ref.forward(cfg, w, ids, dtype=dtype)  # [T, V]
    assert ours.dtype == dtype and ours.shape == (24, cfg.vocab_size)
    theirs = _hf_logits(cfg, w, ids)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert rel < 1e-4, rel


def test_group_routing_is_exercised(weights) -> None:
    """k2-tiny routes within one of two groups; tokens must pick both groups and several experts."""
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, 48)
    w = ref.prepare_weights(CFG, weights)
    h = ref.hidden_states(CFG, w, ids)
    x = ref.rms_norm(h[1], w["layers.1.post_attention_layernorm.weight"], CFG.rms_norm_eps)
    idx, wts = ref.route(CFG, w, "layers.1.mlp.", x)  # [T, K]
    per = CFG.n_routed_experts // CFG.n_group
    groups = idx // per
    assert (groups == groups[:, :1]).all(), "both experts of a token come from its one kept group"
    assert len(np.unique(groups)) == 2 and len(np.unique(idx)) >= 6
    np.testing.assert_allclose(wts.sum(-1), CFG.routed_scaling_factor, rtol=1e-12)


def test_router_ties_go_to_lower_index() -> None:
    cfg = CFG
    e = cfg.n_routed_experts
    w = {"layers.1.mlp.gate.weight": np.zeros((e, cfg.hidden_size)),
         "layers.1.mlp.gate.e_score_correction_bias": np.zeros(e)}
    idx, wts = ref.route(cfg, w, "layers.1.mlp.", np.ones((1, cfg.hidden_size)))
    assert idx.tolist() == [[0, 1]]  # all equal: group 0, experts 0 and 1
    np.testing.assert_allclose(wts, [[cfg.routed_scaling_factor / 2] * 2])


def test_bias_only_chooses() -> None:
    cfg = CFG.replace(n_group=1, topk_group=1)
    e, hsz = cfg.n_routed_experts, cfg.hidden_size
    gate = np.zeros((e, hsz))
    gate[:, 0] = np.linspace(-1, 1, e)  # expert 7 has the highest affinity
    bias = np.zeros(e)
    bias[0] = 5.0  # expert 0 is chosen through the bias only
    x = np.zeros((1, hsz))
    x[0, 0] = 1.0
    idx, wts = ref.route(cfg, {"l.gate.weight": gate, "l.gate.e_score_correction_bias": bias}, "l.", x)
    assert idx.tolist() == [[0, 7]]
    s = 1 / (1 + np.exp(-gate[[0, 7], 0]))
    np.testing.assert_allclose(wts[0], s / s.sum() * cfg.routed_scaling_factor)


def test_yarn_inv_freq_matches_transformers() -> None:
    for cfg in (CFG, preset("k2")):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_oracle.hf_config(cfg))
        np.testing.assert_allclose(ref.yarn_inv_freq(cfg), inv.double().numpy(), rtol=1e-6)
        cos, _ = ref.rope_cos_sin(cfg, np.array([0]))
        assert math.isclose(cos[0, 0], attn_factor)


def test_k2_yarn_split() -> None:
    """K2 (theta 50000, beta 1/1, factor 64): pairs 0..19 keep their frequency, 20..31 are divided by 64."""
    cfg = preset("k2")
    inv = ref.yarn_inv_freq(cfg)
    base = 1.0 / 50000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv[:20], base[:20])
    np.testing.assert_allclose(inv[20:], base[20:] / 64)
    assert math.isclose(cfg.softmax_scale, 0.144680, rel_tol=1e-5)


def test_rope_is_interleaved() -> None:
    x = np.zeros((2, 1, 4))
    x[:, 0, 0] = 1.0  # unit vector on dim 0 of pair (0, 1)
    cos = np.array([[1.0, 1.0], [0.0, 1.0]])
    sin = np.array([[0.0, 0.0], [1.0, 0.0]])
    out = ref.apply_rope_interleaved(x, cos, sin)
    np.testing.assert_allclose(out[1, 0], [0.0, 1.0, 0.0, 0.0])  # rotated into dim 1, not dim 2


def test_greedy_matches_hf_float32(weights) -> None:
    prompt = [5, 17, 99, 3, 42, 7, 200, 11]
    ours = ref.greedy(CFG, weights, prompt, 64)
    model = hf_oracle.hf_model(CFG, weights, torch.float32)
    assert _hf_greedy(model, prompt, 64) == ours
    assert len(set(ours)) >= 16, "decoding should not collapse onto a few ids"


def test_float32_reference_agrees(weights) -> None:
    prompt = np.array([9, 8, 7, 6, 5, 4, 3, 2])
    assert ref.greedy(CFG, weights, prompt, 64, dtype=np.float32) == ref.greedy(CFG, weights, prompt, 64)


def test_layers_matter(weights) -> None:
    """Zeroing a layer's writes moves every logit row materially and changes the greedy tokens."""
    from kdtree_engine.bundle import teacher_forced_margin

    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, CFG.vocab_size, 8) for _ in range(3)]
    w = ref.prepare_weights(CFG, weights)
    golden = [ref.greedy(CFG, w, p, 48) for p in prompts]
    changed_layers = 0
    for layer in range(CFG.num_hidden_layers):
        lp = f"layers.{layer}."
        wz = {k: (np.zeros_like(v) if k.startswith(lp) and k.endswith(("o_proj.weight", "down_proj",
                                                                        "down_proj.weight")) else v)
              for k, v in w.items()}
        seq = np.concatenate([prompts[0], golden[0]])
        base, zeroed = ref.forward(CFG, w, seq), ref.forward(CFG, wz, seq)  # [T, V]
        assert np.abs(zeroed - base).max(-1).min() > 0.05 * np.abs(base).max(), f"layer {layer} barely matters"
        # A negative teacher-forced margin means greedy decoding of the zeroed model leaves the golden path.
        changed_layers += any(teacher_forced_margin(CFG, wz, p, g) < 0 for p, g in zip(prompts, golden))
    assert changed_layers >= CFG.num_hidden_layers // 2, changed_layers


def test_random_weights_properties(weights) -> None:
    assert all(v.dtype == np.float32 for v in weights.values())
    assert set(weights) == set(ref.weight_names(CFG))
    bias = weights["layers.1.mlp.gate.e_score_correction_bias"]
    assert np.abs(bias).min() > 0
    nw = weights["layers.0.input_layernorm.weight"]
    assert 0.7 < nw.mean() < 1.3 and not np.allclose(nw, 1.0)
    again = ref.random_weights(CFG, 0)
    assert all(np.array_equal(weights[k], again[k]) for k in weights)


def test_quantize_roundtrip_bound() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    for g in (32, 64):
        packed, scale = ref.quantize_w4a16(w, g)
        assert packed.dtype == np.int32 and packed.shape == (16, 8)
        assert scale.dtype == np.float32 and scale.shape == (16, 64 // g)
        deq = ref.dequantize_w4a16(packed, scale, g)
        step = np.repeat(scale, g, axis=1)
        assert np.all(np.abs(deq - w) <= step / 2 + 1e-6)
        # Re-quantizing a dequantized weight is exact.
        p2, s2 = ref.quantize_w4a16(deq, g)
        np.testing.assert_array_equal(ref.dequantize_w4a16(p2, s2, g), deq)


def test_int4_layout_lsb_first() -> None:
    q = np.arange(-8, 8)[None, :].repeat(2, 0)  # [2, 16] every level
    scale = np.ones((2, 1), dtype=np.float32)
    u = (q + 8).astype(np.uint32).reshape(2, 2, 8)
    manual = np.bitwise_or.reduce(u << (4 * np.arange(8, dtype=np.uint32)), axis=-1).view(np.int32)
    np.testing.assert_array_equal(ref.unpack_int4(manual), q)
    np.testing.assert_array_equal(ref.dequantize_w4a16(manual, scale, 16), q.astype(np.float32))
    # Byte view: element 2b in the low nibble of byte b.
    b = manual.view(np.uint8).reshape(2, -1)
    np.testing.assert_array_equal((b & 15).astype(int) - 8, q[:, 0::2])
    np.testing.assert_array_equal((b >> 4).astype(int) - 8, q[:, 1::2])
    # quantize_w4a16 writes the same layout: integer weights with absmax 7 come back exactly.
    qi = np.clip(q, -7, 7).astype(np.float32)
    packed, s = ref.quantize_w4a16(qi, 16)
    np.testing.assert_array_equal(s, 1.0)
    np.testing.assert_array_equal(ref.unpack_int4(packed), qi)


def test_int4_matches_torch_quant_module() -> None:
    quant = pytest.importorskip("kdtree_engine.quant")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    packed, scale = ref.quantize_w4a16(w, 32)
    theirs = quant.dequantize(torch.from_numpy(packed), torch.from_numpy(scale), 32).numpy()
    np.testing.assert_array_equal(theirs, ref.dequantize_w4a16(packed, scale, 32))


def test_int4_experts_in_reference_match_hf() -> None:
    wq = ref.random_weights(CFG, 2, quantize_experts_group=32)
    assert "layers.1.mlp.experts.0.gate_proj.weight_packed" in wq
    assert "layers.1.mlp.experts.0.gate_proj.weight" not in wq
    dense = dict(wq)
    for k in [k for k in wq if k.endswith(".weight_packed")]:
        base = k[: -len(".weight_packed")]
        dense[base + ".weight"] = ref.dequantize_w4a16(wq[k], dense.pop(base + ".weight_scale"))
        del dense[k]
    ids = np.random.default_rng(5).integers(0, CFG.vocab_size, 16)
    ours = ref.forward(CFG, wq, ids)
    theirs = _hf_logits(CFG, dense, ids)
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4
    wf = ref.random_weights(CFG, 2)
    assert np.abs(ref.forward(CFG, wf, ids) - ours).max() > 1e-2  # quantization is applied
