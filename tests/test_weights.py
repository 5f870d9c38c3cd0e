"""Checkpoint I/O: names, expected tensors, K2 / K2.5 layouts, strictness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers_ckpt import linear_shapes, quantized_config, random_checkpoint_tensors
from kdtree_engine import weights as W
from kdtree_engine.config import ModelConfig, preset
from kdtree_engine.quant import dequantize
from kdtree_engine.weights import (
    WeightsError, canonical_name, expected_tensors, iter_checkpoint, load_checkpoint, raw_name,
    save_checkpoint,
)

TINY = preset("k2-tiny")
VARIANTS: dict[str, ModelConfig] = {
    "tiny": TINY,
    "no_q_lora": TINY.replace(q_lora_rank=None),
    "all_moe_2_shared": TINY.replace(first_k_dense_replace=0, n_shared_experts=2),
    "no_shared_dense2": TINY.replace(first_k_dense_replace=2, n_shared_experts=0),
    "tied": TINY.replace(tie_word_embeddings=True),
}


def _cfg(variant: str, quantized: bool) -> ModelConfig:
    cfg = VARIANTS[variant]
    return quantized_config(cfg) if quantized else cfg


def _no_shape(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: v for n, v in t.items() if not n.endswith(".weight_shape")}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for n, v in want.items():
        assert got[n].dtype == v.dtype and torch.equal(got[n], v), n


# ---- names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["k2", "k25"])
@pytest.mark.parametrize("seed", [0])
def test_canonical_names_round_trip(layout: str, seed: int) -> None:
    for name in random_checkpoint_tensors(quantized_config(TINY), seed, quantized=True):
        raw = raw_name(name, layout)
        if name != "lm_head.weight":
            assert raw.startswith("model." if layout == "k2" else "language_model.model.")
        assert canonical_name(raw, TINY) == name


@pytest.mark.parametrize("raw,want", [
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    ("language_model.model.embed_tokens.weight", "embed_tokens.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("language_model.model.layers.3.mlp.experts.7.up_proj.weight_packed", "layers.3.mlp.experts.7.up_proj.weight_packed"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", "layers.1.mlp.gate.e_score_correction_bias"),
    ("model.layers.4.mlp.gate.weight", None),  # MTP layer (num_hidden_layers = 4)
    ("language_model.model.layers.4.enorm.weight", None),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ("vision_tower.encoder.blocks.0.wqkv.weight", None),
    ("mm_projector.proj.0.weight", None),
])
def test_canonical_name(raw: str, want: str | None) -> None:
    assert canonical_name(raw, TINY) == want


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("quantized", [False, True])
def test_expected_tensors_match_independent_enumeration(variant: str, quantized: bool) -> None:
    cfg = _cfg(variant, quantized)
    specs = expected_tensors(cfg)
    tensors = random_checkpoint_tensors(cfg, 0, quantized=quantized)
    required = {n for n, s in specs.items() if not s.optional}
    assert required <= set(tensors) <= set(specs)
    for n, t in tensors.items():
        assert tuple(t.shape) == specs[n].shape and t.dtype in specs[n].dtypes, n
    n_lin = len(linear_shapes(cfg))
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    n_int4 = 3 * n_moe * cfg.n_routed_experts if quantized else 0
    assert sum(n.endswith(".weight_packed") for n in specs) == n_int4
    assert sum(n.endswith(".weight") and n[:-7] in linear_shapes(cfg) for n in specs) == n_lin - n_int4
    if quantized:
        assert all(".experts." in n for n in specs if n.endswith(".weight_packed"))


def test_group_size_must_divide_k() -> None:
    with pytest.raises(WeightsError, match="down_proj.*group_size 64"):
        expected_tensors(quantized_config(TINY, 64))  # moe_intermediate_size 32


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,seed", [(v, i) for i, v in enumerate(sorted(VARIANTS))])
@pytest.mark.parametrize("quantized", [False, True])
def test_k2_single_and_k25_sharded_yield_the_same(tmp_path: Path, seed: int, variant: str, quantized: bool) -> None:
    cfg = _cfg(variant, quantized)
    tensors = random_checkpoint_tensors(cfg, seed, quantized=quantized)
    save_checkpoint(tmp_path / "k2", cfg, tensors, layout="k2")
    vision = {"vision_tower.patch_embed.proj.weight": torch.randn(4, 3), "mm_projector.proj.weight": torch.randn(2, 2)}
    save_checkpoint(tmp_path / "k25", cfg, tensors, layout="k25", shard_bytes=20_000, extra=vision)
    assert (tmp_path / "k2" / "model.safetensors").is_file()
    shards = sorted((tmp_path / "k25").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "k25" / "model.safetensors.index.json").is_file()

    a = load_checkpoint(tmp_path / "k2", ModelConfig.from_pretrained(tmp_path / "k2"))
    cfg25 = ModelConfig.from_pretrained(tmp_path / "k25")
    b = dict(iter_checkpoint(tmp_path / "k25", cfg25, progress=False))
    assert cfg25 == cfg and cfg25.quantization == cfg.quantization
    _assert_same(a, _no_shape(tensors))
    _assert_same(b, _no_shape(tensors))


def test_k25_config_layout(tmp_path: Path) -> None:
    cfg = quantized_config(TINY)
    save_checkpoint(tmp_path, cfg, random_checkpoint_tensors(cfg, 0, quantized=True), layout="k25")
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "kimi_k25" and d["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert d["text_config"]["model_type"] == "kimi_k2"
    assert d["quantization_config"] == cfg.quantization and "quantization_config" not in d["text_config"]


def test_int4_tensors_decode(tmp_path: Path) -> None:
    cfg = quantized_config(TINY)
    tensors = random_checkpoint_tensors(cfg, 3, quantized=True)
    save_checkpoint(tmp_path, cfg, tensors)
    got = load_checkpoint(tmp_path, cfg)
    name = "layers.2.mlp.experts.5.down_proj"
    w = dequantize(got[name + ".weight_packed"], got[name + ".weight_scale"], 32)
    assert w.shape == tuple(tensors[name + ".weight_shape"].tolist())


def test_skips_mtp_and_rotary(tmp_path: Path) -> None:
    tensors = random_checkpoint_tensors(TINY, 0)
    extra = {"model.layers.4.mlp.gate.weight": torch.zeros(3), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}
    save_checkpoint(tmp_path, TINY, tensors, extra=extra)
    _assert_same(load_checkpoint(tmp_path, TINY), tensors)


def test_tied_lm_head_may_be_present(tmp_path: Path) -> None:
    cfg = VARIANTS["tied"]
    tensors = random_checkpoint_tensors(cfg, 0)
    tensors["lm_head.weight"] = tensors["embed_tokens.weight"].clone()
    save_checkpoint(tmp_path, cfg, tensors)
    _assert_same(load_checkpoint(tmp_path, cfg), tensors)


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_checkpoint(tmp_path, TINY, random_checkpoint_tensors(TINY, 0))
    for _ in iter_checkpoint(tmp_path, TINY, progress=True):
        pass
    out, err = capsys.readouterr()
    assert out == "" and "loading weights" in err
    for _ in iter_checkpoint(tmp_path, TINY, progress=False):
        pass
    assert capsys.readouterr().err == ""


def test_save_check_and_stale_files(tmp_path: Path) -> None:
    tensors = random_checkpoint_tensors(TINY, 0)
    save_checkpoint(tmp_path, TINY, tensors, shard_bytes=10_000, check=True)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    save_checkpoint(tmp_path, TINY, tensors)  # single file replaces the shards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    bad = dict(tensors, **{"norm.weight": torch.zeros(3)})
    with pytest.raises(WeightsError, match="norm.weight"):
        save_checkpoint(tmp_path / "x", TINY, bad, check=True)


def test_save_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing(tensors: dict, path: str, metadata: dict | None = None) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        Path(path).write_bytes(b"partial")

    monkeypatch.setattr(W, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, TINY, random_checkpoint_tensors(TINY, 0), shard_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


# ---- strictness --------------------------------------------------------------------------------

Mutation = Callable[[dict[str, torch.Tensor]], None]
EXP = "layers.2.mlp.experts.3"


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[name] = value(t[name])
    return f


def _rename(old: str, new: str) -> Mutation:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[new] = t.pop(old)
    return f


STRICT_CASES: dict[str, tuple[Mutation, list[str]]] = {
    "missing_tensor": (lambda t: t.pop("layers.1.self_attn.kv_a_layernorm.weight"),
                       ["missing", "model.layers.1.self_attn.kv_a_layernorm.weight"]),
    "missing_several": (lambda t: [t.pop(n) for n in list(t) if n.startswith("layers.3.")],
                        ["missing", "model.layers.3.input_layernorm.weight"]),
    "unexpected_tensor": (lambda t: t.__setitem__("layers.0.mlp.extra.weight", torch.zeros(2)),
                          ["unexpected", "model.layers.0.mlp.extra.weight"]),
    "wrong_shape": (_set("layers.0.self_attn.kv_a_proj_with_mqa.weight", lambda w: w.t().contiguous()),
                    ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "[64, 48]", "[48, 64]"]),
    "wrong_shape_embed": (_set("embed_tokens.weight", lambda w: w[:-1]),
                          ["model.embed_tokens.weight", "[255, 64]", "[256, 64]"]),
    "float8": (_set("layers.0.self_attn.kv_b_proj.weight", lambda w: w.to(torch.float8_e4m3fn)),
               ["model.layers.0.self_attn.kv_b_proj.weight", "float8_e4m3fn", "bfloat16"]),
    "int8_dense": (_set("layers.1.mlp.shared_experts.up_proj.weight", lambda w: w.to(torch.int8)),
                   ["model.layers.1.mlp.shared_experts.up_proj.weight", "int8"]),
    "int4_missing_scale": (lambda t: t.pop(f"{EXP}.up_proj.weight_scale"),
                           ["missing", f"model.{EXP}.up_proj.weight_scale"]),
    "int4_scale_shape": (_set(f"{EXP}.gate_proj.weight_scale", lambda s: s[:, :1].contiguous()),
                         [f"model.{EXP}.gate_proj.weight_scale", "[32, 1]", "[32, 2]"]),
    "int4_packed_dtype": (_set(f"{EXP}.down_proj.weight_packed", lambda p: p.to(torch.int64)),
                          [f"model.{EXP}.down_proj.weight_packed", "int64", "int32"]),
    "int4_packed_shape": (_set(f"{EXP}.down_proj.weight_packed", lambda p: p.view(torch.uint8)),
                          [f"model.{EXP}.down_proj.weight_packed", "[64, 16]"]),
    "int4_weight_shape_value": (_set(f"{EXP}.down_proj.weight_shape", lambda s: s.flip(0).contiguous()),
                                [f"model.{EXP}.down_proj.weight_shape", "[32, 64]", "[64, 32]"]),
    "int4_dense_instead": (_rename(f"{EXP}.up_proj.weight_packed", f"{EXP}.up_proj.weight"),
                           [f"model.{EXP}.up_proj.weight", "INT4"]),
    "int4_where_dense": (_rename("layers.1.mlp.shared_experts.up_proj.weight",
                                 "layers.1.mlp.shared_experts.up_proj.weight_packed"),
                         ["model.layers.1.mlp.shared_experts.up_proj.weight_packed", "dense"]),
}


@pytest.mark.parametrize("case", sorted(STRICT_CASES))
def test_strict_failures(tmp_path: Path, case: str) -> None:
    mutate, needles = STRICT_CASES[case]
    cfg = quantized_config(TINY)
    tensors = random_checkpoint_tensors(cfg, 7, quantized=True)
    mutate(tensors)
    save_checkpoint(tmp_path, cfg, tensors, shard_bytes=30_000)
    it = iter_checkpoint(tmp_path, cfg, progress=False)
    with pytest.raises(WeightsError) as e:
        next(it)  # the header pass fails before the first tensor is read
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_duplicate_tensor(tmp_path: Path) -> None:
    tensors = random_checkpoint_tensors(TINY, 0)
    extra = {"language_model.model.norm.weight": tensors["norm.weight"]}
    save_checkpoint(tmp_path, TINY, tensors, extra=extra)
    with pytest.raises(WeightsError, match="duplicates") as e:
        load_checkpoint(tmp_path, TINY)
    assert "'language_model.model.norm.weight'" in str(e.value) and "'model.norm.weight'" in str(e.value)


def test_missing_names_use_the_files_layout(tmp_path: Path) -> None:
    tensors = random_checkpoint_tensors(TINY, 0)
    del tensors["lm_head.weight"]
    save_checkpoint(tmp_path, TINY, tensors, layout="k25")
    with pytest.raises(WeightsError, match=r"missing: language_model\.lm_head\.weight"):
        load_checkpoint(tmp_path, TINY)


def _sharded(tmp_path: Path) -> list[Path]:
    save_checkpoint(tmp_path, TINY, random_checkpoint_tensors(TINY, 0), shard_bytes=20_000)
    return sorted(tmp_path.glob("model-*.safetensors"))


def test_missing_shard_file(tmp_path: Path) -> None:
    shard = _sharded(tmp_path)[1]
    shard.unlink()
    with pytest.raises(WeightsError, match=shard.name):
        load_checkpoint(tmp_path, TINY)


@pytest.mark.parametrize("damage", ["header", "truncate"])
@pytest.mark.parametrize("sharded", [False, True])
def test_corrupt_file(tmp_path: Path, damage: str, sharded: bool) -> None:
    if sharded:
        target = _sharded(tmp_path)[-1]
    else:
        save_checkpoint(tmp_path, TINY, random_checkpoint_tensors(TINY, 0))
        target = tmp_path / "model.safetensors"
    data = target.read_bytes()
    target.write_bytes(b"\xff" * 16 + data[16:] if damage == "header" else data[:-100])
    with pytest.raises(WeightsError, match=target.name):
        load_checkpoint(tmp_path, TINY)


def test_index_problems(tmp_path: Path) -> None:
    _sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    dropped = next(iter(good["weight_map"]))
    bad = {"weight_map": {k: v for k, v in good["weight_map"].items() if k != dropped}}
    index.write_text(json.dumps(bad))
    with pytest.raises(WeightsError, match=dropped.replace(".", r"\.")):
        load_checkpoint(tmp_path, TINY)
    index.write_text("{not json")
    with pytest.raises(WeightsError, match="index.json"):
        load_checkpoint(tmp_path, TINY)


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere", TINY)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_checkpoint(tmp_path, TINY)
