"""Kernel choice: one place, chosen by the weight's format and the device, each choice logged once.

  dense linear   CPU: torch ``F.linear``. CUDA: with batch invariance on (the default), the Triton GEMM
                 whose per-row reduction order does not depend on the number of rows (kernels/gemm.py),
                 else cuBLAS.
  head matmul    the MLA absorption products (q_nope x W_UK, o_lat x W_UV; one small GEMM per head).
                 CPU: torch einsum. CUDA: batch-invariant ``bi_head_linear`` (the same GEMM, one head per
                 grid slice) with batch invariance on, else torch einsum (cuBLAS batched GEMM).
  RMSNorm        CPU: torch. CUDA: the one-program-per-row Triton kernel (kernels/rmsnorm.py) with batch
                 invariance on (torch's reduction launch shape may depend on the row count), else torch.
  W4A16 MoE      CPU: torch per-expert loop. CUDA, bfloat16 activations, group 32, H and I multiples of 64:
                 the fragment-ordered Gluon kernels (kernels/moe_frag.py: the words loaded straight into
                 mma.sync registers; the experts' words are reordered in place once, model/int4_order.py);
                 other CUDA cases: Triton (kernels/moe_w4a16.py).
  W4A16 linear   CPU: dequantize + float32 matmul. CUDA, bfloat16 activations, group 32, rows a multiple of
                 64: the fragment-ordered Gluon kernel (kernels/w4_frag.py: mma.sync programs up to 16 tokens,
                 wgmma programs of 32 / 64 beyond, the same bits; faster than the Triton kernel at every
                 M = 1..256 of the K2 shapes, docs/performance_history.md); other CUDA cases: Triton
                 (kernels/w4a16.py). Every kernel keeps a row's reduction order independent of the number of
                 rows; each choice is logged once per shape with its reason.
  W8A16 linear   (FP8 block-quantized weights, fp8.py) CPU: dequantize + float32 matmul
                 (kernels/reference.py). CUDA, bf16 / fp16 activations: the Triton kernel (kernels/w8a16.py: the FP8
                 tile converted in registers, tensor-core dot, the block scale applied per K tile; split along K
                 from (N, K) only). KDTREE_INT4_BACKEND=torch|triton forces it, as for the INT4 weights.
  grouped MoE    BF16 / FP16 and FP8 routed experts on CUDA: the fused grouped Triton kernels
                 (kernels/moe_grouped.py: pairs sorted by expert, gate/up + SwiGLU in one launch, down with the
                 routing weight in one, the top-k sum; no host read, so device-resident rounds use it too).
                 CPU: the torch per-expert loop. BF16 experts follow KDTREE_DENSE_BACKEND, FP8 experts
                 KDTREE_INT4_BACKEND.
  MLA attention  CUDA with batch invariance on: the Triton kernel (kernels/mla_attention.py, split-KV
                 flash decoding with split sizes fixed by position). Otherwise the torch reference
                 (kernels/reference.py), which is not batch-invariant on CUDA (cuBLAS batched GEMMs).

  static step     (a device-resident step, model/context.py StepContext with the length on the device: a
                 round captured in a CUDA graph, or run eagerly with device-side bookkeeping):
                 MLA attention over all the request's cache slots with the length on the device
                 (:func:`mla_attention_static`: the Triton kernel's device-length launch, or the torch
                 reference with a visibility mask, by the same backend choice); a MoE that would take the torch
                 per-expert loop (which reads the hit experts on the host) runs every expert with a
                 zero weight for tokens not routed to it (model/moe.py, ``host_reads=False``).

  MLA tails      rope of the query heads, and the new latent cache rows (RMSNorm of c_kv | rope of k_pe,
                 written at their pool rows, the slots mapped through the block table). CUDA: one Triton
                 launch each (kernels/rope.py; no FMA, the same
                 bits as torch's separate products and sums; the norm one row per program). CPU: torch
                 (kernels/reference.py apply_rope, the RMSNorm dispatch, index_copy_).

  residual+norm  ``h + d`` followed by RMSNorm (decoder layers of target and drafter): where the RMSNorm is
                 the Triton kernel, one Triton launch writing both (kernels/rmsnorm.py bi_add_rmsnorm; the
                 same bits as the add and the RMSNorm kernel apart); elsewhere torch's add + the RMSNorm
                 dispatch.

  router tail    sigmoid, correction bias, group-limited top-k (ties: lower index first), weights.
                 CUDA: one Triton program per token (kernels/router.py); CPU: torch with stable sorts
                 (kernels/reference.py route_torch).
  router GEMM    float32 logits of the (bf16) hidden state against the float32 gate. CUDA with batch
                 invariance on: the router kernel (kernels/router_gemm.py: the gate block held in
                 registers, tokens looped, the upcast in the load); otherwise torch on x.float().

  shared expert  where the MoE's shared expert runs on CUDA (:func:`shared_placement`, by its weight bytes and
                 the tokens): on a side stream beside the router and routed experts, beside the router alone
                 (up to 8 tokens), or before them on one stream.

  SwiGLU         silu(gate) * up of the dense MLP and the shared expert. CUDA: one elementwise Triton
                 launch (kernels/swiglu.py); CPU: torch.

  drafter q / k  per-head RMSNorm then rotate-half rope (the DFlash drafter's q, block k and context k).
                 CUDA: one Triton program per head row (kernels/head_norm_rope.py); CPU: torch (the
                 RMSNorm dispatch, kernels/reference.py apply_rope_half). The drafter only proposes, so this
                 is about launches, not bits.

  drafter attn   the block's queries over the cached context and the block (GQA, optional sliding window).
                 CUDA: one Triton program per query head (kernels/draft_attention.py; online softmax); CPU:
                 torch (concatenation, GQA repeat, masked sdpa). Only proposes: time, not bits.

  DDTree builder  (device-resident rounds) CUDA: one Triton program (kernels/tree_ops.py); CPU: the
                 vectorized torch builder (speculative/tree.py); the same tree.
  row select     greedy picks (argmax over the vocabulary, ties to the lowest id) and the drafter's top-k
                 log-probs. CUDA: one Triton program per row (kernels/row_select.py; the top-k up to
                 TOPK_MAX_K of TOPK_MAX_V columns, torch beyond, logged); CPU: torch.argmax / torch.topk +
                 logsumexp.

  accept walk    (device-resident rounds) the walk, the accepted order, the emitted tokens, the count and
                 the bonus. CUDA: one Triton program (kernels/accept_walk.py); CPU: the vectorized torch walk
                 (speculative/accept.py + speculative/device_round.py); the same results.

The choices follow one :class:`~kdtree_engine.kernels.policy.KernelPolicy`, built once per engine and passed to
every function here as its first argument: ``batch_invariant`` (the CLI's ``--batch-invariant on|off``,
``LLM(batch_invariant=...)``; on unless turned off) and the forced backends of the ``KDTREE_*_BACKEND``
variables (docs/environment.md): ``int4`` (also ``frag``: the fragment kernels, an error where they do not
apply), ``attn``, ``tree`` (DDTree builder and accept walk), ``dense`` (dense and per-head matmuls, RMSNorm
and residual+norm, MLA tails, router tail, SwiGLU, drafter q / k and attention, row select) = ``torch`` |
``triton`` (tests run the Triton code on the CPU with ``TRITON_INTERPRET=1``); forcing a torch path on CUDA
with batch invariance on is obeyed and logged as a warning (bitwise equality of speculative and plain
decoding then no longer holds).

Every kernel launch from outside kernels/ goes through a function here. The Triton kernel modules are imported
when a choice first names a Triton backend (kernels/loader.py ``triton_kernels``), never on the torch paths: the
CPU runs without triton installed; CUDA (or a forced ``triton``) without it stops at that choice with a one-line
error naming the install (bad input, exit 2).

Everything else in the target forward is per row already: the embedding is a gather, rope and the
activations are elementwise, the router logits go through router_matmul (float32) and the router tail
(selection and a sum over top_k <= 8 values in one row) is per row, the dense-expert MoE path
adds a token's experts in ascending expert order, the fused INT4 MoE sums a token's top-k in slot
order, cos/sin come from a table built once in float64 on the CPU. The naive MLA form (torch einsums)
runs only for the prompt (empty cache, causal), the same forward in speculative and plain decoding.
"""


