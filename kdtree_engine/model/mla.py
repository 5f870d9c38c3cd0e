"""Multi-head latent attention (MLA), DeepSeek-V3 / K2.

Two forms with the same math:
  naive     (a prompt step): up-project the latents with kv_b_proj, ordinary causal attention over
            [T, N, P+R] keys and [T, N, V] values.
  absorbed  (decode, tree verify, chunks over a cached prefix): W_UK folded into the query, the
            576-wide latent cache read as keys and (its first 512) as values, W_UV after.
The chunks of a prompt longer than one prefill chunk take either form by cost, over key blocks (prefill.py).
Notation: N heads, P qk_nope, R qk_rope, V v_head, C kv_lora_rank, S cached tokens, T new tokens.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.dispatch import (head_matmul, latent_write, mla_attention, mla_attention_slots, mla_attention_static,
                                naive_prefill_attention, naive_prefill_prompts, prefill_attention_backend,
                                prompts_one_launch, rope_heads, slot_attention_one_launch)
from ..kernels.paged import gather_slots
from ..kernels.streams import fan_out
from .context import BatchContext, SlotTensors, StepContext
from .prefill import KEY_BLOCK, absorbed_chunk
from ..kernels.policy import KernelPolicy, policy_or_env
from .layers import GroupOf, Linear, RMSNorm, dense_only, stacked_linear, stacked_weights


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, group_of: GroupOf = dense_only,
                 policy: KernelPolicy | None = None, parts: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy = policy = policy_or_env(policy)
        # parts > 1: this rank's heads of a tensor-parallel model; the output (o_proj) is a partial sum over ranks
        self.n_heads = cfg.num_attention_heads // parts
        N, P, R, V, C = self.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        H = cfg.hidden_size
        lin = dict(dtype=dtype, policy=policy)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, N * (P + R), parallel="column", group_size=group_of("q_proj"), **lin)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, group_size=group_of("q_a_proj"), **lin)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, policy=policy)
            self.q_b_proj = Linear(cfg.q_lora_rank, N * (P + R), parallel="column", group_size=group_of("q_b_proj"),
                                   **lin)
        self.kv_a_proj_with_mqa = Linear(H, C + R, group_size=group_of("kv_a_proj_with_mqa"), **lin)
        self.kv_a_layernorm = RMSNorm(C, cfg.rms_norm_eps, policy=policy)
        self.kv_b_proj = Linear(C, N * (P + V), parallel="column", group_size=group_of("kv_b_proj"), **lin)
        self.o_proj = Linear(N * V, H, parallel="row", group_size=group_of("o_proj"), **lin)
        self.scale = cfg.softmax_scale
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N, P, C] and W_UV [N, V, C] split from kv_b_proj (built once after loading)."""
        if self._absorbed is None or self._absorbed[0].device != self.kv_b_proj.device:
            cfg = self.cfg
            w = self.kv_b_proj.dense_weight().view(self.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            self._absorbed = (w[:, : cfg.qk_nope_head_dim].contiguous(), w[:, cfg.qk_nope_head_dim:].contiguous())
        return self._absorbed

    def derived_weights(self) -> list[torch.Tensor]:
        """Tensors derived from the weights and cached: the absorbed W_UK / W_UV and the stacked down-projections
        (a captured graph reads them; a reload replaces them)."""
        return stacked_weights(self) + ([] if self._absorbed is None else [self._absorbed[0]])

    def reset_absorbed(self) -> None:
        self._absorbed = None
        self.__dict__.pop("_down", None)

    def forward(self, x: torch.Tensor, ctx: StepContext | BatchContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, H]; kv_cache [num_blocks, BLOCK, C+R]: this layer's pool, the request's slots read through ctx.table.
        Writes the T new latents to ctx.slots (pool rows ctx.rows); a prompt step
        attends in the naive form, every other step in the absorbed form over the committed prefix and the
        block (ctx.tree_mask: ancestor-or-self, None for causal); a chunk of a long prompt (ctx.chunk) attends
        over its prefix and itself in key blocks, in the form the chunk plan chose (prefill.py). A batch of
        requests (BatchContext) projects all rows at once and attends per request. Returns [T, H]."""
        T = x.shape[0]
        q_nope, q_pe = self._project(x, ctx, kv_cache)
        if isinstance(ctx, BatchContext) and all(p.chunk is None and not p.prompt for p in ctx.parts):
            o = self._absorbed_form(q_nope, q_pe, kv_cache, list(ctx.spans()), ctx.slots)
        elif isinstance(ctx, BatchContext):
            o = self._parts(q_nope, q_pe, kv_cache, ctx)
        else:
            o = self._attention(q_nope, q_pe, kv_cache, ctx)
        return self.o_proj(o.reshape(T, -1))

    def _parts(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, ctx: BatchContext
               ) -> torch.Tensor:
        """Each part's attention as its solo step's, in row order -> [T, N, V]; the batch's whole prompts (two or
        more) in one launch where the prefill kernel takes them all (each prompt's rows those of its own launch)."""
        cfg, prompts = self.cfg, ctx.prompts
        P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
        together: dict[int, torch.Tensor] = {}
        if prompts is not None and prompts_one_launch(self.policy, q_nope, self.n_heads, P + V, max(prompts.lengths)):
            lat = kv_cache.flatten(0, 1).index_select(0, prompts.rows)
            o = naive_prefill_prompts(self.policy, q_nope.index_select(0, prompts.index),
                                      q_pe.index_select(0, prompts.index), lat, self.kv_b_proj, prompts.lengths,
                                      self.scale, cfg.kv_lora_rank, V, prompts.tiles)
            together = dict(zip(prompts.firsts, o.split(prompts.lengths)))
        return torch.cat([together[a] if a in together else self._attention(q_nope[a:b], q_pe[a:b], kv_cache, part)
                          for part, a, b in ctx.spans()])

    def _attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   ctx: StepContext) -> torch.Tensor:
        """One request's attention over its cache -> [T, N, V] (the form chosen as :meth:`forward` says)."""
        if ctx.chunk is not None:
            return self._chunk(q_nope, q_pe, kv_cache, ctx)
        if ctx.prompt:
            new = gather_slots(kv_cache, ctx.table, q_nope.shape[0])
            return self._naive(q_nope, q_pe, new)
        return self._absorbed_form(q_nope, q_pe, kv_cache, [(ctx, 0, q_nope.shape[0])])

    def _absorbed_form(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                       spans: list[tuple[StepContext, int, int]], slots: SlotTensors | None = None) -> torch.Tensor:
        """The absorbed form of one or more requests' rows (spans: each request's step, first row, end row) -> [T, N, V]:
        the head products over all rows at once (row-wise: a row's result as alone), each request's attention over
        its own cache, side by side on streams; static slots of one query each (``slots``), where the kernels allow,
        in one launch for all of them."""
        w_uk, w_uv = self.absorbed_weights()
        q_lat = head_matmul(self.policy, q_nope, w_uk.transpose(1, 2))  # [T, N, P] x [N, C, P] -> [T, N, C]
        if slots is not None and slots.width == 1 and slot_attention_one_launch(self.policy, q_lat, q_pe, kv_cache):
            o_lat = mla_attention_slots(self.policy, q_lat, q_pe, kv_cache, slots.tables, slots.capacity, slots.starts,
                                        self.scale, self.cfg.kv_lora_rank)
            return head_matmul(self.policy, o_lat, w_uv)
        outs = fan_out(q_nope.device, [partial(self._attend, q_lat[a:b], q_pe[a:b], kv_cache, step)
                                       for step, a, b in spans])
        o_lat = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, N, C]
        return head_matmul(self.policy, o_lat, w_uv)  # [T, N, C] x [N, V, C] -> [T, N, V]

    def _chunk(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, ctx: StepContext
               ) -> torch.Tensor:
        """A prefill chunk over its prefix and itself (slots [0, start+T), read a key block at a time through the
        block table) -> [T, N, V]."""
        C, step = self.cfg.kv_lora_rank, ctx.chunk

        def latents(s0: int, s1: int) -> torch.Tensor:
            return gather_slots(kv_cache, ctx.table, s1, s0)  # [s1-s0, C+R]
        if step.form == "naive":
            return naive_prefill_attention(self.policy, q_nope, q_pe, latents, self.kv_b_proj, ctx.start, self.scale, C,
                                           self.cfg.v_head_dim, step.key_block)
        w_uk, w_uv = self.absorbed_weights()
        q_lat = head_matmul(self.policy, q_nope, w_uk.transpose(1, 2))  # [T, N, C]
        o_lat = absorbed_chunk(q_lat, q_pe, latents, ctx.start, self.scale, C, step.key_block)
        return head_matmul(self.policy, o_lat, w_uv)  # [T, N, V]

    def _attend(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """Absorbed attention: an eager step sizes the launch by its host length over the slots in use, a
        device-resident one reads the length on the device over the whole buffer."""
        C = self.cfg.kv_lora_rank
        if ctx.device_resident:
            return mla_attention_static(self.policy, q_lat, q_pe, kv_cache, ctx.table, ctx.capacity, ctx.start,
                                        ctx.tree_mask, ctx.visible, self.scale, C, ctx.gather_index)
        return mla_attention(self.policy, q_lat, q_pe, kv_cache, ctx.table, ctx.start, ctx.tree_mask, self.scale, C)

    def _project(self, x: torch.Tensor, ctx: StepContext | BatchContext, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> q_nope [T, N, P] (a view), q_pe [T, N, R] (rotated); writes the T new latents
        (normed c_kv | rotated k_pe) to the pool rows ctx.rows of kv_cache. The two down-projections of x (q_a or q, and
        kv_a) run as one GEMM when both are dense."""
        cfg = self.cfg
        T = x.shape[0]
        N, P, R, C = self.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        first = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        down = stacked_linear(self, "_down", (first, self.kv_a_proj_with_mqa))
        if down is None:
            qa, kva = first(x), self.kv_a_proj_with_mqa(x)
        else:
            qa, kva = down(x).split([first.out_features, C + R], dim=-1)
        q = qa if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(qa))
        q = q.view(T, N, P + R)
        norm = self.kv_a_layernorm
        latent_write(self.policy, kva, norm.weight, norm.eps, ctx.cos, ctx.sin, kv_cache.flatten(0, 1), ctx.rows)
        return q[..., :P], rope_heads(self.policy, q, P, ctx.cos, ctx.sin)

    def _naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A whole prompt at once (positions 0..T-1; new [T, C+R] its latents): the Triton prefill kernel on CUDA,
        else the one-shot [N, T, T] form."""
        cfg = self.cfg
        if prefill_attention_backend(self.policy, q_nope) == "triton":
            return naive_prefill_attention(self.policy, q_nope, q_pe, lambda s0, s1: new[s0:s1], self.kv_b_proj, 0,
                                           self.scale, cfg.kv_lora_rank, cfg.v_head_dim, KEY_BLOCK)
        c_kv, k_pe = new[:, :cfg.kv_lora_rank], new[:, cfg.kv_lora_rank:]
        T, N, P = q_nope.shape
        kv = self.kv_b_proj(c_kv).view(T, N, P + cfg.v_head_dim)
        k_nope, v = kv[..., :P], kv[..., P:]  # [T, N, P], [T, N, V]
        scores = (torch.einsum("tnp,snp->nts", q_nope.float(), k_nope.float())
                  + torch.einsum("tnr,sr->nts", q_pe.float(), k_pe.float())) * self.scale  # [N, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q_nope.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        p = scores.softmax(-1)
        return torch.einsum("nts,snv->tnv", p, v.float()).to(q_nope.dtype)  # [T, N, V]
