"""A differentiable K2-family model (batched, for training) and its time-boxed training loop.

The math is the engine's (kdtree_engine.model): MLA with the naive form (latents up-projected by
kv_b_proj, causal attention over [N, P+R] keys and [N, V] values), YaRN rope on the rope dims with
interleaved pairs, softmax scale ``cfg.softmax_scale``; dense SwiGLU MLP in the first
``first_k_dense_replace`` layers; then MoE: sigmoid router in float32, expert choice by
score + e_score_correction_bias (top-k; group-limited when n_group > 1), weights = the chosen scores
normalized and times routed_scaling_factor, plus the shared expert.

Parameters use the canonical checkpoint names, except routed experts, which are stacked per layer
(``mlp.experts.w13`` [E, 2I, H] with gate rows first, ``mlp.experts.w2`` [E, H, I]) as in the engine;
``export.py`` splits them per expert. The router's ``e_score_correction_bias`` is a buffer updated
without gradients (aux-loss-free balancing): after each optimizer step,
bias += u * sign(mean_load - load), load = tokens routed to each expert in that step.
"""

from __future__ import annotations


import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, YarnConfig
from ..model import layers
from ..model.layers import rope_inv_freq, rope_multiplier
from .data import random_windows


# ---- configuration ------------------------------------------------------------------------------

def demo_model_config(vocab_size: int, *, tiny: bool = False) -> ModelConfig:
    """The demo target: K2 layout (MLA + YaRN, 1 dense layer, 8 routed experts top-2, 1 shared)."""
    yarn = YarnConfig(factor=8.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)
    full = ModelConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
        intermediate_size=512, moe_intermediate_size=192, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.827, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32,
        v_head_dim=64, qk_nope_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=yarn, bos_token_id=0, eos_token_ids=(0,))
    if not tiny:
        return full
    return replace(full, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128,
                   moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
                   v_head_dim=32, qk_nope_head_dim=16)


# ---- modules ------------------------------------------------------------------------------------

class RMSNorm(layers.RMSNorm):
    """The engine's norm (same parameters and state-dict names) computed in float32 for training; the
    output stays float32 (the next matmul autocasts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dim, output de-interleaved (as the engine's apply_rope).

    x [B, T, ..., R]; cos/sin [T, R/2] float32.
    """
    shape = (1, cos.shape[0]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class KVCache:
    """Per-layer expanded keys [B, N, S, P+R] and values [B, N, S, V] for batched generation."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        N = cfg.num_attention_heads
        self.k = [torch.zeros(batch, N, max_len, cfg.qk_head_dim, dtype=dtype, device=device)
                  for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(batch, N, max_len, cfg.v_head_dim, dtype=dtype, device=device)
                  for _ in range(cfg.num_hidden_layers)]
        self.length = 0


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, N = cfg.hidden_size, cfg.num_attention_heads
        P, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, N * (P + R), bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, N * (P + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, C + R, bias=False)
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(C, N * (P + V), bias=False)
        self.o_proj = nn.Linear(N * V, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; causal over T (after the cached prefix when a cache is given)."""
        cfg = self.cfg
        B, T, _ = x.shape
        N, P, R, V, C = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.v_head_dim, cfg.kv_lora_rank)
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, N, P + R)
        q = torch.cat([q[..., :P], rope_interleaved(q[..., P:], cos, sin)], dim=-1)  # [B, T, N, P+R]
        kva = self.kv_a_proj_with_mqa(x)  # [B, T, C+R]
        c_kv = self.kv_a_layernorm(kva[..., :C])  # [B, T, C]
        k_pe = rope_interleaved(kva[..., C:], cos, sin)  # [B, T, R]
        kv = self.kv_b_proj(c_kv).view(B, T, N, P + V)
        k = torch.cat([kv[..., :P], k_pe.unsqueeze(2).expand(B, T, N, R).to(kv.dtype)], dim=-1)  # [B, T, N, P+R]
        v = kv[..., P:]  # [B, T, N, V]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N, T, *]
        q = q.to(v.dtype)
        if cache is None or cache.length == 0:
            if cache is not None:
                cache.k[layer][:, :, :T] = k
                cache.v[layer][:, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)
        else:
            if T != 1:
                raise ValueError("cached steps take one token at a time")
            s = cache.length
            cache.k[layer][:, :, s:s + 1] = k
            cache.v[layer][:, :, s:s + 1] = v
            o = F.scaled_dot_product_attention(q, cache.k[layer][:, :, :s + 1], cache.v[layer][:, :, :s + 1],
                                               scale=cfg.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, N * V))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (ids [M, k], weights [M, k] float32)."""
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [M, E]
        choice = scores.detach() + self.e_score_correction_bias
        if cfg.n_group > 1:
            M = x.shape[0]
            grouped = choice.view(M, cfg.n_group, -1)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
            mask = torch.zeros(M, cfg.n_group, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(M, -1)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * cfg.routed_scaling_factor


def _grouped_ffn(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Tokens sorted by expert xs [M, H]; counts [E] -> SwiGLU outputs [M, H] via torch._grouped_mm."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    dt = torch.bfloat16
    h = torch._grouped_mm(xs.to(dt), w13.to(dt).transpose(1, 2), offs=offs)  # [M, 2I]
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(gate) * up).to(dt), w2.to(dt).transpose(1, 2), offs=offs)  # [M, H]


def _loop_ffn(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same by a loop over the experts (one host sync for the counts)."""
    outs = []
    for e, part in enumerate(torch.split(xs, counts.tolist())):
        if part.shape[0] == 0:
            continue
        gate, up = F.linear(part, w13[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e]))
    return torch.cat(outs) if outs else xs.new_zeros(0, w2.shape[1])