from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fp8 import Fp8Block
from ..logs import log, log_once
from ..model.prefill import naive_chunk
from ..parallel.experts import owned_routes as owned_routes_torch
from ..model.int4_order import CHECKPOINT, FRAG, checkpoint_int4, int4_words, order_of, set_order
from ..quant import dequantize
from ..speculative.tree import DraftTree, build_tree
from .common import DTYPES, interpreting
from .layouts import ENGINE_ORDER
from .loader import triton_kernels
from .paged import gather_slots
from .policy import KernelPolicy
from .reference import (apply_rope, apply_rope_half, mla_attention_masked, mla_attention_reference, rms_norm_torch,
                        route_torch, topk_logprobs_torch, w8a16_linear_reference, ordered_sum_torch)

# kinds already warned about (a forced torch path on CUDA with batch invariance on): logging only
_WARNED: set[str] = set()


def _backend(kind: str, forced: str | None, device: torch.device, cuda_default: str = "triton") -> str:
    backend = forced or (cuda_default if device.type == "cuda" else "torch")
    log_once(f"{kind}:{device.type}:{backend}", f"{kind} kernels on {device.type}: {backend}")
    if backend == "triton":
        triton_kernels()   # imported at the choice: where triton is missing, its one-line error here
    return backend


def int4_backend(policy: KernelPolicy, device: torch.device) -> str:
    """torch or the GPU kernels ("triton": Triton or, per weight, the Gluon fragment kernels; int4_kernel)."""
    return _backend("W4A16", "triton" if policy.int4 == "frag" else policy.int4, device)


