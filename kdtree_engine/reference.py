"""Numpy reference of the K2 target (DeepSeek-V3 architecture): the golden oracle.

Written as a specification, independently of the torch model: naive MLA (latent up-projected by
kv_b_proj, full causal softmax), YaRN rope on the rope dims only with interleaved pairs, sigmoid
router with group-limited top-k, one loop per expert. Every call recomputes the whole sequence at
positions 0..T-1. Imports numpy and the config dataclass only.

Notation: T tokens, H hidden, N heads, P qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim,
Lq q_lora_rank, Lkv kv_lora_rank, E routed experts, K experts per token, V vocabulary.

Weights are ``dict[str, np.ndarray]`` with the HF names minus the ``model.`` prefix
(``embed_tokens.weight``, ``layers.{i}.self_attn.q_a_proj.weight``, ..., ``lm_head.weight``).
A routed expert's linear is either ``<name>.weight`` or the W4A16 pair ``<name>.weight_packed``
(int32 [N, K/8]) + ``<name>.weight_scale`` ([N, K/g]); the pair is dequantized here.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from kdtree_engine.config import ModelConfig, yarn_mscale

Weights = Mapping[str, np.ndarray]

# ---- basic functions -------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * 1/sqrt(mean(x^2) + eps) * weight, over the last dim, in x's float dtype."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * inv) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)); weights are [out, in] like torch Linear."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


# ---- W4A16 (compressed-tensors pack-quantized, symmetric, group-wise) -----------------------

_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)  # [8] element j lives in bits [4j, 4j+3]


def quantize_w4a16(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest symmetric INT4 per group of ``group_size`` inputs.

    w [N, K] -> (packed int32 [N, K/8], scale float32 [N, K/g]); q in [-8, 7], stored as q + 8.
    scale = absmax / 7 so that +absmax is representable; -8 stays reachable for round-off.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % group_size or group_size % 8:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}, itself a multiple of 8")
    groups = w.reshape(n, k // group_size, group_size)  # [N, K/g, g]
    absmax = np.max(np.abs(groups), axis=-1)  # [N, K/g]
    scale = (absmax / 7.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(groups / safe[..., None]), -8, 7).astype(np.int64).reshape(n, k)  # [N, K]
    u = (q + 8).astype(np.uint32).reshape(n, k // 8, 8)  # [N, K/8, 8]
    packed = np.bitwise_or.reduce(u << _SHIFTS, axis=-1)  # [N, K/8] uint32
    return packed.view(np.int32), scale


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [N, K/8] -> int8 [N, K] with q = nibble - 8, LSB-first within each int32."""
    if packed.dtype != np.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")
    u = (packed.view(np.uint32)[..., None] >> _SHIFTS) & 0xF  # [N, K/8, 8]
    return (u.astype(np.int8) - 8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def dequantize_w4a16(packed: np.ndarray, scale: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """(packed int32 [N, K/8], scale [N, K/g]) -> float32 [N, K]; g inferred when not given."""
    q = unpack_int4(packed)  # [N, K]
    k = q.shape[-1]
    if group_size is None:
        group_size = k // scale.shape[-1]
    if scale.shape[-1] * group_size != k:
        raise ValueError(f"scale has {scale.shape[-1]} groups of {group_size} but the weight has K={k}")
    s = np.repeat(np.asarray(scale, dtype=np.float32), group_size, axis=-1)  # [N, K]
    return q.astype(np.float32) * s


def linear_weight(weights: Weights, name: str) -> np.ndarray:
    """Dense [out, in] weight of linear ``name`` (without suffix), dequantizing W4A16 if packed."""
    if name + ".weight" in weights:
        return weights[name + ".weight"]
    if name + ".weight_packed" in weights:
        if name + ".weight_scale" not in weights:
            raise KeyError(f"{name}.weight_packed has no {name}.weight_scale")
        return dequantize_w4a16(weights[name + ".weight_packed"], weights[name + ".weight_scale"])
    raise KeyError(f"missing weight {name}.weight (or {name}.weight_packed)")


# ---- YaRN rope ------------------------------------------------------------------------------


def yarn_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [R/2] of the rope dims, YaRN-corrected when cfg.rope_scaling is set.

    dim = R. corr(r) = dim * ln(orig_max / (2 pi r)) / (2 ln theta); lo = max(floor(corr(beta_fast)), 0),
    hi = min(ceil(corr(beta_slow)), dim - 1) (the clamp uses dim - 1, as DeepSeek and transformers do);
    ramp over pair index i in [0, dim/2): low i (fast rotations) keep theta^(-2i/dim), high i are
    divided by factor.
    """
    dim = cfg.qk_rope_head_dim
    theta = cfg.rope_theta
    base_inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [R/2]
    y = cfg.rope_scaling
    if y is None:
        return base_inv

    def corr(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(y.beta_fast)), 0)
    hi = min(math.ceil(corr(y.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)  # [R/2], 1 = interpolate
    return base_inv * (1.0 - ramp) + (base_inv / y.factor) * ramp


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, R/2] (float64), times the YaRN multiplier m(factor, mscale) / m(factor, mscale_all_dim)."""
    angles = positions.astype(np.float64)[:, None] * yarn_inv_freq(cfg)[None, :]  # [T, R/2]
    mult = 1.0
    y = cfg.rope_scaling
    if y is not None:
        mult = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return np.cos(angles) * mult, np.sin(angles) * mult


def apply_rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs (0,1), (2,3), ... of the last dim. x [T, ..., R], cos/sin [T, R/2]."""
    extra = (slice(None),) + (None,) * (x.ndim - 2) + (slice(None),)
    c, s = cos[extra].astype(x.dtype), sin[extra].astype(x.dtype)  # [T, 1.., R/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]  # [T, ..., R/2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x1 * c + x0 * s
    return out


# ---- blocks ---------------------------------------------------------------------------------


def mla(cfg: ModelConfig, w: Weights, prefix: str, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Naive multi-head latent attention over the whole causal sequence. x [T, H] -> [T, H]."""
    t = x.shape[0]
    n, p, r, dv, lkv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    if cfg.q_lora_rank is None:
        q = x @ w[prefix + "q_proj.weight"].T  # [T, N*(P+R)]
    else:
        cq = rms_norm(x @ w[prefix + "q_a_proj.weight"].T, w[prefix + "q_a_layernorm.weight"], eps)  # [T, Lq]
        q = cq @ w[prefix + "q_b_proj.weight"].T  # [T, N*(P+R)]
    q = q.reshape(t, n, p + r)  # [T, N, P+R]
    q_nope, q_pe = q[..., :p], q[..., p:]  # [T, N, P], [T, N, R]

    kva = x @ w[prefix + "kv_a_proj_with_mqa.weight"].T  # [T, Lkv+R]
    c_kv = rms_norm(kva[:, :lkv], w[prefix + "kv_a_layernorm.weight"], eps)  # [T, Lkv]
    k_pe = kva[:, lkv:]  # [T, R] one rope key shared by all heads

    q_pe = apply_rope_interleaved(q_pe, cos, sin)  # [T, N, R]
    k_pe = apply_rope_interleaved(k_pe, cos, sin)  # [T, R]

    kv = (c_kv @ w[prefix + "kv_b_proj.weight"].T).reshape(t, n, p + dv)  # [T, N, P+Dv]
    k_nope, v = kv[..., :p], kv[..., p:]  # [T, N, P], [T, N, Dv]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (t, n, r))], axis=-1)  # [T, N, P+R]
    qf = np.concatenate([q_nope, q_pe], axis=-1)  # [T, N, P+R]

    scores = np.einsum("thd,shd->hts", qf, k) * cfg.softmax_scale  # [N, T, T]
    causal = np.tril(np.ones((t, t), dtype=bool))  # [T(query), T(key)]
    scores = np.where(causal[None], scores, -np.inf)
    probs = softmax(scores, axis=-1)  # [N, T, T]
    o = np.einsum("hts,shd->thd", probs, v)  # [T, N, Dv]
    return o.reshape(t, n * dv) @ w[prefix + "o_proj.weight"].T  # [T, H]


def route(cfg: ModelConfig, w: Weights, prefix: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """noaux_tc sigmoid router. x [T, H] -> (expert ids [T, K], weights [T, K]).

    Computed in at least float32. The correction bias only chooses experts; weights come from the
    unbiased sigmoid. Group-limited: a group scores the sum of its top-2 biased scores, the best
    topk_group groups stay eligible. All ties go to the lower index (stable sorts).
    """
    ct = np.promote_types(x.dtype, np.float32)
    logits = x.astype(ct) @ w[prefix + "gate.weight"].astype(ct).T  # [T, E]
    scores = sigmoid(logits)  # [T, E]
    choice = scores + w[prefix + "gate.e_score_correction_bias"].astype(ct)  # [T, E]
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if cfg.n_group > 1:
        per = e // cfg.n_group
        grouped = choice.reshape(-1, cfg.n_group, per)  # [T, G, E/G]
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G] sum of top-2
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, : cfg.topk_group]  # [T, topk_group]
        group_mask = np.zeros(group_score.shape, dtype=bool)
        np.put_along_axis(group_mask, keep, True, axis=-1)
        choice = np.where(np.repeat(group_mask, per, axis=-1), choice, -np.inf)  # [T, E]
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]  # [T, K]
    wts = np.take_along_axis(scores, idx, axis=-1)  # [T, K]
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, wts * cfg.routed_scaling_factor


