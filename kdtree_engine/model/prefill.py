"""Chunked prefill: chunk planning, the attention of a chunk over its committed prefix, and its cost model.

A prompt longer than one chunk is run as consecutive causal chunks: each writes its latents to the cache,
then attends over the committed prefix and itself. The keys are read in blocks of ``key_block`` with an
online softmax (running max and sum in float32), so no score matrix wider than a key block exists: the peak is
chunk x key block per head, whatever the prompt length. A prompt of at most one chunk keeps MLA's one-shot
naive form (the bits of a short prompt do not change).

Each chunk takes MLA's naive or absorbed form by estimated cost (see :func:`form_costs`).
Notation as in mla.py: N heads (per rank), P qk_nope, R qk_rope, V v_head, C kv_lora_rank, T chunk tokens,
K = S + T keys (S committed before the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig
from ..logs import log_once

DEFAULT_PREFILL_CHUNK = 4096  # tokens per chunk: the per-chunk activations and scores stay bounded
KEY_BLOCK = 512  # keys per online-softmax step: the score tile is [N, chunk, KEY_BLOCK]
FORMS = ("auto", "naive", "absorbed")
# Machine balance (FLOPs per byte moved) that weighs the two terms of the cost: the bf16 tensor-core rate
# over the HBM bandwidth of a datacenter GPU, and a vector-FMA rate over DRAM bandwidth of a server CPU.
FLOPS_PER_BYTE = {"cuda": 200.0, "cpu": 20.0}
# With the naive form on the prefill kernel (kernels/prefill_attention.py: tensor cores, scores in registers), the
# absorbed form is the only one left on float32 torch products: on CUDA cores each of its FLOPs costs about the
# bf16 tensor-core rate over the float32 CUDA-core rate of a datacenter GPU.
FP32_FLOP_COST = 15.0


@dataclass(frozen=True)
class ChunkStep:
    """How one prefill chunk attends: ``form`` "naive" or "absorbed", keys read ``key_block`` at a time."""

    form: str
    key_block: int = KEY_BLOCK


@dataclass(frozen=True)
class FormCost:
    flops: float
    bytes: float

    def time_units(self, flops_per_byte: float) -> float:
        """Roofline cost in FLOP units: the larger of compute and (bytes x machine balance)."""
        return max(self.flops, self.bytes * flops_per_byte)


@dataclass
class PrefillOutput:
    """logits [1, V] float32 of the last prompt token ([T, V] when all logits were asked for); aux [T, K*H]
    the drafter's context features of every prompt token (None without aux layers); chunks run, the chunk
    size, and the peak transient memory of the prefill (measured on CUDA, estimated on the CPU)."""

    logits: torch.Tensor
    aux: torch.Tensor | None
    chunks: int
    chunk: int
    peak_bytes: int

    def stats(self) -> dict[str, int]:
        return {"prefill_chunks": self.chunks, "prefill_chunk": self.chunk, "prefill_peak_bytes": self.peak_bytes}


def resolve_chunk(chunk: int | None) -> int:
    """The chunk size (None: :data:`DEFAULT_PREFILL_CHUNK`), logged once per size."""
    size = DEFAULT_PREFILL_CHUNK if chunk is None else chunk
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"prefill chunk must be a positive number of tokens, got {chunk!r}")
    log_once(f"prefill-chunk:{size}", f"prefill: prompts in chunks of {size} tokens"
             + (" (default)" if chunk is None else ""))
    return size


def plan_chunks(T: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a T-token prompt."""
    return [(a, min(a + chunk, T)) for a in range(0, T, chunk)]