def int4_kernel(policy: KernelPolicy, device: torch.device, dtype: torch.dtype, what: str,
                unsupported: str | None) -> str:
    """The kernel family of one INT4 weight (or expert stack): "torch", "triton" or "frag".
    ``unsupported``: why its shape cannot take the fragment kernels (None: it can)."""
    if int4_backend(policy, device) == "torch":
        return "torch"
    if policy.int4 == "triton":
        return "triton"
    why = ("not on cuda" if device.type != "cuda" else "the interpreter" if interpreting()
           else "triton without gluon" if not triton_kernels().w4_frag.HAVE_GLUON
           else f"{dtype} activations (bfloat16 needed)" if dtype != torch.bfloat16 else unsupported)
    if why:
        if policy.int4 == "frag":
            raise ValueError(f"KDTREE_INT4_BACKEND=frag: the fragment kernels cannot run {what}: {why}")
        log_once(f"int4-kernel:{what}:{why}", f"W4A16 {what}: Triton kernels (fragment kernels not used: {why})")
        return "triton"
    log_once(f"int4-kernel:{what}:frag", f"W4A16 {what}: fragment-ordered Gluon kernels")
    return "frag"


def int4_prepare(policy: KernelPolicy, module: nn.Module, dtype: torch.dtype, what: str,
                 unsupported: str | None) -> str:
    """The module's INT4 kernel family for activations of `dtype` (:func:`int4_kernel`), with its words put in
    the order that family reads (model/int4_order.py); remembered per (dtype, device, policy)."""
    device = getattr(module, int4_words(module)[0][0]).device
    key = (dtype, device, policy)
    cached = module.__dict__.get("_int4_kind")
    if cached is not None and cached[0] == key and order_of(module) == (FRAG if cached[1] == "frag" else CHECKPOINT):
        return cached[1]
    kind = int4_kernel(policy, device, dtype, what, unsupported)
    set_order(module, FRAG if kind == "frag" else CHECKPOINT)
    module.__dict__["_int4_kind"] = (key, kind)
    return kind


def prepare_int4(model: nn.Module, dtype: torch.dtype) -> None:
    """Put every INT4 module's words in the order its kernel reads, before any forward (so the one-off
    in-place reorder never lands inside a CUDA-graph capture)."""
    for m in model.modules():
        if int4_words(m):
            m.int4_prepare(dtype)


def _invariant_backend(policy: KernelPolicy, kind: str, forced: str | None, device: torch.device) -> str:
    """Triton on CUDA when batch invariance is on, torch otherwise; a forced torch backend on CUDA with
    batch invariance on is obeyed, with a warning (the torch path is not batch-invariant there)."""
    backend = _backend(kind, forced, device, cuda_default="triton" if policy.batch_invariant else "torch")
    if device.type == "cuda" and policy.batch_invariant and backend == "torch" and kind not in _WARNED:
        _WARNED.add(kind)
        log.warning(f"{kind}: the torch path is forced on cuda with batch invariance on; it is not batch-"
                    "invariant there, so speculative output may differ from plain decoding in the last bits "
                    "(near-ties can flip tokens)")
    return backend


def dense_backend(policy: KernelPolicy, device: torch.device) -> str:
    """Dense and per-head matmuls and RMSNorm: the batch-invariant Triton kernels or torch."""
    return _invariant_backend(policy, "dense (GEMM, per-head GEMM, RMSNorm)", policy.dense, device)


