"""FP8 block-quantized checkpoints: the format (fp8.py) against HF transformers' fine-grained FP8
dequantization and a numpy implementation of the block layout; quantization_config and checkpoint
strictness (each refusal names the field / tensor); tiny FP8 and BF16 checkpoints against HF transformers
(logits) and the numpy reference (greedy tokens) on the dequantized weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_ckpt import fp8_checkpoint, fp8_config, fp8_dequantize_np, fp8_quantize_np, new_seed, rel
from hf_oracle import hf_model
from kdtree_engine import reference
from kdtree_engine.bundle import load_bundle, make_bundle, reference_weights, save_bundle
from kdtree_engine.config import preset
from kdtree_engine.golden import main as golden_main
from kdtree_engine.engine import load_target
from kdtree_engine.errors import QuantError, WeightsError
from kdtree_engine.fp8 import FP8_DTYPE, Fp8Block, dequantize_fp8, quantize_fp8
from kdtree_engine.model.moe import MoE
from kdtree_engine.quant import Fp8Scheme, fp8_quantization_config, parse_quantization_config
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import load_checkpoint, save_checkpoint

CFG = preset("k2-tiny")


# ---- the format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((576, 200), (128, 128)), ((48, 80), (32, 16))])
def test_dequantize_matches_hf_and_numpy(shape, block) -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    b = Fp8Block(*block)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(b.scale_shape(n, k), generator=g) * 0.01 + 1e-4
    ours = dequantize_fp8(q, s, b)
    want = fp8_dequantize_np(q, s.numpy(), *block)
    assert torch.equal(ours, torch.from_numpy(want)), f"seed={seed}"
    hf = pytest.importorskip("transformers.integrations.finegrained_fp8")
    hf_deq = getattr(hf, "_dequantize_fp8_weight")   # the dequantization transformers' FP8 integration uses
    assert torch.equal(hf_deq(q.clone(), s, list(block), torch.float32), ours), f"seed={seed}"


def test_quantize_round_trip_and_numpy_layout() -> None:
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 100, 70, generator=g)
    b = Fp8Block(32, 32)
    q, s = quantize_fp8(w, b)
    assert q.dtype == FP8_DTYPE and tuple(s.shape) == (3, 4, 3)
    deq = dequantize_fp8(q, s, b)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, and the block absmax maps to 448
    assert (deq - w).abs().max() <= (w.abs().max() / 448) * 16 + 1e-6, f"seed={seed}"
    q_np, s_np = fp8_quantize_np(w[1].numpy(), 32, 32)
    assert np.allclose(s_np, s[1].numpy(), rtol=1e-6), f"seed={seed}"


# ---- quantization_config -------------------------------------------------------------------------

def test_parse_fp8_config() -> None:
    scheme = parse_quantization_config(fp8_quantization_config())
    assert isinstance(scheme, Fp8Scheme) and scheme.block == Fp8Block(128, 128)
    assert scheme.is_quantized("layers.0.self_attn.kv_a_proj_with_mqa")
    assert scheme.is_quantized("model.layers.3.mlp.experts.7.down_proj")
    assert not scheme.is_quantized("lm_head")
    ign = parse_quantization_config({**fp8_quantization_config((64, 64)),
                                     "ignored_layers": ["model.layers.1.self_attn.o_proj", "re:.*shared_experts.*"],
                                     "modules_to_not_convert": ["model.layers.2"]})
    assert not ign.is_quantized("layers.1.self_attn.o_proj")
    assert ign.is_quantized("layers.1.self_attn.q_a_proj")
    assert not ign.is_quantized("layers.3.mlp.shared_experts.up_proj")
    assert not ign.is_quantized("layers.2.mlp.experts.0.up_proj")
    assert ign.is_quantized("layers.20.mlp.experts.0.up_proj")


@pytest.mark.parametrize("change,field", [
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"weight_block_size": [128, 0]}, "weight_block_size"),
    ({"weight_block_size": [128, 100]}, "weight_block_size"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"ignored_layers": "lm_head"}, "ignored_layers"),
    ({"modules_to_not_convert": ["re:(["]}, "modules_to_not_convert"),
    ({"weight_scale_format": "ue8m0"}, "weight_scale_format"),
    ({"dequantize": True}, "dequantize"),
])
def test_fp8_config_refusals_name_the_field(change, field) -> None:
    with pytest.raises(QuantError, match=f"'{field}'"):
        parse_quantization_config({**fp8_quantization_config(), **change})


def test_unknown_quant_method_is_refused() -> None:
    with pytest.raises(QuantError, match="'quant_method'"):
        parse_quantization_config({"quant_method": "fp4"})


# ---- checkpoints ---------------------------------------------------------------------------------

def fp8_dir(tmp_path, block=(32, 32), ignored=(), seed=0, layout="k2", edit=None, listed=True):
    """An FP8 checkpoint whose ``ignored`` linears are stored dense, listed in ignored_layers when ``listed``."""
    cfg = fp8_config(CFG, block, tuple("model." + m for m in ignored) if listed else ())
    tensors, dense = fp8_checkpoint(CFG, reference.random_weights(CFG, seed), block, ignored)
    if edit is not None:
        edit(tensors)
    save_checkpoint(tmp_path / "fp8", cfg, tensors, layout=layout)
    return tmp_path / "fp8", dense


def test_missing_scale_is_refused_by_name(tmp_path) -> None:
    path, _ = fp8_dir(tmp_path, edit=lambda t: t.pop("layers.1.mlp.experts.3.up_proj.weight_scale_inv"))
    with pytest.raises(WeightsError, match=r"missing: model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale_inv"):
        load_checkpoint(path, fp8_config(CFG, (32, 32)))


def test_wrong_scale_shape_is_refused_by_name(tmp_path) -> None:
    def edit(t):
        t["layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] = torch.ones(1, 2)
    path, _ = fp8_dir(tmp_path, edit=edit)
    with pytest.raises(WeightsError, match=r"kv_a_proj_with_mqa\.weight_scale_inv' has shape \[1, 2\], expected \[2, 2\]"):
        load_checkpoint(path, fp8_config(CFG, (32, 32)))


def test_wrong_dtypes_are_refused_by_name(tmp_path) -> None:
    # by the config alone (the loader first keeps linears stored without a scale dense, test below)
    def bf16_weight(t):
        t["layers.2.self_attn.o_proj.weight"] = t["layers.2.self_attn.o_proj.weight"].float().to(torch.bfloat16)
    path, _ = fp8_dir(tmp_path, edit=bf16_weight)
    with pytest.raises(WeightsError, match=r"o_proj\.weight' has dtype bfloat16.*ignored_layers"):
        load_checkpoint(path, fp8_config(CFG, (32, 32)))

    def f16_scale(t):
        t["layers.2.self_attn.o_proj.weight_scale_inv"] = t["layers.2.self_attn.o_proj.weight_scale_inv"].half()
    path, _ = fp8_dir(tmp_path, edit=f16_scale)
    with pytest.raises(WeightsError, match=r"o_proj\.weight_scale_inv' has dtype float16"):
        load_checkpoint(path, fp8_config(CFG, (32, 32)))


def test_fp8_weights_of_an_ignored_layer_are_refused(tmp_path) -> None:
    path, _ = fp8_dir(tmp_path)
    cfg = fp8_config(CFG, (32, 32), ("model.layers.0.self_attn.o_proj",))
    with pytest.raises(WeightsError, match=r"self_attn\.o_proj\.weight(_scale_inv)?'.*(has dtype float8_e4m3fn|"
                                           r"unexpected)"):
        load_checkpoint(path, cfg)


def test_fp8_model_in_a_non_fp8_config_is_refused(tmp_path) -> None:
    path, _ = fp8_dir(tmp_path)
    with pytest.raises(WeightsError, match=r"FP8 checkpoints need quantization_config\.quant_method 'fp8'"):
        load_checkpoint(path, CFG)


@pytest.mark.parametrize("block,layout,ignored,listed", [
    ((32, 32), "k2", (), True),   # partial blocks: 48-row q_a / kv_a projections
    ((16, 64), "k25", ("layers.0.self_attn.o_proj", "layers.1.mlp.shared_experts.down_proj"), True),
    ((32, 32), "k2", ("layers.0.self_attn.o_proj",), False),   # stored without a scale: stays dense unlisted
])
def test_fp8_checkpoint_matches_hf_and_reference(tmp_path, block, layout, ignored, listed) -> None:
    seed = new_seed()
    path, dense = fp8_dir(tmp_path, block, ignored, seed, layout, listed=listed)
    model = load_target(path, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    # FP8 where the checkpoint has scales, dense where the config ignores the module
    attn0 = model.layers[0].self_attn
    assert attn0.q_a_proj.weight.dtype == FP8_DTYPE and attn0.q_a_proj.fp8_block == Fp8Block(*block)
    assert (attn0.o_proj.weight.dtype == FP8_DTYPE) == (not ignored)
    moe = model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.experts.w13.dtype == FP8_DTYPE
    assert model.lm_head_proj.weight.dtype == torch.float32
    check_against_hf_and_reference(model, dense, seed)


def check_against_hf_and_reference(model, weights, seed: int) -> None:
    """Logits within 1e-4 of HF transformers' on ``weights`` (float32), and greedy tokens equal to the numpy
    reference's, on random ids of ``seed``."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, CFG.vocab_size, 12))
    hf = hf_model(CFG, weights)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    got = model(ids, model.new_cache(16)).logits
    assert rel(got, want) < 1e-4, f"seed={seed}"
    prompt = ids[:5].tolist()
    tokens = generate(model, prompt, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    assert tokens == reference.greedy(CFG, weights, prompt, 20), f"seed={seed}"


def test_bf16_checkpoint_matches_hf_and_reference(tmp_path) -> None:
    seed = new_seed()
    w = reference.random_weights(CFG, seed)
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in w.items()}
    save_checkpoint(tmp_path / "bf16", CFG, bf16)
    rounded = {k: v.float().numpy() for k, v in bf16.items()}
    # float32 activations on the bf16 weights: the same math as HF's, so the logits agree to rounding (bf16
    # activations differ from HF's float32 ones by more than any tolerance that would still test something)
    model = load_target(tmp_path / "bf16", device=torch.device("cpu"), dtype=torch.float32, progress=False)
    assert model.layers[1].mlp.experts.w13.dtype == torch.float32
    check_against_hf_and_reference(model, rounded, seed)