def moe(cfg: ModelConfig, w: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    """Routed experts (weighted) + shared expert (unweighted). x [T, H] -> [T, H]."""
    idx, wts = route(cfg, w, prefix, x)  # [T, K], [T, K]
    out = np.zeros_like(x)  # [T, H]
    for e in range(cfg.n_routed_experts):
        tok, slot = np.nonzero(idx == e)  # tokens routed to expert e
        if tok.size == 0:
            continue
        ep = f"{prefix}experts.{e}."
        y = swiglu(x[tok], w[ep + "gate_proj"], w[ep + "up_proj"], w[ep + "down_proj"])  # [t_e, H]
        np.add.at(out, tok, y * wts[tok, slot][:, None].astype(x.dtype))
    if cfg.n_shared_experts > 0:
        sp = prefix + "shared_experts."
        out = out + swiglu(x, w[sp + "gate_proj.weight"], w[sp + "up_proj.weight"], w[sp + "down_proj.weight"])
    return out


def dense_mlp(w: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    return swiglu(x, w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"], w[prefix + "down_proj.weight"])


# ---- model ----------------------------------------------------------------------------------


def prepare_weights(cfg: ModelConfig, weights: Weights, dtype: np.dtype = np.float64) -> dict[str, np.ndarray]:
    """Cast to ``dtype`` once and dequantize W4A16 experts; expert linears become keys without suffix
    (``layers.{i}.mlp.experts.{e}.gate_proj``). Idempotent: prepared dicts pass through."""
    if weights.get("__prepared__") is not None and weights["__prepared__"].dtype == np.dtype(dtype):
        return dict(weights)
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if ".experts." in name or name.startswith("__"):
            continue
        out[name] = np.asarray(value).astype(dtype)
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        for e in range(cfg.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"layers.{i}.mlp.experts.{e}.{proj}"
                out[name] = linear_weight(weights, name).astype(dtype)
    out["__prepared__"] = np.zeros(0, dtype=dtype)
    return out


def hidden_states(cfg: ModelConfig, weights: Weights, ids: np.ndarray, dtype: np.dtype = np.float64,
                  ) -> list[np.ndarray]:
    """Residual stream [T, H] after the embedding and after each layer (num_hidden_layers + 1 arrays,
    HF ``output_hidden_states`` order without the final norm)."""
    w = prepare_weights(cfg, weights, dtype)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    t = ids.shape[0]
    cos, sin = rope_cos_sin(cfg, np.arange(t))  # [T, R/2]
    h = w["embed_tokens.weight"][ids]  # [T, H]
    out = [h]
    eps = cfg.rms_norm_eps
    for i in range(cfg.num_hidden_layers):
        lp = f"layers.{i}."
        h = h + mla(cfg, w, lp + "self_attn.", rms_norm(h, w[lp + "input_layernorm.weight"], eps), cos, sin)
        x = rms_norm(h, w[lp + "post_attention_layernorm.weight"], eps)
        h = h + (moe(cfg, w, lp + "mlp.", x) if cfg.is_moe_layer(i) else dense_mlp(w, lp + "mlp.", x))
        out.append(h)
    return out


def logits_from_hidden(cfg: ModelConfig, w: Weights, h: np.ndarray) -> np.ndarray:
    """[T, H] -> [T, V] through the final norm and the (untied unless configured) lm_head."""
    head = w["embed_tokens.weight"] if cfg.tie_word_embeddings and "lm_head.weight" not in w else w["lm_head.weight"]
    return rms_norm(h, w["norm.weight"], cfg.rms_norm_eps) @ head.T


def forward(cfg: ModelConfig, weights: Weights, ids: np.ndarray, dtype: np.dtype = np.float64) -> np.ndarray:
    """Logits [T, V] for token ids [T] at positions 0..T-1 (full recompute)."""
    w = prepare_weights(cfg, weights, dtype)
    return logits_from_hidden(cfg, w, hidden_states(cfg, w, ids, dtype)[-1])


def greedy(cfg: ModelConfig, weights: Weights, prompt_ids: list[int] | np.ndarray, n_tokens: int,
           dtype: np.dtype = np.float64, stop_at_eos: bool = False) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (``n_tokens`` new ids; argmax ties go to the lower id)."""
    w = prepare_weights(cfg, weights, dtype)
    seq = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
    if not seq:
        raise ValueError("greedy needs a non-empty prompt")
    out: list[int] = []
    for _ in range(n_tokens):
        h = hidden_states(cfg, w, np.asarray(seq), dtype)[-1][-1:]  # [1, H]
        nxt = int(np.argmax(logits_from_hidden(cfg, w, h)[0]))
        out.append(nxt)
        seq.append(nxt)
        if stop_at_eos and nxt in cfg.eos_token_ids:
            break
    return out


# ---- random well-conditioned weights --------------------------------------------------------


def weight_names(cfg: ModelConfig) -> list[str]:
    """Canonical names of every dense tensor of the model (experts as ``.weight``)."""
    names = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        lp = f"layers.{i}."
        names += [lp + "input_layernorm.weight", lp + "post_attention_layernorm.weight"]
        a = lp + "self_attn."
        if cfg.q_lora_rank is None:
            names.append(a + "q_proj.weight")
        else:
            names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        names += [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                  a + "o_proj.weight"]
        m = lp + "mlp."
        if cfg.is_moe_layer(i):
            names += [m + "gate.weight", m + "gate.e_score_correction_bias"]
            names += [f"{m}shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
                      if cfg.n_shared_experts > 0]
            names += [f"{m}experts.{e}.{p}.weight" for e in range(cfg.n_routed_experts)
                      for p in ("gate_proj", "up_proj", "down_proj")]
        else:
            names += [f"{m}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def random_weights(cfg: ModelConfig, seed: int, *, quantize_experts_group: int | None = None,
                   ) -> dict[str, np.ndarray]:
    """A random model (float32) whose greedy decoding is well conditioned.

    Structure: token t embeds as a random unit-RMS vector e_t; lm_head row j is aligned with
    e_{perm^-1(j)} for a fixed random permutation, so the embedding alone predicts "next = perm(t)"
    with a large margin. Every layer adds an output of comparable size (attention mixes earlier tokens,
    MLPs/experts are random SwiGLUs), so the layers do move the argmax; margins stay wide because the
    logit scale is large next to the numerical noise of float32/bfloat16. Norm weights are near 1, the
    correction bias is nonzero, routers have a spread that makes expert choice input dependent.
    With ``quantize_experts_group`` the routed experts are stored W4A16 (packed + scale).
    """
    rng = np.random.default_rng(seed)
    hsz, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    p, r, dv, lkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) * (gain / math.sqrt(in_f))).astype(np.float32)

    def norm_w(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    w: dict[str, np.ndarray] = {}
    emb = rng.standard_normal((v, hsz))  # [V, H]
    emb /= np.sqrt(np.mean(emb * emb, axis=1, keepdims=True))  # unit RMS rows
    w["embed_tokens.weight"] = emb.astype(np.float32)
    perm = rng.permutation(v)  # next(t) = perm[t]
    head = np.empty((v, hsz))
    head[perm] = emb  # row perm[t] aligned with e_t
    head = RW_HEAD_GAIN * head / math.sqrt(hsz) + lin(v, hsz, RW_HEAD_NOISE)
    w["lm_head.weight"] = head.astype(np.float32)
    w["norm.weight"] = norm_w(hsz)

    qk = p + r
    for i in range(cfg.num_hidden_layers):
        lp = f"layers.{i}."
        w[lp + "input_layernorm.weight"] = norm_w(hsz)
        w[lp + "post_attention_layernorm.weight"] = norm_w(hsz)
        a = lp + "self_attn."
        if cfg.q_lora_rank is None:
            w[a + "q_proj.weight"] = lin(n * qk, hsz, RW_QK_GAIN)
        else:
            w[a + "q_a_proj.weight"] = lin(cfg.q_lora_rank, hsz)
            w[a + "q_a_layernorm.weight"] = norm_w(cfg.q_lora_rank)
            w[a + "q_b_proj.weight"] = lin(n * qk, cfg.q_lora_rank, RW_QK_GAIN)
        w[a + "kv_a_proj_with_mqa.weight"] = np.concatenate(
            [lin(lkv, hsz), lin(r, hsz, RW_QK_GAIN)], axis=0)
        w[a + "kv_a_layernorm.weight"] = norm_w(lkv)
        w[a + "kv_b_proj.weight"] = np.concatenate(
            [np.concatenate([lin(p, lkv, RW_QK_GAIN), lin(dv, lkv)], axis=0)[None] for _ in range(n)],
            axis=0).reshape(n * (p + dv), lkv)
        w[a + "o_proj.weight"] = lin(hsz, n * dv, RW_ATTN_OUT / math.sqrt(1.0))
        m = lp + "mlp."
        if cfg.is_moe_layer(i):
            ie, e = cfg.moe_intermediate_size, cfg.n_routed_experts
            w[m + "gate.weight"] = lin(e, hsz, RW_ROUTER_GAIN)
            w[m + "gate.e_score_correction_bias"] = (RW_BIAS * rng.standard_normal(e)).astype(np.float32)
            if cfg.n_shared_experts > 0:
                isz = ie * cfg.n_shared_experts
                w[m + "shared_experts.gate_proj.weight"] = lin(isz, hsz)
                w[m + "shared_experts.up_proj.weight"] = lin(isz, hsz)
                w[m + "shared_experts.down_proj.weight"] = lin(hsz, isz, RW_MLP_OUT)
            # Experts of a layer share a common part: a routing decision that flips under rounding noise
            # moves the output less than the expert-specific part alone would (routing still matters).
            common = {"gate_proj": lin(ie, hsz), "up_proj": lin(ie, hsz), "down_proj": lin(hsz, ie, RW_EXPERT_OUT)}
            for j in range(e):
                ep = f"{m}experts.{j}."
                mats = {proj: (math.sqrt(1 - RW_EXPERT_SPREAD**2) * c + RW_EXPERT_SPREAD
                               * lin(*c.shape, RW_EXPERT_OUT if proj == "down_proj" else 1.0)).astype(np.float32)
                        for proj, c in common.items()}
                for proj, mat in mats.items():
                    # Sparse outliers, as trained weights have: they set the group absmax, so INT4
                    # quantization visibly changes the model (W4A16 goldens differ from float ones).
                    outlier = rng.random(mat.shape) < RW_OUTLIER_P
                    keep_rms = math.sqrt(1.0 + RW_OUTLIER_P * (RW_OUTLIER_X**2 - 1.0))
                    mat = (np.where(outlier, mat * RW_OUTLIER_X, mat) / keep_rms).astype(np.float32)
                    if quantize_experts_group is None:
                        w[ep + proj + ".weight"] = mat
                    else:
                        packed, scale = quantize_w4a16(mat, quantize_experts_group)
                        w[ep + proj + ".weight_packed"] = packed
                        w[ep + proj + ".weight_scale"] = scale
        else:
            isz = cfg.intermediate_size
            w[m + "gate_proj.weight"] = lin(isz, hsz)
            w[m + "up_proj.weight"] = lin(isz, hsz)
            w[m + "down_proj.weight"] = lin(hsz, isz, RW_MLP_OUT)
    return w


# Scales of random_weights (tuned on k2-tiny: see tests/test_reference.py for the checks).
RW_HEAD_GAIN = 8.0      # lm_head alignment with the successor embedding (logit scale)
RW_HEAD_NOISE = 0.5     # lm_head random part
RW_QK_GAIN = 1.0        # q/k projections (attention sharpness)
RW_ATTN_OUT = 0.45      # o_proj: size of each layer's writes next to the unit-RMS embedding
RW_MLP_OUT = 0.45       # dense / shared down_proj
RW_EXPERT_OUT = 0.45    # routed experts' down_proj
RW_ROUTER_GAIN = 2.0    # router logits std
RW_BIAS = 0.1           # e_score_correction_bias std
RW_EXPERT_SPREAD = 0.5  # expert-specific share (0: identical experts, 1: independent)
RW_OUTLIER_P = 0.03    # share of routed-expert weights that are outliers
RW_OUTLIER_X = 4.0     # outlier multiplier