def training(*tensors: torch.Tensor) -> bool:
    """Autograd or autocast is active for these operands (drafter training): the Triton kernels have no
    backward and want equal dtypes, so torch runs them (logged once)."""
    dev = tensors[0].device
    busy = torch.is_autocast_enabled(dev.type) or (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    if busy:
        log_once(f"dense:training:{dev.type}", f"dense kernels on {dev.type}: torch where autograd or autocast "
                 "is active (training; the batch-invariant Triton kernels have no backward)")
    return busy


def use_triton(policy: KernelPolicy, *tensors: torch.Tensor) -> bool:
    """The dense family's Triton kernels for these operands (not in training)."""
    return dense_backend(policy, tensors[0].device) == "triton" and not training(*tensors)


def dense_matmul(policy: KernelPolicy, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] for dense weights (same dtype)."""
    if use_triton(policy, x, w):
        return triton_kernels().gemm.bi_linear(x, w)
    return F.linear(x, w)


# Where the shared expert runs on CUDA (the same kernels and sum either way, so the same bits): "before" the
# router and routed experts on the same stream, "after" them, "side": on a side stream beside them, or
# "router-side": the router (its GEMM and top-k launches) on a side stream beside the shared expert, the routed
# experts after both. A small shared expert leaves most SMs idle, so it runs beside the rest; a large one
# contends with the routed kernels (sized for the whole GPU), so only the router's small launches go beside it,
# and only for few tokens (docs/performance_history.md has the measurements).
SHARED_SIDE_BYTES = 16 << 20
ROUTER_SIDE_MAX_T = 8


def shared_placement(policy: KernelPolicy, shared_bytes: int, tokens: int) -> str:
    """Where a shared expert of this many weight bytes runs on CUDA for a launch of `tokens` tokens (above);
    logged once per choice. ``policy.shared_placement`` forces one (tests compare the placements)."""
    if policy.shared_placement is not None:
        log_once(f"moe-shared:{policy.shared_placement}",
                 f"MoE on cuda: the shared expert placed '{policy.shared_placement}' (forced by the kernel policy)")
        return policy.shared_placement
    if shared_bytes < SHARED_SIDE_BYTES:
        place, why = "side", "on a side stream beside the router and routed experts"
    elif tokens <= ROUTER_SIDE_MAX_T:
        place, why = "router-side", (f"beside the router (a side stream), then the routed experts (up to "
                                     f"{ROUTER_SIDE_MAX_T} tokens)")
    else:
        place, why = "before", f"before the router and routed experts on one stream (over {ROUTER_SIDE_MAX_T} tokens)"
    log_once(f"moe-shared:{place}", f"MoE on cuda: the shared expert ({shared_bytes / 2**20:.1f} MB of weights) {why} "
             f"(a side stream for all under {SHARED_SIDE_BYTES >> 20} MB)")
    return place


def router_matmul(policy: KernelPolicy, x: torch.Tensor, w: torch.Tensor, partials: bool = False,
                  bf16x3: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """Router logits: x [M, K] (any float dtype) @ w [N, K].T (float32) -> [M, N] float32. partials: split
    partials [S, M, N] where a kernel makes them (their sum in split order is the logits; `route` takes either),
    else the logits. bf16x3: returns the gate's bf16 parts [3, N, K] (bf16x3.split_bf16x3, built once by
    the owner), the operand of the tensor-core router, taken for bfloat16 activations; other activations take
    the float32 FMA router kernel (each its own bits)."""
    if not use_triton(policy, x, w):
        return F.linear(x.float(), w)
    kernels = triton_kernels()
    if x.dtype != torch.bfloat16 or bf16x3 is None:
        log_once(f"router-gemm:router:{x.dtype}", f"router GEMM for {x.dtype} activations: the float32 FMA router "
                 "kernel (automatic: bf16x3 for bfloat16 with the gate's parts, else the FMA kernel)")
        return kernels.router_gemm.router_logits(x, w, partials=partials)
    log_once(f"router-gemm:bf16x3:{x.dtype}", f"router GEMM for {x.dtype} activations: the float32 gate as three "
             "bf16 parts on the tensor cores (automatic: bf16x3 for bfloat16, else the FMA kernel)")
    parts = kernels.router_gemm.router_logits_bf16x3(x, bf16x3())
    if partials:
        return parts
    logits = torch.empty(parts.shape[1:], device=x.device, dtype=torch.float32)
    if logits.numel():   # the partials in index order, as the router tail adds them
        kernels.split_sum.split_sum(parts, logits, parts.shape[0], pdl=kernels.pdl.pdl_supported(x.device))
    return logits


def head_matmul(policy: KernelPolicy, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head product x [T, B, K], w [B, N, K] (any strides) -> [T, B, N]: out[t, b] = x[t, b] @ w[b].T."""
    if use_triton(policy, x, w):
        return triton_kernels().gemm.bi_head_linear(x, w)
    return torch.einsum("tbk,bnk->tbn", x, w)