EXPERT_IMPLS: dict[str, Callable] = {"grouped": _grouped_ffn, "loop": _loop_ffn}


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.zeros(E, 2 * I, H))  # rows [0, I) gate_proj, [I, 2I) up_proj
        self.w2 = nn.Parameter(torch.zeros(E, H, I))
        self.impl = "loop"

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, H], ids/w [M, k] -> sum_k w * expert(x) [M, H] (float32 accumulation)."""
        M, k = ids.shape
        E = self.w13.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        y = EXPERT_IMPLS[self.impl](x[tok], counts, self.w13, self.w2)  # [M*k, H]
        y = y.float() * w.reshape(-1)[order].unsqueeze(1)
        return torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.register_buffer("last_load", torch.zeros(cfg.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, w = self.gate(xf)
        if self.training:  # index_add, not bincount: no host sync
            flat = ids.reshape(-1)
            self.load.index_add_(0, flat, torch.ones(flat.shape, dtype=self.load.dtype, device=flat.device))
        out = self.experts(xf, ids, w)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf).float()
        return out.view(shape[:-1] + (out.shape[-1],))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dropout: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = MoE(cfg) if cfg.is_moe_layer(idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.drop = nn.Dropout(dropout)
        self.idx = idx

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        h = h + self.drop(self.self_attn(self.input_layernorm(h), cos, sin, cache, self.idx)).float()
        return h + self.drop(self.mlp(self.post_attention_layernorm(h))).float()


class TrainModel(nn.Module):
    """Batched K2-family model: ids [B, T] -> logits [B, T, V] (and aux layer outputs)."""

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i, dropout) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # cos/sin [P, R/2] from float64 angles, as the engine's table
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), rope_inv_freq(cfg))
        mult = rope_multiplier(cfg)
        self.register_buffer("rope_cos", (freqs.cos() * mult).float(), persistent=False)
        self.register_buffer("rope_sin", (freqs.sin() * mult).float(), persistent=False)

    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.layers if isinstance(l.mlp, MoE)]

    def set_expert_impl(self, impl: str) -> None:
        for m in self.moe_layers():
            m.experts.impl = impl

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        resid = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = resid if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")) else std
            p.copy_(torch.randn(p.shape, generator=g) * s)
        for m in self.moe_layers():
            m.gate.e_score_correction_bias.zero_()

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions], self.rope_sin[positions]  # [T, R/2] each

    def forward(self, ids: torch.Tensor, *, aux_layers: tuple[int, ...] = (), cache: KVCache | None = None,
                return_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, V] float32 or final-normed hidden [B, T, H], aux [B, T, K*H] or None)."""
        B, T = ids.shape
        start = 0 if cache is None else cache.length
        cos, sin = self.rope(torch.arange(start, start + T, device=ids.device))
        h = self.embed_tokens(ids).float()
        saved = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache)
            if i in aux_layers:
                saved[i] = h
        if cache is not None:
            cache.length += T
        aux = torch.cat([saved[i] for i in aux_layers], dim=-1) if aux_layers else None
        h = self.norm(h)
        if return_hidden:
            return h, aux
        return self.lm_head(h).float(), aux

    @torch.no_grad()
    def update_router_bias(self, u: float) -> None:
        """Aux-loss-free balancing step (no host sync): bias += u * sign(mean load - load); resets the loads."""
        for m in self.moe_layers():
            m.gate.e_score_correction_bias += u * torch.sign(m.load.mean() - m.load)
            m.last_load.copy_(m.load)
            m.load.zero_()

    def expert_load_fractions(self) -> list[list[float]]:
        """Share of routed tokens per expert in the last training step, per MoE layer."""
        return [(m.last_load / m.last_load.sum().clamp_min(1)).tolist() for m in self.moe_layers()]


