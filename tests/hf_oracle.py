"""Builds transformers' DeepseekV3ForCausalLM from a ModelConfig and canonical-name weights."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from kdtree_engine.config import ModelConfig


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV3Config

    d = cfg.to_dict()
    for k in ("architectures", "model_type", "quantization_config", "eos_token_id"):
        d.pop(k, None)
    rope = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    params = {"rope_type": "default", "rope_theta": theta} if rope is None else {
        "rope_type": "yarn", "rope_theta": theta, "factor": rope["factor"],
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
        "beta_fast": rope["beta_fast"], "beta_slow": rope["beta_slow"],
        "mscale": rope["mscale"], "mscale_all_dim": rope["mscale_all_dim"]}
    hc = DeepseekV3Config(**d, rope_parameters=params, rope_interleave=True, eos_token_id=list(cfg.eos_token_ids))
    hc._attn_implementation = "eager"
    return hc


def hf_model(cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float32):
    """HF model holding the same weights (routed experts fused the way transformers 5 stores them)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(hf_config(cfg)).to(dtype).eval()
    sd = model.state_dict()
    new: dict[str, torch.Tensor] = {}
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for name, ref in sd.items():
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
            layer = name.split(".")[2]
            base = f"layers.{layer}.mlp.experts"
            if name.endswith("gate_up_proj"):
                t = np.stack([np.concatenate([weights[f"{base}.{e}.gate_proj.weight"],
                                              weights[f"{base}.{e}.up_proj.weight"]], 0) for e in range(E)])
            else:
                t = np.stack([weights[f"{base}.{e}.down_proj.weight"] for e in range(E)])
        else:
            key = name[len("model."):] if name.startswith("model.") else name
            t = weights[key]
        tt = torch.from_numpy(np.ascontiguousarray(t))
        assert tuple(tt.shape) == tuple(ref.shape), (name, tt.shape, ref.shape)
        new[name] = tt.to(ref.dtype)
    model.load_state_dict(new, strict=True)
    return model
