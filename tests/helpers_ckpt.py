"""Random tiny checkpoints for tests.

Tensor names are enumerated here independently of ``kdtree_engine.weights`` (from the HF layout
described in the research notes), so comparing the two checks both. INT4 linears are packed by
compressed-tensors itself, an independent implementation of the bit layout; FP8 block linears by the numpy
code at the end (``fp8_checkpoint``).
"""

from __future__ import annotations

import numpy as np
import torch

from kdtree_engine.config import ModelConfig
from kdtree_engine.quant import k2_quantization_config, parse_quantization_config


def quantized_config(cfg: ModelConfig, group_size: int = 32) -> ModelConfig:
    """``cfg`` with the K2-Thinking quantization_config (routed experts INT4)."""
    return cfg.replace(quantization=k2_quantization_config(group_size))


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Canonical linear module name -> (out N, in K)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out: dict[str, tuple[int, int]] = {"lm_head": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        a = f"layers.{i}.self_attn"
        if cfg.q_lora_rank:
            out[f"{a}.q_a_proj"] = (cfg.q_lora_rank, h)
            out[f"{a}.q_b_proj"] = (nh * qk, cfg.q_lora_rank)
        else:
            out[f"{a}.q_proj"] = (nh * qk, h)
        out[f"{a}.kv_a_proj_with_mqa"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        out[f"{a}.kv_b_proj"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[f"{a}.o_proj"] = (h, nh * cfg.v_head_dim)
        mlps: list[tuple[str, int]] = []
        if i < cfg.first_k_dense_replace:
            mlps.append((f"layers.{i}.mlp", cfg.intermediate_size))
        else:
            if cfg.n_shared_experts:
                mlps.append((f"layers.{i}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts))
            mlps += [(f"layers.{i}.mlp.experts.{e}", cfg.moe_intermediate_size) for e in range(cfg.n_routed_experts)]
        for m, width in mlps:
            out[f"{m}.gate_proj"] = (width, h)
            out[f"{m}.up_proj"] = (width, h)
            out[f"{m}.down_proj"] = (h, width)
    return out


def random_checkpoint_tensors(cfg: ModelConfig, seed: int, quantized: bool = False,
                              dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Canonical name -> random tensor. Linears in ``dtype``, norms and router bias in float32.

    With ``quantized``, the linears that cfg's quantization_config marks INT4 get
    ``weight_packed`` / ``weight_scale`` (``dtype``) / ``weight_shape`` (int32).
    """
    g = torch.Generator().manual_seed(seed)
    scheme = parse_quantization_config(cfg.quantization) if quantized else None
    if quantized and scheme is None:
        raise ValueError("quantized=True needs a cfg with a quantization_config (see quantized_config)")
    h = cfg.hidden_size

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t: dict[str, torch.Tensor] = {
        "embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g).to(dtype),
        "norm.weight": norm(h),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        if cfg.q_lora_rank:
            t[p + "self_attn.q_a_layernorm.weight"] = norm(cfg.q_lora_rank)
        t[p + "self_attn.kv_a_layernorm.weight"] = norm(cfg.kv_lora_rank)
        if i >= cfg.first_k_dense_replace:
            t[p + "mlp.gate.weight"] = (torch.randn(cfg.n_routed_experts, h, generator=g) / h ** 0.5).to(dtype)
            t[p + "mlp.gate.e_score_correction_bias"] = 0.01 * torch.randn(cfg.n_routed_experts, generator=g)
    for name, (n, k) in linear_shapes(cfg).items():
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue
        if scheme is not None and scheme.is_quantized(name):
            gs = scheme.group_size
            # compressed-tensors packs (the independent packer); imported here: the GPU image lacks it, and the GPU
            # tests that import this file never build an INT4 checkpoint
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)  # [N, K]
            t[name + ".weight_packed"] = pack_to_int32(q, 4)  # [N, K/8]
            t[name + ".weight_scale"] = (0.01 + 0.02 * torch.rand(n, k // gs, generator=g)).to(dtype)  # [N, K/g]
            t[name + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        else:
            t[name + ".weight"] = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    return t


# ---- FP8 block format ----------------------------------------------------------------------------
# Written from the published layout (weight float8_e4m3fn [N, K], weight_scale_inv float32
# [ceil(N/bn), ceil(K/bk)], w = weight * scale_inv[n // bn, k // bk]), independently of kdtree_engine.fp8:
# numpy block arithmetic, torch only for the e4m3 rounding of the cast.

def fp8_config(cfg: ModelConfig, block: tuple[int, int] = (128, 128), ignored: tuple[str, ...] = ()) -> ModelConfig:
    """``cfg`` with the DeepSeek-V3 / Kimi-K2-Instruct fp8 quantization_config (plus an ignore list)."""
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if ignored:
        q["ignored_layers"] = list(ignored)
    return cfg.replace(quantization=q)


def fp8_quantize_np(w: np.ndarray, bn: int, bk: int) -> tuple[torch.Tensor, np.ndarray]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]): absmax / 448 per block."""
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    scale = np.ones((sn, sk), dtype=np.float32)
    for i in range(sn):
        for j in range(sk):
            amax = float(np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max())
            if amax > 0:
                scale[i, j] = np.float32(amax / 448.0)
    q = w / fp8_scale_grid_np(scale, n, k, bn, bk)
    return torch.from_numpy(np.clip(q, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn), scale


def fp8_scale_grid_np(scale: np.ndarray, n: int, k: int, bn: int, bk: int) -> np.ndarray:
    """The [N, K] grid of scale[n // bn, k // bk]."""
    rows = np.arange(n) // bn
    cols = np.arange(k) // bk
    return scale[rows[:, None], cols[None, :]]


def fp8_dequantize_np(q: torch.Tensor, scale: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """float8_e4m3fn [N, K] and its block scales -> float32 [N, K]."""
    n, k = q.shape
    return (q.float().numpy() * fp8_scale_grid_np(np.asarray(scale, np.float32), n, k, bn, bk)).astype(np.float32)


def fp8_checkpoint(cfg: ModelConfig, weights: dict[str, np.ndarray], block: tuple[int, int] = (128, 128),
                   ignored: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Dense canonical-name weights -> (the FP8 checkpoint's tensors: every linear but lm_head and the
    ``ignored`` modules (canonical names) FP8 with its scale; the rest bf16 / float32 as given,
    the dequantized float32 weights the oracles run on)."""
    bn, bk = block
    fp8_linears = {m for m in linear_shapes(cfg) if m != "lm_head" and m not in ignored}
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in fp8_linears:
            q, s = fp8_quantize_np(np.asarray(w, np.float32), bn, bk)
            tensors[name] = q
            tensors[module + ".weight_scale_inv"] = torch.from_numpy(s)
            dense[name] = fp8_dequantize_np(q, s, bn, bk)
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
            dense[name] = np.asarray(w, np.float32)
    return tensors, dense


# ---- small test utilities ------------------------------------------------------------------------

def new_seed() -> int:
    """A fresh random seed, printed (pytest shows it with a failure)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    return seed


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())