def pick_expert_impl(model: TrainModel, device: torch.device, log: Callable[[str], None] = print) -> str:
    """'grouped' (torch._grouped_mm, no host sync) when it runs here and matches the loop, else 'loop'."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return "loop"
    try:
        g = torch.Generator(device="cpu").manual_seed(1)
        E, I, H = 4, 32, 64
        x = torch.randn(100, H, generator=g).to(device).requires_grad_()
        w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(device).requires_grad_()
        w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(device).requires_grad_()
        counts = torch.tensor([30, 0, 50, 20], device=device)
        outs = []
        for impl in ("grouped", "loop"):
            for t in (x, w13, w2):
                t.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = EXPERT_IMPLS[impl](x, counts, w13, w2)
            y.float().square().sum().backward()
            outs.append([y.detach().float(), x.grad.clone(), w13.grad.clone(), w2.grad.clone()])
        for a, b in zip(*outs):
            if not torch.isfinite(a).all() or (a - b).norm() > 0.05 * b.norm() + 1e-6:
                raise RuntimeError(f"grouped_mm differs from the loop (rel {float((a - b).norm() / b.norm()):.3g})")
        return "grouped"
    except Exception as e:  # not supported by this torch / GPU
        log(f"expert FFN: torch._grouped_mm unusable ({type(e).__name__}: {str(e)[:200]}); using the loop")
        return "loop"


# ---- training -----------------------------------------------------------------------------------

@dataclass
class TargetTrainSettings:
    minutes: float = 4.5  # time box (a cap: max_epochs usually ends the run first)
    max_steps: int | None = None  # fixed step count (reproducible schedule); None = time box / epochs
    max_epochs: float | None = 16.0  # passes over the train split; beyond this the model mostly memorizes
    batch: int = 64
    seq_len: int = 1024
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    dropout: float = 0.1
    bias_update: float = 1e-3
    eval_every: int = 0  # steps; 0 = about 12 evaluations over the run
    eval_windows: int = 32  # held-out windows for the periodic evaluation
    compile: bool = False
    expert_impl: str = "auto"  # auto | grouped | loop
    seed: int = 0


def lr_at(step: int, total: int, s: TargetTrainSettings | Any) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    frac = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.lr * (s.min_lr_frac + (1 - s.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model: nn.Module, lr: float, wd: float, betas: tuple[float, float],
                   device: torch.device) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kw)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate_loss(model: TrainModel, windows: torch.Tensor, device: torch.device, batch: int = 32) -> dict:
    """Mean next-token loss over windows [n, L+1] (L predictions per window)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with autocast(device):
            logits, _ = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train(was)
    mean = total / max(1, count)
    return {"loss": mean, "ppl": math.exp(min(mean, 50.0)), "tokens": count}


@dataclass
class TrainResult:
    model: TrainModel
    steps: int
    tokens: int
    seconds: float
    curve: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    expert_impl: str = "loop"
    final_load: list = field(default_factory=list)