def form_costs(cfg: ModelConfig, n_heads: int, T: int, S: int, dtype_bytes: int,
               kernel: bool = False) -> dict[str, FormCost]:
    """Estimated FLOPs and bytes of one chunk's attention in each form (K = S + T keys, b = dtype bytes;
    scores are float32 and written then read once):

      naive:    FLOPs 2*K*C*N*(P+V)  [expand the latents through kv_b]  + 2*T*K*N*(P+R) + 2*T*K*N*V
                bytes K*(C+R)*b + 2*K*N*(P+V)*b [per-head K/V written, read] + 2*4*N*T*K
      absorbed: FLOPs 2*T*N*P*C [q into the latent space] + 2*T*K*N*(C+R) + 2*T*K*N*C + 2*T*N*C*V [out]
                bytes K*(C+R)*b + 2*4*N*T*K + 4*T*N*(2C+R) [latent queries and outputs]

    The expansion is linear in K and the absorbed score width is C+R instead of P+R: the naive form wins for
    long chunks, the absorbed one for a few tokens over a long prefix. ``kernel``: the naive form runs on the prefill
    kernel (no scores in memory) and the absorbed form's FLOPs are float32 ones (x FP32_FLOP_COST)."""
    N, P, R, V, C = n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    K = S + T
    scores = 2 * 4 * N * T * K
    latents = K * (C + R) * dtype_bytes
    naive = FormCost(flops=2 * K * C * N * (P + V) + 2 * T * K * N * (P + R) + 2 * T * K * N * V,
                     bytes=latents + 2 * K * N * (P + V) * dtype_bytes + (0 if kernel else scores))
    absorbed = FormCost(flops=(2 * T * N * P * C + 2 * T * K * N * (C + R) + 2 * T * K * N * C + 2 * T * N * C * V)
                        * (FP32_FLOP_COST if kernel else 1.0),
                        bytes=latents + scores + 4 * T * N * (2 * C + R))
    return {"naive": naive, "absorbed": absorbed}


def choose_form(cfg: ModelConfig, n_heads: int, T: int, S: int, dtype_bytes: int, device: torch.device,
                form: str = "auto", kernel: bool = False) -> str:
    """The form of a chunk of T tokens over S committed ones: ``form`` when forced, else the cheaper by
    :func:`form_costs` at the device's machine balance (``kernel``: the naive form on the prefill kernel). Each
    distinct (form, T) decision is logged once."""
    if form not in FORMS:
        raise ValueError(f"prefill form must be one of {', '.join(FORMS)}; got {form!r}")
    if form != "auto":
        log_once(f"prefill-form:forced:{form}", f"prefill chunks: {form} form (forced)")
        return form
    balance = FLOPS_PER_BYTE["cuda" if device.type == "cuda" else "cpu"]  # the message below names it
    costs = form_costs(cfg, n_heads, T, S, dtype_bytes, kernel)
    chosen = min(costs, key=lambda f: (costs[f].time_units(balance), f))
    log_once(f"prefill-form:{chosen}:{T}", f"prefill chunk of {T} tokens over {S}: {chosen} form (cost in FLOP "
             + ", ".join(f"{f} {c.time_units(balance):.3g}" for f, c in costs.items()) + f"; {balance:g} FLOP/byte)")
    return chosen


def transient_bytes(cfg: ModelConfig, n_heads: int, T: int, keys: int, form: str, dtype_bytes: int) -> int:
    """Estimated largest transient of one layer's attention for T queries reading ``keys`` keys at once
    (the whole prompt for the one-shot form, a key block when tiled): float32 scores, probabilities and the
    mask fill (3 x N*T*keys*4), the keys / values of those keys (per head for the naive form, in the model
    dtype and float32), the float32 queries, and the accumulator with its rescaled copy."""
    N, P, R, V, C = n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scores = 3 * N * T * keys * 4
    if form == "naive":
        kv, q, acc = keys * N * (P + V) * (dtype_bytes + 4) + keys * R * 4, T * N * (P + R) * 4, 2 * T * N * V * 4
    else:
        kv, q, acc = keys * (C + R) * 4, T * N * (C + R) * 4, 2 * T * N * C * 4
    return scores + kv + q + acc


