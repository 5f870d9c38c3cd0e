"""INT4 from BF16 and FP8 checkpoints: ``--quantize w4a16`` at load (FP8 dequantized, then the round-to-nearest
group quantizer) against the numpy reference, and ``kdtree quantize`` (a compressed-tensors INT4 checkpoint)
loaded by the engine and by transformers with compressed-tensors: the same experts (bit for bit after
compressed-tensors' bf16 rounding) and, on the same weights, the same logits; bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers_ckpt import fp8_checkpoint, fp8_config, new_seed, rel
from kdtree_engine import reference
from kdtree_engine.cli import main
from kdtree_engine.config import preset
from kdtree_engine.engine import load_target, target_from_weights
from kdtree_engine.model.moe import MoE
from kdtree_engine.quant import dequantize
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import load_checkpoint, save_checkpoint

CFG = preset("k2-tiny")
CPU = torch.device("cpu")


def expert_int4(dense: dict[str, np.ndarray], group: int) -> dict[str, np.ndarray]:
    """The numpy reference's weights with the routed experts quantized by its own quantizer."""
    out: dict[str, np.ndarray] = {}
    for k, v in dense.items():
        if ".mlp.experts." in k:
            packed, scale = reference.quantize_w4a16(v, group)
            out[k.replace(".weight", ".weight_packed")] = packed
            out[k.replace(".weight", ".weight_scale")] = scale
        else:
            out[k] = v
    return out


def write_fp8(tmp_path, seed: int):
    tensors, dense = fp8_checkpoint(CFG, reference.random_weights(CFG, seed), (32, 32))
    save_checkpoint(tmp_path / "fp8", fp8_config(CFG, (32, 32)), tensors)
    return tmp_path / "fp8", dense


def test_quantize_at_load_from_fp8_equals_reference(tmp_path) -> None:
    seed = new_seed()
    path, dense = write_fp8(tmp_path, seed)
    model = load_target(path, device=CPU, dtype=torch.float32, quantize="w4a16", progress=False)
    moe = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    assert moe and all(m.experts.group_size == 32 and m.experts.fp8_block is None for m in moe)
    assert all(not l.self_attn.o_proj.quantized for l in model.layers)   # the rest dequantized, dense
    prompt = [7, 3, 9, 12, 40]
    got = generate(model, prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    assert got == reference.greedy(CFG, expert_int4(dense, 32), prompt, 24), f"seed={seed}"


def hf_int4(path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    # compressed-tensors leaves the decompressed experts in the scale's dtype (bf16): the model in float32 runs
    # every product in float32, as the engine on the CPU does
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in hf.parameters():   # (transformers refuses .float() on a quantized model)
        p.data = p.data.float()
    return hf


def engine_experts(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's routed experts of a layer, dequantized: w13 [E, 2I, H] (gate rows, then up) and w2."""
    ex = model.layers[layer].mlp.experts
    g = ex.group_size
    w13 = torch.stack([dequantize(ex.w13_packed[e], ex.w13_scale[e], g, torch.float32) for e in range(ex.num_experts)])
    w2 = torch.stack([dequantize(ex.w2_packed[e], ex.w2_scale[e], g, torch.float32) for e in range(ex.num_experts)])
    return w13, w2


@pytest.mark.parametrize("source", ["bf16", "fp8"])
def test_quantize_command_engine_and_transformers_agree(tmp_path, source, capsys) -> None:
    seed = new_seed()
    if source == "fp8":
        src, _ = write_fp8(tmp_path, seed)
    else:
        src = tmp_path / "bf16"
        save_checkpoint(src, CFG, {k: torch.from_numpy(v).to(torch.bfloat16)
                                   for k, v in reference.random_weights(CFG, seed).items()})
    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(src), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    model = load_target(out, device=CPU, dtype=torch.float32, progress=False)
    assert all(m.mlp.experts.group_size == 32 for m in model.layers if isinstance(m.mlp, MoE))
    hf = hf_int4(out)
    # compressed-tensors decompresses q * scale in the scale's dtype (bf16): the engine's exact products,
    # rounded to bf16, bit for bit
    for i in range(CFG.first_k_dense_replace, CFG.num_hidden_layers):
        w13, w2 = engine_experts(model, i)
        hf_ex = hf.model.layers[i].mlp.experts
        assert torch.equal(hf_ex.gate_up_proj, w13.to(torch.bfloat16).float()), f"layer {i} seed={seed}"
        assert torch.equal(hf_ex.down_proj, w2.to(torch.bfloat16).float()), f"layer {i} seed={seed}"
    # the rest of the checkpoint: the engine on the same weights as transformers (the checkpoint's, with the experts
    # as transformers decompressed them) gives its logits
    same = {k: v for k, v in load_checkpoint(out, model.cfg).items() if ".mlp.experts." not in k}
    for i in range(CFG.first_k_dense_replace, CFG.num_hidden_layers):
        hf_ex = hf.model.layers[i].mlp.experts
        for e in range(CFG.n_routed_experts):
            p = f"layers.{i}.mlp.experts.{e}."
            I = CFG.moe_intermediate_size
            same[p + "gate_proj.weight"] = hf_ex.gate_up_proj[e, :I]
            same[p + "up_proj.weight"] = hf_ex.gate_up_proj[e, I:]
            same[p + "down_proj.weight"] = hf_ex.down_proj[e]
    engine = target_from_weights(CFG, same, device="cpu", dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, CFG.vocab_size, 10))
    got = engine(ids, engine.new_cache(16)).logits
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    assert rel(got, want) < 1e-4, f"seed={seed}"


def test_quantize_command_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert main(["quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kdtree: error:") and "nope" in err and "\n" not in err
    src, _ = write_fp8(tmp_path, 1)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main(["quantize", "--model", str(src), "--out", str(busy)]) == 2
    assert "--out" in capsys.readouterr().err
    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(src), "--out", str(out)]) == 0
    assert main(["quantize", "--model", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "already INT4" in capsys.readouterr().err


@pytest.mark.parametrize("quantize", ["none", "w4a16"])
def test_generate_on_an_fp8_checkpoint(tmp_path, capsys, quantize) -> None:
    """The command line on an FP8 checkpoint, as shipped and quantized at load: the numpy reference's tokens."""
    seed = new_seed()
    path, dense = write_fp8(tmp_path, seed)
    prompt = [5, 9, 14, 2]
    rc = main(["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12",
               "--ignore-eos", "--device", "cpu", "--quantize", quantize, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    weights = dense if quantize == "none" else expert_int4(dense, 32)
    assert out["token_ids"] == reference.greedy(CFG, weights, prompt, 12), f"seed={seed}"
