"""ModelConfig: the three config layouts, both rope keys, HF defaults, errors that name the field."""

from __future__ import annotations

import json
import math

import pytest

from kdtree_engine.config import ConfigError, ModelConfig, preset

K2_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "eos_token_id": 163586, "bos_token_id": 163584,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "hidden_act": "silu", "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
}


def write(tmp_path, d) -> str:
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


def test_k2_config_reads_every_field(tmp_path) -> None:
    cfg = ModelConfig.from_pretrained(write(tmp_path, K2_TEXT))
    assert cfg == preset("k2")
    assert cfg.kv_cache_dim == 576
    # research k2_int4.md 2.4: factor 64 -> scale 0.144680
    assert math.isclose(cfg.softmax_scale, 0.144680, rel_tol=1e-5)


def test_k25_wrapper_with_text_config_and_quantization(tmp_path) -> None:
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": K2_TEXT, "vision_config": {"hidden_size": 1152}, "quantization_config": quant}
    cfg = ModelConfig.from_pretrained(write(tmp_path, wrapped))
    assert cfg == preset("k2")
    assert cfg.quantization == quant


def test_rope_parameters_key(tmp_path) -> None:
    d = dict(K2_TEXT)
    scaling = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    d["rope_parameters"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn", "rope_theta": theta}
    assert ModelConfig.from_pretrained(write(tmp_path, d)) == preset("k2")


def test_rope_type_key_and_no_scaling() -> None:
    d = dict(K2_TEXT, rope_scaling={**K2_TEXT["rope_scaling"], "rope_type": "yarn"})
    del d["rope_scaling"]["type"]
    assert ModelConfig.from_dict(d).rope_scaling == preset("k2").rope_scaling
    assert ModelConfig.from_dict(dict(K2_TEXT, rope_scaling=None)).rope_scaling is None


def test_optional_fields_take_hf_defaults() -> None:
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config()
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v3", "vocab_size": 1000, "hidden_size": 64,
                                 "num_hidden_layers": 4, "num_attention_heads": 4})
    for name in ("intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                 "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                 "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                 "norm_topk_prob", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(cfg, name) == getattr(hf, name), name
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"])
def test_missing_required_field_is_named(field: str) -> None:
    d = dict(K2_TEXT)
    del d[field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("change,field", [
    ({"num_experts_per_tok": 400}, "num_experts_per_tok"),
    ({"n_group": 5}, "n_group"),
    ({"topk_group": 2}, "topk_group"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}, "rope_scaling.factor"),
    ({"model_type": "llama"}, "model_type"),
    ({"eos_token_id": 10 ** 7}, "eos_token_id"),
])
def test_inconsistent_field_is_named(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict({**K2_TEXT, **change})


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_round_trip_and_presets() -> None:
    for name in ("k2", "k2-tiny"):
        cfg = preset(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("k3")