def rms_norm(policy: KernelPolicy, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, HF convention (reference.rms_norm_torch)."""
    if use_triton(policy, x, weight):
        return triton_kernels().rmsnorm.bi_rmsnorm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(policy: KernelPolicy, h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = h + d (the residual stream and the next sublayer's input)."""
    if use_triton(policy, h, d, weight):
        return triton_kernels().rmsnorm.bi_add_rmsnorm(h, d, weight, eps)
    s = h + d
    return s, rms_norm(policy, s, weight, eps)


def _elementwise_backend(policy: KernelPolicy, kind: str, device: torch.device, *tensors: torch.Tensor) -> bool:
    """Per-row Triton kernels that replace several torch launches (router tail, SwiGLU): Triton on CUDA
    whether batch invariance is on or off (they are per row either way), torch on the CPU and in training."""
    return _backend(kind, policy.dense, device) == "triton" and not training(*tensors)


def ordered_sum(policy: KernelPolicy, parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts [N, ...] added in index order in float32 -> [...] in ``dtype``: the cross-rank sum's fixed order
    (parallel/comm.py). CUDA: one launch (kernels/split_sum.py); elsewhere the torch loop, the same additions."""
    if _elementwise_backend(policy, "ordered sum (cross-rank partials)", parts.device, parts):
        out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
        triton_kernels().split_sum.split_sum(parts.contiguous(), out, parts.shape[0])
        return out
    return ordered_sum_torch(parts).to(dtype)


def route(policy: KernelPolicy, logits: torch.Tensor, bias: torch.Tensor,
          cfg: ModelConfig, owned: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router tail: logits [T, E] float32, or split-K partials [S, T, E] (router_matmul partials=True: summed in
    split order, the bits of the logits) -> (expert ids int64 [T, k], weights float32 [T, k]); owned (expert
    parallel): the rank's own routes (parallel/experts.py owned_routes), made in the same launch on CUDA."""
    if _elementwise_backend(policy, "router tail (sigmoid, group top-k, weights)", logits.device, logits):
        return triton_kernels().router.route_triton(logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                            cfg.norm_topk_prob, cfg.routed_scaling_factor, owned)
    ids, w = route_torch(logits, bias, cfg)
    return (ids, w) if owned is None else owned_routes_torch(ids, w, owned)


def silu_mul(policy: KernelPolicy, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise (SwiGLU)."""
    if _elementwise_backend(policy, "SwiGLU (silu(gate) * up)", gate.device, gate, up):
        return triton_kernels().swiglu.silu_mul(gate, up)
    return F.silu(gate) * up


def head_norm_rope(policy: KernelPolicy, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half rope (the drafter's q / k): x [T, H, d], cos / sin [T, d]."""
    if _elementwise_backend(policy, "drafter head norm + rope", x.device, x, weight):
        return triton_kernels().head_norm_rope.head_norm_rope(x, weight, eps, cos, sin)
    return apply_rope_half(rms_norm(policy, x, weight, eps), cos, sin)


def draft_attention_backend(policy: KernelPolicy, q: torch.Tensor, k: torch.Tensor) -> str:
    """The drafter's attention (block queries over the cached context + the block): one Triton launch on
    CUDA (kernels/draft_attention.py), else torch (model/dflash.py: concatenation, GQA repeat, masked sdpa)."""
    return "triton" if _elementwise_backend(policy, "drafter attention", q.device, q, k) else "torch"


def draft_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                    start: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The drafter attention's Triton launch (kernels/draft_attention.py), where draft_attention_backend chose it."""
    return triton_kernels().draft_attention.draft_attention(q, k_ctx, v_ctx, kb, vb, start, window)


def mla_tail_backend(policy: KernelPolicy, device: torch.device) -> str:
    """Rope of the query heads and the latent cache write: Triton on CUDA (batch invariance on or off:
    the kernels are per row), torch on the CPU."""
    return _backend("MLA tails (query rope, latent cache write)", policy.dense, device)


def rope_heads(policy: KernelPolicy, q: torch.Tensor, nope: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """q [T, N, nope + R] -> rope(q[..., nope:]) [T, N, R] (reference.apply_rope)."""
    if mla_tail_backend(policy, q.device) == "triton" and not training(q):
        return triton_kernels().rope.rope_heads(q, nope, cos, sin)
    return apply_rope(q[..., nope:], cos, sin)


def latent_write(policy: KernelPolicy, kva: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """kv[slots[t]] = [rmsnorm(kva[t, :C]) | rope(kva[t, C:])]: the T new latent cache rows of a layer."""
    if mla_tail_backend(policy, kv.device) == "triton" and not training(kva):
        triton_kernels().rope.latent_write(kva, norm_weight, eps, cos, sin, kv, slots)
        return
    C = norm_weight.shape[0]
    row = torch.cat([rms_norm(policy, kva[:, :C], norm_weight, eps), apply_rope(kva[:, C:], cos, sin)], dim=-1)
    kv.index_copy_(0, slots, row.to(kv.dtype))


def w4a16_matmul_reference(policy: KernelPolicy, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/8], scale [N, K/g]).T -> [M, N], float32 accumulate (through
    dense_matmul, so batch-invariant on CUDA when that is on)."""
    w = dequantize(packed, scale, group_size, torch.float32)  # [N, K]
    return dense_matmul(policy, x.float(), w).to(x.dtype)


def w4a16_matmul(policy: KernelPolicy, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """x [M, K] @ the INT4 weight of ``layer`` (model.layers.Linear) -> [M, N]."""
    kind = layer.int4_prepare(x.dtype)
    if kind == "frag":
        return triton_kernels().w4_frag.frag_linear(x.to(torch.bfloat16), layer.weight_packed, layer.weight_scale,
                                                    **ENGINE_ORDER)
    if kind == "triton":
        return triton_kernels().w4a16.w4a16_linear(x, layer.weight_packed, layer.weight_scale, layer.group_size)
    return w4a16_matmul_reference(policy, x, *checkpoint_int4(layer, "weight_packed"), layer.group_size)


def fused_moe_frag(x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor,
                   w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, group_size: int,
                   *, add: torch.Tensor | None = None, tile: int = 0, stile: int = 0,
                   plan_topk: int | None = None) -> torch.Tensor:
    """The routed experts on the fragment-ordered Gluon kernels (kernels/moe_frag.py), where the experts'
    int4_prepare chose "frag" (model/moe.py); plan_topk: an expert-parallel rank's share of a token's routes."""
    return triton_kernels().moe_frag.fused_moe_frag(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights,
                                                    group_size, add=add, tile=tile, stile=stile, plan_topk=plan_topk)


def fused_moe_w4a16(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                    w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, group_size: int,
                    *, add: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts on the Triton W4A16 kernels (kernels/moe_w4a16.py), where the experts' int4_prepare
    chose "triton" (model/moe.py)."""
    return triton_kernels().moe_w4a16.fused_moe_w4a16(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids,
                                                      topk_weights, group_size, add=add)


def quantized_forced(policy: KernelPolicy) -> str | None:
    """The forced backend of the quantized-weight kernels (KDTREE_INT4_BACKEND: torch / triton; "frag" names
    an INT4 family only)."""
    return policy.int4 if policy.int4 in ("torch", "triton") else None


def w8a16_backend(policy: KernelPolicy, x: torch.Tensor) -> str:
    """FP8 block-quantized linears: the Triton W8A16 kernel on CUDA for bf16 / fp16 activations (fp32 ones run
    the torch reference there, logged), torch on the CPU."""
    backend = _backend("W8A16 (FP8 weights)", quantized_forced(policy), x.device)
    if backend == "triton" and x.dtype == torch.float32 and not interpreting():
        log_once(f"w8a16:fp32:{x.device.type}", "W8A16 with float32 activations: torch reference (the kernel "
                 "takes bf16 / fp16)")
        return "torch"
    return backend


def w8a16_matmul(policy: KernelPolicy, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: Fp8Block) -> torch.Tensor:
    """x [M, K] @ the FP8 weight [N, K] with its block scales -> [M, N] in x's dtype."""
    if w8a16_backend(policy, x) == "triton" and not training(x):
        return triton_kernels().w8a16.w8a16_linear(x, weight, scale_inv, block)
    return w8a16_linear_reference(x, weight, scale_inv, block)


def grouped_moe_backend(policy: KernelPolicy, x: torch.Tensor, block: Fp8Block | None) -> str:
    """BF16 / FP16 (block None) or FP8 routed experts: "triton" (the fused grouped kernels, kernels/moe_grouped.py)
    or "torch" (model/moe.py's per-expert loop, or every expert in device-resident steps)."""
    if block is None:
        backend = _backend("grouped MoE (dense experts)", policy.dense, x.device)
    else:
        backend = _backend("grouped MoE (FP8 experts)", quantized_forced(policy), x.device)
    if backend == "triton" and x.dtype == torch.float32 and not interpreting():
        log_once(f"grouped-moe:fp32:{x.device.type}", "MoE with float32 activations: torch (the grouped kernel "
                 "takes bf16 / fp16 on the GPU)")
        return "torch"
    return "torch" if backend == "triton" and training(x) else backend


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, *, add: torch.Tensor | None = None,
                      w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
                      block: Fp8Block | None = None) -> torch.Tensor:
    """BF16 / FP16 or FP8 routed experts on the fused grouped kernels (kernels/moe_grouped.py), where
    :func:`grouped_moe_backend` chose "triton" (model/moe.py)."""
    return triton_kernels().moe_grouped.fused_moe_grouped(x, w13, w2, topk_ids, topk_weights, add=add,
                                                          w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv,
                                                          block=block)


def attn_backend(policy: KernelPolicy, device: torch.device) -> str:
    """Triton on CUDA when batch invariance is on (the torch reference is not invariant), else torch."""
    return _invariant_backend(policy, "MLA attention", policy.attn, device)


def prefill_kernel_on(policy: KernelPolicy, device: torch.device) -> bool:
    """Whether the naive-form prefill attention runs on its Triton kernel there: on CUDA whatever the batch invariance
    (the kernel is both invariant and the fastest); torch on the CPU or when forced (KDTREE_ATTN_BACKEND)."""
    return _backend("MLA prefill attention", policy.attn, device) == "triton"


def prefill_attention_backend(policy: KernelPolicy, q: torch.Tensor) -> str:
    """The naive-form prefill attention of queries q: :func:`prefill_kernel_on`, torch under autograd (no backward)."""
    return "triton" if prefill_kernel_on(policy, q.device) and not training(q) else "torch"


def naive_prefill_attention(policy: KernelPolicy, q_nope: torch.Tensor, q_pe: torch.Tensor,
                            latents: Callable[[int, int], torch.Tensor], expand: Callable[[torch.Tensor], torch.Tensor],
                            start: int, scale: float, kv_lora_rank: int, v_head_dim: int,
                            key_block: int) -> torch.Tensor:
    """Causal naive-form attention of a prompt chunk (queries at start..start+T-1) over keys 0..start+T-1 ->
    [T, N, V]: kernels/prefill_attention.py, or model/prefill.py's key-blocked torch path (``key_block`` keys a
    step)."""
    if prefill_attention_backend(policy, q_nope) == "triton":
        return triton_kernels().prefill_attention.naive_prefill(q_nope, q_pe, latents, expand, start, scale,
                                                                kv_lora_rank, v_head_dim)
    return naive_chunk(q_nope, q_pe, latents, start, scale, kv_lora_rank, expand, key_block)


def prompts_one_launch(policy: KernelPolicy, q_nope: torch.Tensor, n_heads: int, width: int, longest: int) -> bool:
    """Whether a batch's whole prompts attend in one launch (:func:`naive_prefill_prompts`) rather than a launch a
    prompt (logged once either way): the prefill kernel runs and each prompt takes one key range."""
    if prefill_attention_backend(policy, q_nope) != "triton":
        why: str | None = "the torch prefill attention"
    elif not triton_kernels().prefill_attention.prompts_fit(n_heads, width, q_nope.dtype, longest):
        why = "a prompt past one key range"
    else:
        why = None
    how = "one launch for all of them" if why is None else f"a launch a prompt ({why})"
    log_once(f"prefill-prompts:{q_nope.device.type}:{how}", f"a batch's whole prompts: naive-form attention in {how}")
    return why is None


def naive_prefill_prompts(policy: KernelPolicy, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                          expand: Callable[[torch.Tensor], torch.Tensor], lengths: list[int], scale: float,
                          kv_lora_rank: int, v_head_dim: int, tiles: torch.Tensor) -> torch.Tensor:
    """Whole prompts (rows concatenated, latents ``lat`` row for row) in one launch of the prefill kernel, where
    :func:`prompts_one_launch` holds: each prompt's rows those of its own launch. ``tiles``: :func:`prompt_tiles`."""
    del policy   # the caller checked prompts_one_launch
    return triton_kernels().prefill_attention.naive_prefill_prompts(q_nope, q_pe, lat, expand, lengths, scale,
                                                                    kv_lora_rank, v_head_dim, tiles)


def prompt_tiles(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The programs of :func:`naive_prefill_prompts` over prompts of these lengths (made once a forward)."""
    return triton_kernels().prefill_attention.prompt_tiles(lengths, device)


def mla_attention(policy: KernelPolicy, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                  table: torch.Tensor, start: int, tree_mask: torch.Tensor | None, scale: float,
                  kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache + the new block: slots [0, start + T) of the request whose
    block table is ``table``, in the pool layer kv [num_blocks, BLOCK, C+R]; see
    reference.mla_attention_reference (the torch path runs it on those slots gathered contiguous)."""
    if attn_backend(policy, kv.device) == "triton":
        return triton_kernels().mla_attention.mla_attention(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank,
                                                            table=table)
    return mla_attention_reference(q_lat, q_pe, gather_slots(kv, table, start + q_lat.shape[0]), start, tree_mask,
                                   scale, kv_lora_rank)


def mla_attention_static(policy: KernelPolicy, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                         table: torch.Tensor, capacity: int, start: torch.Tensor, tree_mask: torch.Tensor,
                         visible: torch.Tensor | None, scale: float, kv_lora_rank: int,
                         gather_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Absorbed MLA attention over all ``capacity`` slots of a request (block table ``table`` into the pool layer
    kv [num_blocks, BLOCK, C+R]) with the committed length
    ``start`` on the device: the Triton kernel's device-length launch (same reduction as the host-length
    one), or the torch reference with the visibility mask ``visible`` [T, S_cap] (None: the Triton path).
    ``gather_index``: the Triton kernel's :func:`attention_gather_index` of ``tree_mask``, computed once for all
    layers (else per call)."""
    if attn_backend(policy, kv.device) == "triton":
        return triton_kernels().mla_attention.mla_attention_device(q_lat, q_pe, kv, start, tree_mask, scale,
                                                                   kv_lora_rank, gather_index=gather_index,
                                                                   table=table, capacity=capacity)
    if visible is None:
        raise ValueError("the torch MLA attention of a static step needs the visibility mask")
    return mla_attention_masked(q_lat, q_pe, gather_slots(kv, table, capacity), visible, scale, kv_lora_rank)


def slot_attention_one_launch(policy: KernelPolicy, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the one-query steps of a batch's static slots attend in one launch for all slots
    (:func:`mla_attention_slots`) rather than a launch per request (logged once either way)."""
    if attn_backend(policy, kv.device) != "triton":
        why: str | None = "the torch attention"
    else:
        why = triton_kernels().mla_attention.slots_unsupported(q_lat, q_pe, kv)
    how = "one launch for all slots" if why is None else f"a launch per request ({why})"
    log_once(f"mla-slots:{kv.device.type}:{how}", f"batched one-query steps: MLA attention in {how}")
    return why is None


def mla_attention_slots(policy: KernelPolicy, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                        tables: torch.Tensor, capacity: int, starts: torch.Tensor, scale: float,
                        kv_lora_rank: int) -> torch.Tensor:
    """One query per slot, slot b over ``capacity`` slots of the pool layer kv through tables[b] with its committed
    length starts[b] on the device, in one launch (where :func:`slot_attention_one_launch` holds): each slot's rows
    those of :func:`mla_attention_static` on its query alone."""
    del policy   # the caller checked slot_attention_one_launch
    return triton_kernels().mla_attention.mla_attention_slots(q_lat, q_pe, kv, tables, capacity, starts, scale,
                                                              kv_lora_rank)


def attention_gather_index(policy: KernelPolicy, tree_mask: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What every layer's static attention derives from the step's tree mask (the Triton kernel's per-query
    visible-slot index), built once per forward; None for the torch path (it uses the visibility mask)."""
    if attn_backend(policy, tree_mask.device) == "triton":
        return triton_kernels().mla_attention.tree_gather_index(tree_mask)
    return None


def build_draft_tree(policy: KernelPolicy, lp: torch.Tensor, ids: torch.Tensor, budget: int,
                     root_token: torch.Tensor, start: torch.Tensor) -> DraftTree:
    """The DDTree of a device-resident round (no host read): CUDA: one Triton program
    (kernels/tree_ops.py); CPU: the vectorized torch builder (speculative/tree.py). Identical trees."""
    if _backend("DDTree builder (device rounds)", policy.tree, lp.device) == "triton":
        return triton_kernels().tree_ops.build_tree_triton(lp, ids, budget, root_token, start)
    return build_tree(lp, ids, budget, root_token, start)


def row_argmax(policy: KernelPolicy, x: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis, ties to the lowest index (greedy picks): [..., V] -> [...] long. CUDA: one
    Triton program per row (kernels/row_select.py; torch.argmax's result); CPU: torch.argmax."""
    if x.dim() >= 1 and x.numel() and x.dtype in DTYPES and _elementwise_backend(
            policy, "row argmax (greedy picks)", x.device, x):
        rows = x.reshape(-1, x.shape[-1])
        argmax_rows = triton_kernels().row_select.argmax_rows
        return argmax_rows(rows if rows.stride(-1) == 1 else rows.contiguous()).reshape(x.shape[:-1])
    return torch.argmax(x, dim=-1)


def draft_topk(policy: KernelPolicy, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's per-position top-k log-probs: logits [L, V] -> (lp [L, k'] float32 descending, ids
    [L, k'] long), k' = min(k, V). CUDA with V <= TOPK_MAX_V and k' <= TOPK_MAX_K: one Triton program per row
    (kernels/row_select.py, ties to the lower id); otherwise torch (reference.topk_logprobs_torch: topk +
    logsumexp), logged."""
    V = logits.shape[-1]
    if logits.dim() == 2 and V and logits.dtype in DTYPES and _elementwise_backend(
            policy, "drafter top-k log-probs", logits.device, logits):
        rows = triton_kernels().row_select
        if V <= rows.TOPK_MAX_V and min(k, V) <= rows.TOPK_MAX_K:
            return rows.topk_logprobs_rows(logits if logits.stride(-1) == 1 else logits.contiguous(), min(k, V))
        log_once(f"topk:wide:{V}:{k}", f"drafter top-k log-probs: torch for {k} of {V} (the Triton kernel "
                 f"takes k <= {rows.TOPK_MAX_K} of V <= {rows.TOPK_MAX_V})")
    return topk_logprobs_torch(logits, k)


def accept_backend(policy: KernelPolicy, device: torch.device) -> str:
    """The accept walk and its bookkeeping in a device-resident round: CUDA: one Triton program
    (kernels/accept_walk.py); CPU: the vectorized torch walk (speculative/accept.py, speculative/device_round.py).
    The same accepted nodes, emitted tokens and bonus."""
    return _backend("accept walk (device rounds)", policy.tree, device)


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, picks: torch.Tensor, m: int, max_depth: int,
                acc: torch.Tensor, result: torch.Tensor, bonus: torch.Tensor) -> None:
    """The accept walk's Triton launch (kernels/accept_walk.py), where accept_backend chose it: writes acc,
    result and bonus in place."""
    triton_kernels().accept_walk.accept_walk(tokens, parents, picks, m, max_depth, acc, result, bonus)


def log_choices(policy: KernelPolicy, device: torch.device) -> None:
    """Log, once, the policy and the kernel each concern will use on ``device`` (before the first forward)."""
    policy.log()
    int4_backend(policy, device)
    dense_backend(policy, device)
    attn_backend(policy, device)