def train_target(cfg: ModelConfig, train_stream: torch.Tensor, eval_windows: torch.Tensor, s: TargetTrainSettings,
                 device: torch.device, log: Callable[[str], None] = print) -> TrainResult:
    """Train from scratch on random windows of ``train_stream`` for ``s.minutes`` (or ``s.max_steps``).

    Time-boxed runs measure the step time (steps 20..60, again 60..150) and fix the step count that
    fits, so the cosine schedule ends with the time box; the loop also stops at the time box.
    """
    torch.manual_seed(s.seed)
    stream = train_stream.to(device)
    gen = torch.Generator(device=device).manual_seed(s.seed + 1)
    model = TrainModel(cfg, dropout=s.dropout)
    model.init_weights(s.seed)
    model.to(device).train()
    impl = pick_expert_impl(model, device, log) if s.expert_impl == "auto" else s.expert_impl
    model.set_expert_impl(impl)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, expert FFN '{impl}', "
        f"batch {s.batch} x {s.seq_len} tokens")
    opt = make_optimizer(model, s.lr, s.weight_decay, s.betas, device)
    step_fn = model
    if s.compile:
        try:
            step_fn = torch.compile(model)
        except Exception as e:
            log(f"torch.compile failed ({e}); eager")
    budget = s.minutes * 60.0
    epoch_steps = (math.ceil(s.max_epochs * train_stream.numel() / (s.batch * s.seq_len))
                   if s.max_epochs else 10**9)
    timed = s.max_steps is None and epoch_steps > 150
    total = s.max_steps if s.max_steps is not None else (10**9 if timed else epoch_steps)
    sched_total = total if not timed else min(10**6, epoch_steps)
    if s.max_steps is None and not timed:
        log(f"target: {total} steps = {s.max_epochs:g} epochs of the train split")
    eval_every = s.eval_every or (max(1, total // 10) if not timed else 0)
    t0 = time.perf_counter()
    curve: list[dict] = []
    ema = torch.zeros((), device=device)
    step = tokens = 0
    mark = (0, t0)
    while step < total:
        batch = random_windows(stream, s.batch, s.seq_len + 1, gen)
        lr = lr_at(step, sched_total, s)
        for gp in opt.param_groups:
            gp["lr"] = lr
        with autocast(device):
            try:
                logits, _ = step_fn(batch[:, :-1])
            except Exception as e:
                if step_fn is model:
                    raise
                log(f"compiled step failed ({type(e).__name__}: {str(e)[:200]}); eager from here")
                step_fn = model
                logits, _ = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        model.update_router_bias(s.bias_update)
        with torch.no_grad():
            ema = loss.detach() if step == 0 else 0.95 * ema + 0.05 * loss.detach()
        step += 1
        tokens += s.batch * s.seq_len
        now = time.perf_counter()
        elapsed = now - t0
        if timed and step in (20, 60, 150):
            if step > 20:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.perf_counter()
                rate = (now - mark[1]) / (step - mark[0])
                reserve = 0.03 * budget  # periodic evaluations
                fit = max(step + 1, int(step + (budget - reserve - (now - t0)) / rate))
                total = min(fit, epoch_steps)
                sched_total = total
                eval_every = s.eval_every or max(25, total // 12)
                log(f"target: {rate * 1000:.1f} ms/step -> {total} steps ({'epoch cap' if total < fit else 'time box'}) "
                    f"({total * s.batch * s.seq_len / 1e6:.0f}M tokens, "
                    f"{total * s.batch * s.seq_len / max(1, train_stream.numel()):.1f} epochs)")
            else:
                if device.type == "cuda":
                    torch.cuda.synchronize()
            mark = (step, time.perf_counter())
        over = s.max_steps is None and elapsed > budget
        if (eval_every and step % eval_every == 0) or step == total or over:
            ev = evaluate_loss(model, eval_windows[: s.eval_windows], device)
            lv, ev_ema = float(loss.detach()), float(ema)
            curve.append({"step": step, "tokens": tokens, "seconds": round(elapsed, 2), "lr": lr,
                          "train_loss": lv, "train_loss_ema": ev_ema, "eval_loss": ev["loss"]})
            load_max = max((max(f) for f in model.expert_load_fractions()), default=0.0)
            log(f"target step {step}/{total if total < 10**9 else '?'} {elapsed:6.1f}s lr {lr:.2e} "
                f"loss {lv:.3f} (ema {ev_ema:.3f}) held-out {ev['loss']:.3f} max expert load {load_max:.2f}")
        if over:
            log(f"target: time box reached at step {step}")
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.eval()
    return TrainResult(model=model, steps=step, tokens=tokens, seconds=seconds, curve=curve,
                       settings=asdict(s), expert_impl=impl, final_load=model.expert_load_fractions())


@torch.no_grad()
def generate(model: TrainModel, prompts: torch.Tensor, new_tokens: int, *, temperature: float = 0.0,
             gen: torch.Generator | None = None) -> torch.Tensor:
    """Batched continuation of prompts [B, P] by new_tokens tokens (greedy, or sampled at ``temperature``)."""
    device = prompts.device
    B, P = prompts.shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = KVCache(model.cfg, B, P + new_tokens, dtype, device)
    out = torch.empty(B, P + new_tokens, dtype=torch.long, device=device)
    out[:, :P] = prompts
    with autocast(device):
        h, _ = model(prompts, cache=cache, return_hidden=True)
        logits = model.lm_head(h[:, -1:]).float()  # only the last position's logits
        for t in range(new_tokens):
            last = logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                nxt = last.argmax(-1)
            out[:, P + t] = nxt
            if t + 1 < new_tokens:
                logits, _ = model(nxt.unsqueeze(1), cache=cache)
    return out
