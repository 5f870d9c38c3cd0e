"""From the training model to checkpoints the engine and HF transformers load.

* :func:`canonical_state` - canonical names (``layers.1.mlp.experts.3.up_proj.weight``...), float32,
  routed experts split per expert from the stacked [E, 2I, H] (gate rows first) / [E, H, I].
* :func:`dense_tensors` - the dense export: everything bf16 except the router (``mlp.gate.weight``
  and ``e_score_correction_bias``, float32 as HF keeps them).
* :func:`int4_tensors` - routed experts as compressed-tensors pack-quantized INT4 (symmetric, group
  32: ``weight_packed`` int32 [N, K/8], ``weight_scale`` bf16 [N, K/32], ``weight_shape`` int32 [2]),
  the rest as in the dense export. The config carries ``k2_quantization_config(32)``.
* :func:`served_state` - what a loader of a given export computes with (bf16-rounded weights,
  dequantized INT4 experts), as a float32 state dict for :class:`TrainModel`: used to evaluate the
  shipped model and as the frozen target of drafter training.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import torch

from ..config import ModelConfig
from ..quant import dequantize, k2_quantization_config, quantize
from ..weights import save_checkpoint
from .target_train import TrainModel

GROUP_SIZE = 32
_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w13|w2)$")
_FP32 = re.compile(r"^layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias)$")


def canonical_state(model: TrainModel) -> dict[str, torch.Tensor]:
    """Canonical name -> float32 CPU tensor (experts per expert)."""
    cfg = model.cfg
    I = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        m = _STACKED.match(name)
        if m:
            base = f"layers.{m.group(1)}.mlp.experts"
            for e in range(t.shape[0]):
                if m.group(2) == "w13":
                    out[f"{base}.{e}.gate_proj.weight"] = t[e, :I].clone()
                    out[f"{base}.{e}.up_proj.weight"] = t[e, I:].clone()
                else:
                    out[f"{base}.{e}.down_proj.weight"] = t[e].clone()
            continue
        out[name] = t.clone()
    return out


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def dense_tensors(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {n: (t.float() if _FP32.match(n) else t.to(dtype)).contiguous() for n, t in state.items()}


def int4_tensors(state: Mapping[str, torch.Tensor], group_size: int = GROUP_SIZE,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        if _is_expert(n):
            module = n[: -len(".weight")]
            packed, scale = quantize(t.float(), group_size, dtype=dtype)
            out[module + ".weight_packed"] = packed
            out[module + ".weight_scale"] = scale
            out[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            out[n] = t.float().contiguous() if _FP32.match(n) else t.to(dtype).contiguous()
    return out


def int4_config(cfg: ModelConfig, group_size: int = GROUP_SIZE) -> ModelConfig:
    return cfg.replace(quantization=k2_quantization_config(group_size))


def served_state(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, group_size: int = GROUP_SIZE
                 ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> TrainModel state dict (float32; INT4 experts dequantized, restacked)."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    dense: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        if n.endswith(".weight_shape"):
            continue
        if n.endswith(".weight_packed"):
            module = n[: -len(".weight_packed")]
            dense[module + ".weight"] = dequantize(t, tensors[module + ".weight_scale"], group_size, torch.float32)
        elif n.endswith(".weight_scale"):
            continue
        else:
            dense[n] = t.float()
    out: dict[str, torch.Tensor] = {}
    for n, t in dense.items():
        if not _is_expert(n):
            out[n] = t
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        base = f"layers.{i}.mlp.experts"
        out[f"{base}.w13"] = torch.stack([torch.cat([dense[f"{base}.{e}.gate_proj.weight"],
                                                     dense[f"{base}.{e}.up_proj.weight"]]) for e in range(E)])
        out[f"{base}.w2"] = torch.stack([dense[f"{base}.{e}.down_proj.weight"] for e in range(E)])
        assert out[f"{base}.w13"].shape[1] == 2 * I
    return out


def load_served(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], device: torch.device,
                expert_impl: str = "loop") -> TrainModel:
    model = TrainModel(cfg)
    model.load_state_dict(served_state(tensors, cfg), strict=True)
    model.set_expert_impl(expert_impl)
    return model.to(device).eval()


def save_target(directory: str | Path, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], tokenizer=None) -> int:
    """Writes config.json + model.safetensors (+ tokenizer.json); returns the bytes written."""
    directory = Path(directory)
    save_checkpoint(directory, cfg, tensors, check=True)
    if tokenizer is not None:
        tokenizer.save(str(directory / "tokenizer.json"))
    return dir_bytes(directory)


def dir_bytes(directory: str | Path, names: tuple[str, ...] = ("config.json", "model.safetensors", "tokenizer.json")
              ) -> int:
    d = Path(directory)
    return sum((d / n).stat().st_size for n in names if (d / n).exists())