ScoresAndValues = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
# slots [s0, s1) of the request's latent cache -> [s1 - s0, C+R] (read through its block table: cache.py)
Latents = Callable[[int, int], torch.Tensor]


def blocked_causal_attention(block: ScoresAndValues, T: int, start: int, key_block: int,
                             device: torch.device) -> torch.Tensor:
    """Causal attention of T queries at positions start..start+T-1 over keys 0..start+T-1, read in key
    blocks with an online softmax. ``block(s0, s1)`` -> (scaled scores [N, T, s1-s0] float32, values
    [s1-s0, N, Dv] or [s1-s0, Dv]). Returns [N, T, Dv] float32.

    Key 0 is in the first block and visible to every query, so the running max is finite from then on and
    a later block fully masked for a row adds exactly nothing to it."""
    q_pos = torch.arange(start, start + T, device=device)
    m = l = acc = None
    for s0 in range(0, start + T, key_block):
        s1 = min(s0 + key_block, start + T)
        s, v = block(s0, s1)
        if s1 - 1 > start:  # some key of the block lies after some query
            future = torch.arange(s0, s1, device=device).unsqueeze(0) > q_pos.unsqueeze(1)  # [T, Bk]
            s = s.masked_fill(future, float("-inf"))
        m_new = s.amax(-1, keepdim=True) if m is None else torch.maximum(m, s.amax(-1, keepdim=True))
        p = (s - m_new).exp()  # [N, T, Bk]
        pv = torch.einsum("nts,snv->ntv", p, v.float()) if v.dim() == 3 else torch.einsum("nts,sv->ntv", p, v.float())
        if m is None:
            l, acc = p.sum(-1, keepdim=True), pv
        else:
            alpha = (m - m_new).exp()
            l, acc = l * alpha + p.sum(-1, keepdim=True), acc * alpha + pv
        m = m_new
    return acc / l


def naive_chunk(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: Latents, start: int, scale: float,
                kv_lora_rank: int, expand: Callable[[torch.Tensor], torch.Tensor], key_block: int) -> torch.Tensor:
    """Naive form of a chunk: q_nope [T, N, P], q_pe [T, N, R] over the latents of slots [0, start+T); each key block's
    latents expanded through ``expand`` (kv_b_proj) to per-head K / V [Bk, N, P+V]. Returns [T, N, V]."""
    T, N, P = q_nope.shape
    C = kv_lora_rank
    qn, qr = q_nope.float(), q_pe.float()

    def block(s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        lat = latents(s0, s1)
        kv = expand(lat[:, :C]).view(s1 - s0, N, -1)  # [Bk, N, P+V]
        s = (torch.einsum("tnp,snp->nts", qn, kv[..., :P].float())
             + torch.einsum("tnr,sr->nts", qr, lat[:, C:].float())) * scale
        return s, kv[..., P:]

    o = blocked_causal_attention(block, T, start, key_block, q_nope.device)  # [N, T, V]
    return o.transpose(0, 1).to(q_nope.dtype)


def absorbed_chunk(q_lat: torch.Tensor, q_pe: torch.Tensor, latents: Latents, start: int, scale: float,
                   kv_lora_rank: int, key_block: int) -> torch.Tensor:
    """Absorbed form of a chunk: q_lat [T, N, C], q_pe [T, N, R] over the latents of slots [0, start+T) read as keys
    (all C+R) and values (the first C). Returns [T, N, C]."""
    T = q_lat.shape[0]
    C = kv_lora_rank
    ql, qr = q_lat.float(), q_pe.float()

    def block(s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        lat = latents(s0, s1).float()
        s = (torch.einsum("tnc,sc->nts", ql, lat[:, :C]) + torch.einsum("tnr,sr->nts", qr, lat[:, C:])) * scale
        return s, lat[:, :C]

    o = blocked_causal_attention(block, T, start, key_block, q_lat.device)  # [N, T, C]
    return o.transpose(0, 1).to(q_lat.dtype)
