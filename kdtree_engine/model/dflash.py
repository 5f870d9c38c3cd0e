"""The DFlash drafter: a Qwen3-style stack that predicts a whole block in one non-causal pass.

It has no embedding and no LM head: block tokens go through the target's ``embed`` and the final
(normed) hidden states through the target's ``lm_head``. Target conditioning: the outputs of target
layers ``target_layer_ids`` (id L = output of decoder layer L) are concatenated, mapped to the draft
width by ``fc`` and normed by ``hidden_norm``; every layer projects these context features with its
own k_proj/v_proj (+ k_norm, + RoPE at the context tokens' positions) into extra keys/values. Queries
come from the block [bonus, MASK x (B-1)] only; attention over context + block has no mask.

Context cache: per layer, K/V of the projected features of committed tokens only. A draft call
appends the features of the tokens committed since the last call (positions cache.length ..
start-1) and never caches block K/V, so after every call cache.length == start, the bonus position.

Tensor names are those of the released checkpoints (no ``model.`` prefix): ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and per layer ``layers.i.{input_layernorm,
post_attention_layernorm}.weight``, ``layers.i.self_attn.{q,k,v,o}_proj.weight``,
``layers.i.self_attn.{q,k}_norm.weight``, ``layers.i.mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import DraftMismatchError, DraftLoadError
from ..config import ModelConfig
from ..draft_config import DraftConfig
from ..kernels.common import take_rows
from ..kernels.dispatch import draft_attention, draft_attention_backend, head_norm_rope
from ..kernels.policy import KernelPolicy, policy_or_env
from ..weights import storable
from .layers import MLP, Linear, RMSNorm, stacked_linear, stacked_weights




class TargetLike(Protocol):
    cfg: ModelConfig

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, h: torch.Tensor) -> torch.Tensor: ...


# ---- rope (rotate-half, Qwen3 style) -------------------------------------------------------------

def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, d] for positions [T], computed in float32 as transformers' Qwen3 does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv.unsqueeze(0)  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def check_eager_pass(cache: "DraftCache", rows: int, start: int) -> None:
    """An eager pass's context rows must end where its block starts, within the cache."""
    if cache.length + rows != start:
        raise ValueError(f"draft context ends at {cache.length + rows} (cache {cache.length} + {rows} new), block "
                         f"starts at {start}")
    if start > cache.capacity:
        raise ValueError(f"draft cache holds {cache.capacity} tokens; {start} needed")


# ---- context cache -------------------------------------------------------------------------------

class DraftCache:
    """Per-layer K/V of projected target features, one entry per committed token before the bonus."""

    def __init__(self, cfg: DraftConfig, max_tokens: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.capacity = max_tokens
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, max_tokens, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, Hkv, S, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, Hkv, S, d]
        self.length = 0

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside [0, {self.length}]")
        self.length = n


@dataclass(frozen=True)
class DraftStep:
    """The data of one draft pass, built once per pass (:meth:`DFlashDrafter.context`).

    q_pos [B] block positions and their rope tables cos_b / sin_b [B, d]; c_pos [R] the cache slots (= positions)
    of the new context rows and their tables (None: no new rows); kv_len: the cache slots the attention reads
    (eager: the committed length; device-resident: the whole buffer); k_pos [kv_len + B] key positions and
    visible [B, kv_len + B] for the torch attention (None where the kernel takes ``start``); start [] long:
    the committed length on the device, for the one-launch kernel (None: the torch path); host_length: the
    cache's new host-side length after an eager pass (None: device-resident).
    """

    q_pos: torch.Tensor
    cos_b: torch.Tensor
    sin_b: torch.Tensor
    c_pos: torch.Tensor | None
    cos_c: torch.Tensor | None
    sin_c: torch.Tensor | None
    kv_len: int
    k_pos: torch.Tensor | None
    visible: torch.Tensor | None
    start: torch.Tensor | None
    host_length: int | None


# ---- modules -------------------------------------------------------------------------------------

