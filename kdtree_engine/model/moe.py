"""Mixture of experts: sigmoid router (noaux_tc), routed experts through the one ``moe()`` entry,
and the shared expert.

Routed experts are stacked per layer: w13 [E, 2I, H] (rows 0..I-1 gate_proj, I..2I-1 up_proj) and
w2 [E, H, I]; INT4 experts keep the checkpoint layout stacked the same way (``*_packed`` int32
[E, N, K/8], ``*_scale`` [E, N, K/g]); FP8 experts (fp8.py) keep w13 / w2 in float8_e4m3fn with their block
scales ``w13_scale_inv`` [E, 2 ceil(I/bn), ceil(H/bk)] (gate's row blocks, then up's) and ``w2_scale_inv``
[E, ceil(H/bn), ceil(I/bk)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fp8 import FP8_DTYPE, SCALE_DTYPE, Fp8Block, dequantize_fp8
from ..kernels.bf16x3 import split_bf16x3
from ..kernels.dispatch import (dense_matmul, fused_moe_frag, fused_moe_grouped, fused_moe_w4a16, grouped_moe_backend,
                                int4_prepare, route, router_matmul, shared_placement)
from ..kernels.layouts import ENGINE_ORDER, frag_moe_unsupported
from ..kernels.policy import KernelPolicy, policy_or_env
from ..kernels.streams import side_by_side
from ..logs import log_once
from ..quant import dequantize
from .int4_order import checkpoint_int4
from .layers import MLP, GroupOf, dense_only


class Router(nn.Module):
    """gate.weight [E, H] and e_score_correction_bias [E], both kept in float32. ``policy``: the model's kernel
    policy (None: the environment's)."""

    def __init__(self, cfg: ModelConfig, *, policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy = policy_or_env(policy)
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, owned: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids int64 [T, k], topk_weights float32 [T, k]); owned (expert parallel): the rank's own
        routes (local ids, -1 with weight 0 for another rank's experts)."""
        # [T, E] or [S, T, E] split partials, float32
        logits = router_matmul(self.policy, x, self.weight, partials=True, bf16x3=self.bf16x3_parts)
        return route(self.policy, logits, self.e_score_correction_bias, self.cfg, owned)

    def bf16x3_parts(self) -> torch.Tensor:
        """The gate as three bf16 parts [3, E, H] (bf16x3.split_bf16x3) for the tensor-core router: built on
        first use, again when the weight is replaced or written in place (its version), dropped by reset_parts."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.device)
        cached = self.__dict__.get("_bf16x3")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, split_bf16x3(w.detach()))
            self.__dict__["_bf16x3"] = cached
        return cached[1]

    def derived_weights(self) -> list[torch.Tensor]:
        """The cached bf16 parts of the gate (a captured graph reads them; a reload replaces them)."""
        cached = self.__dict__.get("_bf16x3")
        return [] if cached is None else [cached[1]]

    def reset_parts(self) -> None:
        """Drop the derived bf16 parts (after loading new weights)."""
        self.__dict__.pop("_bf16x3", None)


class Experts(nn.Module):
    """The routed experts of a layer. ``group_size``: the INT4 group, the FP8 block (:class:`Fp8Block`) or None (dense
    experts); ``owned`` (expert parallel): the global ids of the experts this rank holds (None: all of them, no
    remapping)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, group_size: int | Fp8Block | None,
                 policy: KernelPolicy | None = None, owned: range | None = None) -> None:
        super().__init__()
        self.policy = policy_or_env(policy)
        E, H, I = cfg.n_routed_experts if owned is None else len(owned), cfg.hidden_size, cfg.moe_intermediate_size
        self.owned = owned
        self.num_experts, self.hidden, self.inter = E, H, I
        # the routes of a token this rank serves on average (all of them without expert parallelism): what the fused
        # kernels plan their programs for, so that one token's few local experts still fill the device
        k = cfg.num_experts_per_tok
        self.plan_topk = k if owned is None else max(1, min(k, -(-k * len(owned) // cfg.n_routed_experts)))
        self.fp8_block = group_size if isinstance(group_size, Fp8Block) else None
        self.group_size = None if self.fp8_block is not None else group_size
        if self.fp8_block is not None:
            b = self.fp8_block
            self.dense_dtype = dtype   # the torch path's dequantized weights
            gate_rows, hk = b.scale_shape(I, H)
            self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, dtype=FP8_DTYPE), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(E, H, I, dtype=FP8_DTYPE), requires_grad=False)
            self.register_buffer("w13_scale_inv", torch.ones(E, 2 * gate_rows, hk, dtype=SCALE_DTYPE))
            self.register_buffer("w2_scale_inv", torch.ones(E, *b.scale_shape(H, I), dtype=SCALE_DTYPE))
        elif group_size is None:
            self.w13 = nn.Parameter(torch.zeros(E, 2 * I, H, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.zeros(E, H, I, dtype=dtype), requires_grad=False)
        else:
            for name, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
                if k % group_size:
                    raise ValueError(f"expert input dim {k} is not a multiple of group size {group_size}")
                self.register_buffer(f"{name}_packed", torch.zeros(E, n, k // 8, dtype=torch.int32))
                self.register_buffer(f"{name}_scale", torch.zeros(E, n, k // group_size, dtype=dtype))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                add: torch.Tensor | None = None, host_reads: bool = True) -> torch.Tensor:
        """ids / weights: the routes as the router gives them for this rank (``Router.forward(x, owned)``: an
        expert-parallel rank's ids local, -1 for another rank's experts)."""
        return moe(x, ids, weights, self, add, host_reads)

    def reset_dense(self) -> None:
        """Drop the CPU path's dequantized experts (after loading new weights)."""
        self.__dict__.pop("_dense_cpu", None)

    def int4_prepare(self, dtype: torch.dtype) -> str:
        """The INT4 kernel family for activations of `dtype`, the words in its order (model/int4_order.py)."""
        return int4_prepare(self.policy, self, dtype, f"MoE experts [{self.num_experts} x (H {self.hidden}, I {self.inter})]",
                       frag_moe_unsupported(self.hidden, self.inter, self.group_size))


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
        add: torch.Tensor | None = None, host_reads: bool = True) -> torch.Tensor:
    """The single MoE entry: x [T, H], ids [T, k], weights [T, k] -> sum_k w * expert(x) [T, H], plus add [T, H]
    (x's dtype: the shared expert's output) where given: the bits of `moe(...) + add` on every path (the GPU
    kernels add it in their top-k sum, saving a launch). host_reads False (a device-resident step): the torch
    path runs every expert instead of reading which ones are hit."""
    if experts.group_size is None and grouped_moe_backend(experts.policy, x, experts.fp8_block) == "triton":
        return fused_moe_grouped(x, experts.w13, experts.w2, ids, weights, add=add,
                                 w13_scale_inv=scale_inv(experts, "w13"), w2_scale_inv=scale_inv(experts, "w2"),
                                 block=experts.fp8_block)
    if experts.group_size is not None:
        kind = experts.int4_prepare(x.dtype)
        if kind == "frag":
            return fused_moe_frag(x, experts.w13_packed, experts.w13_scale, experts.w2_packed,
                                  experts.w2_scale, ids, weights, experts.group_size, add=add,
                                  plan_topk=experts.plan_topk, **ENGINE_ORDER)
        if kind == "triton":
            return fused_moe_w4a16(x, experts.w13_packed, experts.w13_scale, experts.w2_packed,
                                   experts.w2_scale, ids, weights, experts.group_size, add=add)
    if not host_reads:
        log_once(f"moe-static:{x.device.type}:{experts.group_size}",
                 f"MoE in device-resident rounds on {x.device.type}: torch, every expert, zero weight if not routed")
        out = moe_static(x, ids, weights, experts)
    else:
        log_once(f"moe:{x.device.type}:{experts.group_size}", f"MoE on {x.device.type}: torch per-expert loop")
        out = moe_reference(x, ids, weights, experts)
    return out if add is None else out + add


def scale_inv(experts: Experts, name: str) -> torch.Tensor | None:
    """The FP8 block scales of ``name`` (w13 / w2), None for other experts."""
    return getattr(experts, f"{name}_scale_inv") if experts.fp8_block is not None else None


def fp8_dense_experts(experts: Experts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's w13 / w2 dequantized to the model dtype (FP8 experts): gate's and up's scale rows are their
    own row blocks, so each half is dequantized with its own grid."""
    b, I, dt = experts.fp8_block, experts.inter, experts.dense_dtype
    half = experts.w13_scale_inv.shape[1] // 2
    w13, s13 = experts.w13[e], experts.w13_scale_inv[e]
    gate = dequantize_fp8(w13[:I], s13[:half], b, dt)
    up = dequantize_fp8(w13[I:], s13[half:], b, dt)
    return torch.cat([gate, up]), dequantize_fp8(experts.w2[e], experts.w2_scale_inv[e], b, dt)


def _expert_weights(experts: Experts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    if experts.fp8_block is not None:
        # The torch path multiplies dense weights: on the CPU dequantize once (same values every call) and keep them.
        if experts.w13.device.type != "cpu":
            return fp8_dense_experts(experts, e)
        dense = experts.__dict__.get("_dense_cpu")
        if dense is None:
            pairs = [fp8_dense_experts(experts, i) for i in range(experts.num_experts)]
            dense = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
            experts.__dict__["_dense_cpu"] = dense
            log_once("moe:cpu-dequant-fp8", "MoE on cpu: FP8 experts dequantized once and kept for the torch path")
        return dense[0][e], dense[1][e]
    if experts.group_size is None:
        return experts.w13[e], experts.w2[e]
    if experts.w13_packed.device.type == "cpu":
        # The CPU path multiplies dense weights: dequantize once (same values every call) and keep them.
        dense = experts.__dict__.get("_dense_cpu")
        if dense is None:
            g = experts.group_size
            dense = (dequantize(*checkpoint_int4(experts, "w13_packed"), g),
                     dequantize(*checkpoint_int4(experts, "w2_packed"), g))
            experts.__dict__["_dense_cpu"] = dense
            log_once("moe:cpu-dequant", "MoE on cpu: INT4 experts dequantized once and kept for the torch path")
        return dense[0][e], dense[1][e]
    g = experts.group_size
    return (dequantize(*checkpoint_int4(experts, "w13_packed", e), g),
            dequantize(*checkpoint_int4(experts, "w2_packed", e), g))


def moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Loop over the experts that are hit (ids outside [0, E) are not); float32 accumulation of the weighted sum."""
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        if e < 0:   # a route served by another rank (parallel/experts.py)
            continue
        pos = (flat == e).nonzero().squeeze(1)  # [n] indices into T*k
        tok = pos // k
        w13, w2 = _expert_weights(experts, e)
        h = dense_matmul(experts.policy, x[tok], w13)  # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = dense_matmul(experts.policy, F.silu(gate) * up, w2)  # [n, H]
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[pos].unsqueeze(1))
    return out.to(x.dtype)


def moe_static(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """:func:`moe_reference` without host reads: every expert runs on every token, weighted by the
    token's routing weight for it (exactly 0 when not routed), added in expert order in float32 as the
    reference adds the experts it hits. Costs E expert passes: for small models and captured rounds."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(experts.num_experts):
        w_e = torch.where(ids == e, weights, torch.zeros_like(weights)).sum(-1)  # [T]; one route per expert
        w13, w2 = _expert_weights(experts, e)
        gate, up = dense_matmul(experts.policy, x, w13).chunk(2, dim=-1)
        y = dense_matmul(experts.policy, F.silu(gate) * up, w2)  # [T, H]
        out += y.float() * w_e.float().unsqueeze(1)
    return out.to(x.dtype)


class MoE(nn.Module):
    """``owned`` / ``parts`` (a tensor-parallel rank): the routed experts it holds and the share of the shared
    expert's width; every rank routes all tokens, the output is then a partial sum over the ranks."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, group_size: int | None,
                 shared_group_of: GroupOf = dense_only, policy: KernelPolicy | None = None,
                 owned: range | None = None, parts: int = 1) -> None:
        super().__init__()
        self.policy = policy = policy_or_env(policy)
        self.gate = Router(cfg, policy=policy)
        self.experts = Experts(cfg, dtype=dtype, group_size=group_size, policy=policy, owned=owned)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype=dtype,
                                   group_of=shared_group_of, policy=policy, parts=parts)
                               if cfg.n_shared_experts > 0 else None)
        self._shared_bytes: int | None = None   # the shared expert's weight bytes (its CUDA placement)

    def forward(self, x: torch.Tensor, host_reads: bool = True) -> torch.Tensor:
        """Router + routed experts and the shared expert are independent until their sum; on CUDA they run
        side by side or one after the other (shared_placement). host_reads: see :func:`moe`."""
        part: dict[str, torch.Tensor] = {}

        def route() -> None:
            part["ids"], part["w"] = self.gate(x, self.experts.owned)

        def experts(add: torch.Tensor | None = None) -> None:
            part["routed"] = self.experts(x, part["ids"], part["w"], add, host_reads)

        def routed() -> None:
            route()
            experts()

        if self.shared_experts is None:
            routed()
            return part["routed"]

        def shared() -> None:
            part["shared"] = self.shared_experts(x)

        place = "side"
        if x.device.type == "cuda":
            if self._shared_bytes is None:
                self._shared_bytes = sum(t.numel() * t.element_size() for t in self.shared_experts.state_dict().values())
            place = shared_placement(self.policy, self._shared_bytes, x.shape[0])
        if place == "side":
            side_by_side(x.device, shared, routed)   # off CUDA: one after the other
        elif place == "after":
            routed()
            shared()
        else:   # the shared expert's output is there before the routed experts: their top-k sum adds it
            if place == "router-side":
                side_by_side(x.device, route, shared)    # the router's small launches beside the shared expert's GEMMs
            else:
                shared()
                route()
            experts(part["shared"])
            return part["routed"]
        return part["routed"] + part["shared"]