# ---- golden bundles ----------------------------------------------------------------------------------

GOLDEN_FP8 = Path(__file__).resolve().parent / "golden" / "k2-tiny-fp8.golden.safetensors"


def test_committed_fp8_golden_bundle_checks(capsys) -> None:
    """The committed bundle (``kdtree golden make --preset k2-tiny --seed 0 --tokens 32 --quant fp8``): the engine
    on its FP8 weights gives the float64 reference's tokens, and making it again gives the same goldens."""
    b = load_bundle(GOLDEN_FP8)
    assert b.quant == "fp8" and isinstance(parse_quantization_config(b.cfg.quantization), Fp8Scheme)
    assert b.weights["layers.1.mlp.experts.3.up_proj.weight"].dtype == np.uint8
    assert golden_main(["check", str(GOLDEN_FP8)]) == 0
    assert capsys.readouterr().out.strip() == "match 32/32"
    again = make_bundle("k2-tiny", seed=0, n_tokens=32, prompt_len=8, quant="fp8")
    assert again.golden_tokens.tolist() == b.golden_tokens.tolist()
    assert again.prompt_ids.tolist() == b.prompt_ids.tolist()


def test_fp8_golden_is_the_reference_on_dequantized_weights(tmp_path) -> None:
    b = make_bundle(CFG, seed=5, n_tokens=12, prompt_len=6, quant="fp8")
    loaded = load_bundle(save_bundle(b, tmp_path / "f.safetensors"))
    assert loaded.meta["fp8_block"] == "32x32"
    dense = reference_weights(loaded)
    assert not any(k.endswith("weight_scale_inv") for k in dense)
    # the dequantization of the numpy layout written in helpers_ckpt, from the stored bytes
    q = torch.from_numpy(loaded.weights["layers.0.self_attn.kv_a_proj_with_mqa.weight"]).view(FP8_DTYPE)
    s = loaded.weights["layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert np.array_equal(dense["layers.0.self_attn.kv_a_proj_with_mqa.weight"], fp8_dequantize_np(q, s, 32, 32))
    assert reference.greedy(CFG, dense, loaded.prompt_ids, 12) == b.golden_tokens.tolist()


# ---- the CUDA dispatch of the formats, through the Triton interpreter ------------------------------------------

MODEL_CHILD = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, "tests")
    from helpers_ckpt import fp8_checkpoint, fp8_config
    from kdtree_engine import reference
    from kdtree_engine.config import preset
    from kdtree_engine.engine import target_from_weights
    seed, fmt = int(sys.argv[1]), sys.argv[2]
    cfg = preset("k2-tiny").replace(num_hidden_layers=2)
    w = reference.random_weights(cfg, seed)
    if fmt == "fp8":
        tensors, _ = fp8_checkpoint(cfg, w, (32, 32))
        cfg = fp8_config(cfg, (32, 32))
    else:
        tensors = {k: torch.from_numpy(v) for k, v in w.items()}
    model = target_from_weights(cfg, tensors, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=g)
    first = model(ids, model.new_cache(32)).logits
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = torch.randint(0, cfg.vocab_size, (4,), generator=g)
    cache = model.new_cache(32)   # the device-resident step: the whole buffer, the length on the device
    model(ids, cache)
    model.rope.ensure(32)
    st = model(tree, cache, 5 + mask.sum(1) - 1, mask, start=torch.tensor(5)).logits
    print(json.dumps({"first": first.tolist(), "static": st.tolist()}))
''')


def run_child(seed: int, fmt: str, triton: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "KDTREE_INT4_BACKEND", "KDTREE_DENSE_BACKEND", "KDTREE_ATTN_BACKEND")}
    if triton:   # the quantized kernels' (W8A16, FP8 MoE) and the dense family's (grouped BF16 MoE) Triton paths
        env.update(TRITON_INTERPRET="1", KDTREE_INT4_BACKEND="triton", KDTREE_DENSE_BACKEND="triton")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", MODEL_CHILD, str(seed), fmt], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", ["fp8", "bf16-experts"])
def test_triton_dispatch_of_the_formats_matches_torch(fmt) -> None:
    """FP8 linears through W8A16 and FP8 / dense experts through the grouped MoE, in the model (eager prefill and
    the device-resident tree step), against the torch paths."""
    seed = new_seed()
    a, b = run_child(seed, fmt, False), run_child(seed, fmt, True)
    for key in ("first", "static"):
        x, y = torch.tensor(a[key]), torch.tensor(b[key])
        assert torch.isfinite(y).all() and rel(y, x) < 1e-4, (key, seed)