class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, window: int | None, *, dtype: torch.dtype,
                 policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.policy = policy = policy_or_env(policy)
        D, H, Hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.window = H, Hkv, d, window
        self.q_proj = Linear(D, H * d, parallel="column", dtype=dtype, policy=policy)
        self.k_proj = Linear(D, Hkv * d, parallel="column", dtype=dtype, policy=policy)
        self.v_proj = Linear(D, Hkv * d, parallel="column", dtype=dtype, policy=policy)
        self.o_proj = Linear(H * d, D, parallel="row", dtype=dtype, policy=policy)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, policy=policy)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, policy=policy)

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> k, v [T, Hkv, d] before norm and rope (one GEMM when k_proj and v_proj are dense)."""
        T = x.shape[0]
        kv = stacked_linear(self, "_kv_stack", (self.k_proj, self.v_proj))
        k, v = (self.k_proj(x), self.v_proj(x)) if kv is None else kv(x).chunk(2, dim=-1)
        return k.view(T, self.kv_heads, self.head_dim), v.view(T, self.kv_heads, self.head_dim)

    def derived_weights(self) -> list[torch.Tensor]:
        """The stacked k / v projection, when built (see layers.stacked_weights)."""
        return stacked_weights(self)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected context features [C, D] -> k, v [Hkv, C, d] (k normed and rotated)."""
        k, v = self._kv(ctx)
        k = self._norm_rope(self.k_norm, k, cos, sin)
        return k.transpose(0, 1), v.transpose(0, 1)

    @staticmethod
    def _norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """rope(norm(x)) per head: x [T, heads, d] -> [T, heads, d] (one launch on CUDA)."""
        return head_norm_rope(norm.policy, x, norm.weight, norm.eps, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_ctx: torch.Tensor,
                v_ctx: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor | None,
                visible: torch.Tensor | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, D] (normed block stream); k_ctx/v_ctx [Hkv, S, d] (cached context) -> [B, D].

        visible [B, S+B] bool, optional: keys a query may see at all (device-resident rounds pass the
        whole cache buffer and hide the slots past the committed length). start [] long, optional: the
        committed length (the slots a query sees), for the one-launch kernel (kernels/draft_attention.py),
        which the dispatch takes on CUDA; without it, or on the CPU, the torch path below."""
        q, kb, vb = self.project(x, cos, sin)
        return self.o_proj(self.attend(q, kb, vb, k_ctx, v_ctx, q_pos, k_pos, visible, start))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, D] -> q [B, H, d], k [B, Hkv, d] (normed, rotated), v [B, Hkv, d]: per row, so the blocks of several
        requests project in one pass (:meth:`DFlashDrafter.forward_batch`)."""
        B = x.shape[0]
        q = self._norm_rope(self.q_norm, self.q_proj(x).view(B, self.heads, self.head_dim), cos, sin)
        kb, vb = self._kv(x)
        return q, self._norm_rope(self.k_norm, kb, cos, sin), vb

    def attend(self, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
               q_pos: torch.Tensor, k_pos: torch.Tensor | None, visible: torch.Tensor | None = None,
               start: torch.Tensor | None = None) -> torch.Tensor:
        """One block's attention over its cached context and itself -> [B, H * d] (before o_proj)."""
        B = q.shape[0]
        if start is not None and draft_attention_backend(self.policy, q, k_ctx) == "triton":
            o = draft_attention(q, k_ctx, v_ctx, kb, vb, start, self.window)  # [B, H, d]
            return o.reshape(B, self.heads * self.head_dim)
        k = torch.cat([k_ctx, kb.transpose(0, 1)], dim=1)  # [Hkv, S+B, d]
        v = torch.cat([v_ctx, vb.transpose(0, 1)], dim=1)  # [Hkv, S+B, d]
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=0)  # [H, S+B, d]
            v = v.repeat_interleave(rep, dim=0)
        mask = None
        if self.window is not None:
            # sliding layers: a query at p sees keys at positions > p - window (block keys included)
            mask = k_pos.unsqueeze(0) > (q_pos.unsqueeze(1) - self.window)  # [B, S+B]
        if visible is not None:
            mask = visible if mask is None else mask & visible
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                           scale=1.0 / math.sqrt(self.head_dim))  # [H, B, d]
        return o.transpose(0, 1).reshape(B, self.heads * self.head_dim)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, window: int | None, *, dtype: torch.dtype,
                 policy: KernelPolicy | None = None) -> None:
        super().__init__()
        policy = policy_or_env(policy)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy=policy)
        self.self_attn = DraftAttention(cfg, window, dtype=dtype, policy=policy)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy=policy)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, policy=policy)


_RENAMES = ((re.compile(r"^model\."), ""), (re.compile(r"^midlayer\."), "layers.0."),
            (re.compile(r"^encoder\.fc\."), "fc."))


class DFlashDrafter(nn.Module):
    # its forward also runs device-resident passes, so the rounds it drafts for may live on the device
    DEVICE_RESIDENT = True

    """``policy``: the kernel policy every layer runs with (None: the environment's, KernelPolicy.from_env)."""

    def __init__(self, cfg: DraftConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy = policy = policy_or_env(policy)
        self.dtype = dtype
        self.device = torch.device(device)
        D = cfg.hidden_size
        windows = cfg.sliding_windows or (None,) * cfg.num_hidden_layers
        with self.device:
            self.fc = Linear(cfg.num_context_features * D, D, parallel="replicated", dtype=dtype, policy=policy)
            self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, policy=policy)
            self.layers = nn.ModuleList(DraftLayer(cfg, windows[i], dtype=dtype, policy=policy)
                                        for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(D, cfg.rms_norm_eps, policy=policy)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(dtype)
        self.requires_grad_(False)

    # ---- target compatibility ----------------------------------------------------------------
    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def check_target(self, tcfg: ModelConfig) -> None:
        """Raise DraftMismatchError naming what does not fit the target."""
        check_draft_fits(self.cfg, tcfg)

    # ---- compute -----------------------------------------------------------------------------
    def new_cache(self, max_tokens: int) -> DraftCache:
        return DraftCache(self.cfg, max_tokens, dtype=self.dtype, device=self.device)

    def context(self, cache: DraftCache, rows: int, start: int | torch.Tensor,
                n_ctx: torch.Tensor | None = None) -> DraftStep:
        """The data of one draft pass over the block at positions start .. start+B-1 (see :class:`DraftStep`).

        start an int: an eager pass; the ``rows`` context rows are the tokens at cache.length .. start-1. start a
        [] long device tensor: a device-resident pass (no host read, shapes fixed by the block size and the
        capacity); the first ``n_ctx`` of the ``rows`` rows are the tokens at start - n_ctx .. start-1, the
        others land past the committed length where no query looks; capacity >= start + rows.
        """
        B, dev, dt, cfg = self.cfg.block_size, self.device, self.dtype, self.cfg
        if not isinstance(start, torch.Tensor):
            L0 = cache.length
            check_eager_pass(cache, rows, start)
            q_pos = torch.arange(start, start + B, device=dev)  # [B]
            c_pos = torch.arange(L0, start, device=dev) if rows else None  # [rows] cache slots = positions
            cos_b, sin_b = rope_tables(q_pos, cfg.head_dim, cfg.rope_theta, dt)
            cos_c, sin_c = (rope_tables(c_pos, cfg.head_dim, cfg.rope_theta, dt) if rows else (None, None))
            # the context length as a device scalar, read by the one-launch attention kernel (the torch path masks)
            start_t = torch.tensor(start, device=dev) if draft_attention_backend(self.policy, cache.k, cache.k) == "triton" else None
            return DraftStep(q_pos, cos_b, sin_b, c_pos, cos_c, sin_c, start, torch.arange(0, start + B, device=dev),
                             None, start_t, start)
        if n_ctx is None:
            raise ValueError("a device-resident draft pass needs n_ctx, the valid context rows")
        q_pos = start + torch.arange(B, device=dev)  # [B]
        c_pos = start - n_ctx + torch.arange(rows, device=dev)  # [rows] cache slots = positions
        k_pos = visible = None  # the kernel reads the committed length itself; the torch path masks
        if draft_attention_backend(self.policy, cache.k, cache.k) == "torch":
            slot_pos = torch.arange(cache.capacity, device=dev)  # [S_cap]
            k_pos = torch.cat([slot_pos, q_pos])  # [S_cap + B]
            visible = torch.cat([slot_pos < start, torch.ones(B, dtype=torch.bool, device=dev)])  # [S_cap + B]
            visible = visible.unsqueeze(0).expand(B, -1)  # [B, S_cap + B]
        cos_t, sin_t = self._rope_table(cache, cache.capacity + B)
        return DraftStep(q_pos, take_rows(cos_t, q_pos), take_rows(sin_t, q_pos), c_pos, take_rows(cos_t, c_pos),
                         take_rows(sin_t, c_pos), cache.capacity, k_pos, visible, start, None)

    def contexts(self, items: Sequence[tuple[int, DraftCache, int]]) -> list[DraftStep]:
        """:meth:`context` of several eager passes (rows, cache, start each). With the one-launch attention kernel
        (CUDA) their positions go to the device in one copy and their rope rows are made in one pass
        (:meth:`contexts_together`); the torch path builds each pass's alone."""
        if not items or draft_attention_backend(self.policy, items[0][1].k, items[0][1].k) != "triton":
            return [self.context(cache, rows, start) for rows, cache, start in items]
        return self.contexts_together(items)

    def contexts_together(self, items: Sequence[tuple[int, DraftCache, int]]) -> list[DraftStep]:
        """Eager passes' data for the one-launch attention kernel (which reads the committed length from ``start`` and
        needs no key positions or mask), built together: one host-to-device copy of every pass's positions and
        lengths, one rope_tables call for all block rows and one for all context rows. rope_tables is elementwise in
        the position, so a row holds the bits its own pass would compute on the GPU (on the CPU vectorised tails
        may round differently: the torch path builds each pass alone)."""
        B, dev, dt, cfg = self.cfg.block_size, self.device, self.dtype, self.cfg
        q_host, c_host = [], []
        for rows, cache, start in items:
            check_eager_pass(cache, rows, start)
            q_host.append(torch.arange(start, start + B))
            c_host.append(torch.arange(cache.length, start))
        nq, nc = len(items) * B, sum(rows for rows, _, _ in items)
        flat = torch.cat(q_host + c_host + [torch.tensor([start for _, _, start in items])]).to(dev)
        q_all, c_all, s_all = flat[:nq], flat[nq:nq + nc], flat[nq + nc:]
        cos_q, sin_q = rope_tables(q_all, cfg.head_dim, cfg.rope_theta, dt)
        cos_c, sin_c = rope_tables(c_all, cfg.head_dim, cfg.rope_theta, dt) if nc else (None, None)
        steps, a = [], 0
        for i, (rows, _, start) in enumerate(items):
            q, c = slice(i * B, (i + 1) * B), slice(a, a + rows)
            a += rows
            steps.append(DraftStep(q_all[q], cos_q[q], sin_q[q], c_all[c] if rows else None,
                                   cos_c[c] if rows else None, sin_c[c] if rows else None, start, None, None,
                                   s_all[i], start))
        return steps

    @torch.no_grad()
    def forward(self, ctx_rows: torch.Tensor | None, block_embeds: torch.Tensor, cache: DraftCache,
                start: int | torch.Tensor, n_ctx: torch.Tensor | None = None) -> torch.Tensor:
        """One draft pass; what differs between an eager and a device-resident pass is its context
        (:meth:`context`).

        ctx_rows [R, K*D]: target features of the tokens committed since the last pass (eager: all R rows, at
        positions cache.length .. start-1; device-resident: the first n_ctx rows); block_embeds [B, D]: target
        embeddings of the block at positions start .. start+B-1. Returns the final-normed hidden states [B, D].
        Afterwards an eager pass leaves cache.length == start; a device-resident one leaves the host-side
        length alone.
        """
        rows = 0 if ctx_rows is None else ctx_rows.shape[0]
        step = self.context(cache, rows, start, n_ctx)
        dev, dt = self.device, self.dtype
        ctx = self.hidden_norm(self.fc(ctx_rows.to(device=dev, dtype=dt))) if rows else None  # [R, D]
        h = block_embeds.to(device=dev, dtype=dt)  # [B, D]
        pending: torch.Tensor | None = None  # a layer's MLP output, added by the next norm (one dispatch)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if ctx is not None:
                k_c, v_c = attn.context_kv(ctx, step.cos_c, step.sin_c)  # [Hkv, R, d]
                cache.k[i].index_copy_(1, step.c_pos, k_c)
                cache.v[i].index_copy_(1, step.c_pos, v_c)
            h, x = layer.input_layernorm.residual(h, pending)
            a = attn(x, step.cos_b, step.sin_b, cache.k[i, :, :step.kv_len], cache.v[i, :, :step.kv_len], step.q_pos,
                     step.k_pos, step.visible, step.start)
            h, x = layer.post_attention_layernorm.residual(h, a)
            pending = layer.mlp(x)
        if step.host_length is not None:
            cache.length = step.host_length
        return self.norm.residual(h, pending)[1]

    @torch.no_grad()
    def forward_batch(self, items: Sequence[tuple[torch.Tensor | None, DraftCache, int]],
                      block_embeds: torch.Tensor, n_ctx: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Draft passes of several requests as one: items (ctx_rows [R_i, K*D] or None, cache, start) and their
        blocks' embeddings concatenated [n * B, D] -> the final-normed hidden states [n * B, D]. Row-wise work runs
        over all rows; attention runs per request over its own cache, with the shapes of its own pass (each
        request's rows are those of :meth:`forward` bit for bit where the kernels are batch-invariant).

        Eager passes (int starts) or, with ``n_ctx`` (one [] long device tensor a pass), device-resident ones (start a
        [] long device tensor: the context of :meth:`context`; no host read, so the batch can be captured)."""
        B, dev, dt = self.cfg.block_size, self.device, self.dtype
        if n_ctx is None:
            steps = self.contexts([(0 if c is None else c.shape[0], cache, start) for c, cache, start in items])
        else:
            steps = [self.context(cache, c.shape[0], start, n) for (c, cache, start), n in zip(items, n_ctx)]
        fed = [(c, cache, st) for (c, cache, _), st in zip(items, steps) if c is not None and c.shape[0]]
        ctx = self._fed_rows(fed)
        cos_b = torch.cat([st.cos_b for st in steps])
        sin_b = torch.cat([st.sin_b for st in steps])
        h = block_embeds.to(device=dev, dtype=dt)  # [n * B, D]
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if ctx is not None:
                self._cache_rows(i, fed, *ctx)
            h, x = layer.input_layernorm.residual(h, pending)
            q, kb, vb = attn.project(x, cos_b, sin_b)
            o = torch.cat([attn.attend(q[j * B:(j + 1) * B], kb[j * B:(j + 1) * B], vb[j * B:(j + 1) * B],
                                       cache.k[i, :, :st.kv_len], cache.v[i, :, :st.kv_len], st.q_pos, st.k_pos,
                                       st.visible, st.start)
                           for j, ((_, cache, _), st) in enumerate(zip(items, steps))])
            h, x = layer.post_attention_layernorm.residual(h, attn.o_proj(o))
            pending = layer.mlp(x)
        for (_, cache, _), st in zip(items, steps):
            if st.host_length is not None:
                cache.length = st.host_length
        return self.norm.residual(h, pending)[1]

    def _fed_rows(self, fed: list[tuple[torch.Tensor, DraftCache, DraftStep]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The projected context rows of several passes [sum R, D] and their rope rows (None: no rows)."""
        if not fed:
            return None
        ctx = self.hidden_norm(self.fc(torch.cat([c for c, _, _ in fed]).to(device=self.device, dtype=self.dtype)))
        return ctx, torch.cat([st.cos_c for _, _, st in fed]), torch.cat([st.sin_c for _, _, st in fed])

    def _cache_rows(self, layer: int, fed: list[tuple[torch.Tensor, DraftCache, DraftStep]], ctx: torch.Tensor,
                    cos_c: torch.Tensor, sin_c: torch.Tensor) -> None:
        """Layer ``layer``'s K/V of the projected context rows, each pass's into its cache at its slots."""
        k_c, v_c = self.layers[layer].self_attn.context_kv(ctx, cos_c, sin_c)  # [Hkv, sum R, d]
        sizes = [c.shape[0] for c, _, _ in fed]
        for (_, cache, st), kc, vc in zip(fed, k_c.split(sizes, dim=1), v_c.split(sizes, dim=1)):
            cache.k[layer].index_copy_(1, st.c_pos, kc)
            cache.v[layer].index_copy_(1, st.c_pos, vc)

    def feed_batch(self, items: Sequence[tuple[torch.Tensor, DraftCache, torch.Tensor]],
                   n_ctx: Sequence[torch.Tensor]) -> None:
        """The context rows of several device-resident passes into their caches, without a pass: items (rows
        [R, K*D], cache, start [] long) of which the first n_ctx (one [] long a cache) are the tokens at start - n_ctx
        .. start-1 (the others land past the committed length), the K/V :meth:`forward_batch` would write."""
        fed = [(c, cache, self.context(cache, c.shape[0], start, n)) for (c, cache, start), n in zip(items, n_ctx)]
        ctx = self._fed_rows(fed)
        for i in range(len(self.layers)):
            self._cache_rows(i, fed, *ctx)

    @torch.no_grad()
    def propose_batch(self, target: TargetLike, items: Sequence[tuple[torch.Tensor | None, torch.Tensor, DraftCache,
                                                                       int]]) -> list[torch.Tensor]:
        """:meth:`propose` for several requests in one pass: items (ctx_features, bonus, cache, start) -> each one's
        draft logits [B-1, V]."""
        B = self.cfg.block_size
        blocks = torch.full((len(items), B), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        blocks[:, 0] = torch.stack([bonus.reshape(()) for _, bonus, _, _ in items]).to(self.device)
        h = self.forward_batch([(c, cache, start) for c, _, cache, start in items], target.embed(blocks.flatten()))
        keep = torch.arange(len(items) * B, device=self.device).view(len(items), B)[:, 1:].flatten()
        return list(target.lm_head(take_rows(h, keep)).split(B - 1))

    @torch.no_grad()
    def append_context(self, ctx_features: torch.Tensor, cache: DraftCache) -> None:
        """Project and cache the features [C, K*D] of the tokens at positions cache.length .. +C-1."""
        C = ctx_features.shape[0]
        L0 = cache.length
        if L0 + C > cache.capacity:
            raise ValueError(f"draft cache holds {cache.capacity} tokens; {L0 + C} needed")
        if C == 0:
            return
        dev, dt, cfg = self.device, self.dtype, self.cfg
        ctx = self.hidden_norm(self.fc(ctx_features.to(device=dev, dtype=dt)))  # [C, D]
        cos_c, sin_c = rope_tables(torch.arange(L0, L0 + C, device=dev), cfg.head_dim, cfg.rope_theta, dt)
        for i, layer in enumerate(self.layers):
            k_c, v_c = layer.self_attn.context_kv(ctx, cos_c, sin_c)  # [Hkv, C, d]
            cache.k[i, :, L0:L0 + C] = k_c
            cache.v[i, :, L0:L0 + C] = v_c
        cache.length = L0 + C

    def _rope_table(self, cache: DraftCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_tables of positions 0..n-1, built once per cache (a captured round reads it in place); a
        row is the same bits as rope_tables of that position alone (elementwise in the position)."""
        key = (n, self.dtype, self.cfg.head_dim, self.cfg.rope_theta)
        held = cache.__dict__.get("_rope_table")
        if held is None or held[0] != key:
            cfg = self.cfg
            held = (key, rope_tables(torch.arange(n, device=self.device), cfg.head_dim, cfg.rope_theta, self.dtype))
            cache.__dict__["_rope_table"] = held
        return held[1]

    @torch.no_grad()
    def propose(self, target: TargetLike, ctx_features: torch.Tensor | None, bonus: torch.Tensor,
                cache: DraftCache, start: int) -> torch.Tensor:
        """Draft logits [B-1, V] (float32) for positions start+1 .. start+B-1.

        bonus: the newest token ([] or [1] long), not yet consumed by the target, at position start.
        """
        B = self.cfg.block_size
        block = torch.full((B,), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        block[:1] = bonus.reshape(1)
        h = self.forward(ctx_features, target.embed(block), cache, start)  # [B, D]
        return target.lm_head(h[1:])  # output k predicts the token at start + k

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: DraftConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", scale: float = 1.0,
               policy: KernelPolicy | None = None) -> "DFlashDrafter":
        """Random weights (fan-in scaled normal; norm weights near 1), deterministic in ``seed``."""
        model = cls(cfg, dtype=dtype, device=device, policy=policy)
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, p in model.state_dict().items():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                t = torch.randn(p.shape, generator=g) * (scale / math.sqrt(p.shape[-1]))
            tensors[name] = t
        return model.load_weights(tensors.items())

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> "DFlashDrafter":
        """Strict load: every tensor present once, with the expected shape."""
        slots = dict(self.state_dict(keep_vars=True))
        seen: set[str] = set()
        for raw_name, t in tensors:
            name = raw_name
            for pat, rep in _RENAMES:
                name = pat.sub(rep, name)
            if name.startswith(("embed_tokens.", "lm_head.")):
                raise DraftLoadError(f"tensor '{raw_name}': drafters with their own embedding / lm_head are not "
                                     "supported (the target's are shared)")
            if name not in slots:
                raise DraftLoadError(f"tensor '{raw_name}' does not belong to a DFlash drafter with this config")
            dst = slots[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise DraftLoadError(f"tensor '{raw_name}': expected shape {tuple(dst.shape)}, found {tuple(t.shape)}")
            with torch.no_grad():
                dst.copy_(t.to(dst.dtype))
            seen.add(name)
        missing = sorted(set(slots) - seen)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise DraftLoadError(f"missing drafter tensors: {', '.join(missing[:5])}{more}")
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path, target_cfg: ModelConfig | None = None, *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        policy: KernelPolicy | None = None) -> "DFlashDrafter":
        """Load a drafter directory (config.json + model.safetensors, or sharded with an index).

        With ``target_cfg`` the fit is checked before any weight is read (DraftMismatchError).
        """
        path = Path(path)
        cfg = DraftConfig.from_pretrained(path)
        if target_cfg is not None:
            check_draft_fits(cfg, target_cfg)
        files = sorted(path.glob("*.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if not files:
            raise DraftLoadError(f"no *.safetensors file in {path}")

        def stream() -> Iterable[tuple[str, torch.Tensor]]:
            for f in files:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():
                        yield k, sf.get_tensor(k)

        return cls(cfg, dtype=dtype, device=device, policy=policy).load_weights(stream())


def check_draft_fits(cfg: DraftConfig, tcfg: ModelConfig) -> None:
    """Raise DraftMismatchError when a drafter cannot serve this target."""
    if cfg.hidden_size != tcfg.hidden_size:
        raise DraftMismatchError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size {tcfg.hidden_size} "
            "(the drafter uses the target's embedding and lm_head)")
    if cfg.vocab_size is not None and cfg.vocab_size != tcfg.vocab_size:
        raise DraftMismatchError(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {tcfg.vocab_size}")
    if cfg.mask_token_id >= tcfg.vocab_size:
        raise DraftMismatchError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target vocabulary ({tcfg.vocab_size})")
    if cfg.num_target_layers is not None and cfg.num_target_layers != tcfg.num_hidden_layers:
        raise DraftMismatchError(
            f"drafter was trained for a target with num_target_layers {cfg.num_target_layers}; "
            f"this target has {tcfg.num_hidden_layers}")
    if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
        raise DraftMismatchError(
            f"drafter target_layer_ids {list(cfg.target_layer_ids)} reach past the target's "
            f"{tcfg.num_hidden_layers} layers")


def save_drafter(path: str | Path, drafter: DFlashDrafter) -> Path:
    """Write config.json + model.safetensors in the released layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.cfg.to_dict(), indent=2))
    # k/v may be views of one stacked weight (layers.stacked_linear): storable copies them apart
    save_file(storable(drafter.state_dict()), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
