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
                 M = 1..256 of the K2 shapes, bench/results/w4-frag-h200-wgmma.md); other CUDA cases: Triton
                 (kernels/w4a16.py). Every kernel keeps a row's reduction order independent of the number of
                 rows; each choice is logged once per shape with its reason.
  MLA attention  CUDA with batch invariance on: the Triton kernel (kernels/mla_attention.py, split-KV
                 flash decoding with split sizes fixed by position). Otherwise the torch reference
                 (model/mla.py), which is not batch-invariant on CUDA (cuBLAS batched GEMMs).

  static step     (a round captured in a CUDA graph, or run eagerly with device-side bookkeeping):
                 MLA attention over the whole cache buffer with the length on the device
                 (:func:`mla_attention_static`: the Triton kernel's device-length launch, or the torch
                 reference with a visibility mask, by the same backend choice); a MoE that would take the torch
                 per-expert loop (which reads the hit experts on the host) runs every expert with a
                 zero weight for tokens not routed to it (model/moe.py). :func:`static_shapes` marks
                 such a step.

  MLA tails      rope of the query heads, and the new latent cache rows (RMSNorm of c_kv | rope of k_pe,
                 written at their slots). CUDA: one Triton launch each (kernels/rope.py; no FMA, the same
                 bits as torch's separate products and sums; the norm one row per program). CPU: torch
                 (model/layers.py apply_rope, the RMSNorm dispatch, index_copy_).

  residual+norm  ``h + d`` followed by RMSNorm (decoder layers of target and drafter): where the RMSNorm is
                 the Triton kernel, one Triton launch writing both (kernels/rmsnorm.py bi_add_rmsnorm; the
                 same bits as the add and the RMSNorm kernel apart); elsewhere torch's add + the RMSNorm
                 dispatch.

  router tail    sigmoid, correction bias, group-limited top-k (ties: lower index first), weights.
                 CUDA: one Triton program per token (kernels/router.py); CPU: torch with stable sorts
                 (model/moe.py route_torch).
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
                 RMSNorm dispatch, model/dflash.py apply_rope_half). The drafter only proposes, so this
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

``KDTREE_INT4_BACKEND`` (also ``frag``: the fragment kernels, an error where they do not apply) /
``KDTREE_ATTN_BACKEND`` / ``KDTREE_TREE_BACKEND`` (DDTree builder and accept walk) / ``KDTREE_DENSE_BACKEND`` (dense and
per-head matmuls, RMSNorm and residual+norm, MLA tails, router tail, SwiGLU, drafter q / k and attention, row select) = ``torch`` | ``triton`` force one backend (tests run the Triton code on the CPU with
``TRITON_INTERPRET=1``); forcing a torch path on CUDA with batch invariance on is obeyed and logged as a
warning (bitwise equality of speculative and plain decoding then no longer holds). Batch invariance is
set by :func:`set_batch_invariant` (the CLI's ``--batch-invariant on|off``, ``LLM(batch_invariant=...)``);
it is on unless turned off.

Everything else in the target forward is per row already: the embedding is a gather, rope and the
activations are elementwise, the router logits go through router_matmul (float32) and the router tail
(selection and a sum over top_k <= 8 values in one row) is per row, the dense-expert MoE path
adds a token's experts in ascending expert order, the fused INT4 MoE sums a token's top-k in slot
order, cos/sin come from a table built once in float64 on the CPU. The naive MLA form (torch einsums)
runs only for the prompt (empty cache, causal), the same forward in speculative and plain decoding.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from ..logs import log, log_once
from ..quant import dequantize

if TYPE_CHECKING:
    from ..config import ModelConfig

BACKENDS = ("torch", "triton")


def _forced(var: str, allowed: tuple[str, ...] = BACKENDS) -> str | None:
    value = os.environ.get(var) or None
    if value not in (None,) + allowed:
        raise ValueError(f"{var} must be one of {allowed}, got {value!r}")
    return value


_WARNED: set[str] = set()
_INT4_FORCED = _forced("KDTREE_INT4_BACKEND", BACKENDS + ("frag",))
_TREE_FORCED = _forced("KDTREE_TREE_BACKEND")
_ATTN_FORCED = _forced("KDTREE_ATTN_BACKEND")
_DENSE_FORCED = _forced("KDTREE_DENSE_BACKEND")
_BATCH_INVARIANT = True
# the router GEMM on CUDA with batch invariance on (router_matmul): unset, "bf16x3" for bfloat16 activations (the
# float32 gate as three bf16 parts on the tensor cores, kernels/router_gemm.router_logits_bf16x3) and "router" for
# others (the float32 FMA kernel, kernels/router_gemm.router_logits); "generic" (the batch-invariant GEMM on
# x.float()) is a measurement knob. Each has its own bits.
_ROUTER_GEMM = _forced("KDTREE_ROUTER_GEMM", ("bf16x3", "router", "generic"))


def set_batch_invariant(on: bool) -> None:
    """CUDA kernels whose per-row result does not depend on the rows sharing the launch (True, the
    default) or the fastest ones (False: cuBLAS matmuls, torch norm and attention)."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = bool(on)
    if _BATCH_INVARIANT:
        msg = ("batch invariance on: dense and per-head matmuls through the batch-invariant Triton GEMM, "
               "RMSNorm and MLA attention through their Triton kernels on cuda")
    else:
        msg = ("batch invariance off: cuBLAS matmuls, torch RMSNorm and attention on cuda (speculative "
               "output equals plain decoding up to floating point only)")
    log_once(f"batch-invariant:{_BATCH_INVARIANT}", msg)


def batch_invariant() -> bool:
    return _BATCH_INVARIANT


def _backend(kind: str, forced: str | None, device: torch.device, cuda_default: str = "triton") -> str:
    backend = forced or (cuda_default if device.type == "cuda" else "torch")
    log_once(f"{kind}:{device.type}:{backend}", f"{kind} kernels on {device.type}: {backend}")
    return backend


def int4_backend(device: torch.device) -> str:
    """torch or the GPU kernels ("triton": Triton or, per weight, the Gluon fragment kernels; int4_kernel)."""
    return _backend("W4A16", "triton" if _INT4_FORCED == "frag" else _INT4_FORCED, device)


def int4_kernel(device: torch.device, dtype: torch.dtype, what: str, unsupported: str | None) -> str:
    """The kernel family of one INT4 weight (or expert stack): "torch", "triton" or "frag".
    ``unsupported``: why its shape cannot take the fragment kernels (None: it can)."""
    if int4_backend(device) == "torch":
        return "torch"
    if _INT4_FORCED == "triton":
        return "triton"
    from .common import interpreting
    from .w4_frag import HAVE_GLUON
    why = ("not on cuda" if device.type != "cuda" else "the interpreter" if interpreting()
           else "triton without gluon" if not HAVE_GLUON
           else f"{dtype} activations (bfloat16 needed)" if dtype != torch.bfloat16 else unsupported)
    if why:
        if _INT4_FORCED == "frag":
            raise ValueError(f"KDTREE_INT4_BACKEND=frag: the fragment kernels cannot run {what}: {why}")
        log_once(f"int4-kernel:{what}:{why}", f"W4A16 {what}: Triton kernels (fragment kernels not used: {why})")
        return "triton"
    log_once(f"int4-kernel:{what}:frag", f"W4A16 {what}: fragment-ordered Gluon kernels")
    return "frag"


def prepare_int4(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Put every INT4 module's words in the order its kernel reads, before any forward (so the one-off
    in-place reorder never lands inside a CUDA-graph capture)."""
    from ..model.int4_order import int4_words
    for m in model.modules():
        if int4_words(m):
            m.int4_prepare(dtype)


def _invariant_backend(kind: str, forced: str | None, device: torch.device) -> str:
    """Triton on CUDA when batch invariance is on, torch otherwise; a forced torch backend on CUDA with
    batch invariance on is obeyed, with a warning (the torch path is not batch-invariant there)."""
    backend = _backend(kind, forced, device, cuda_default="triton" if _BATCH_INVARIANT else "torch")
    if device.type == "cuda" and _BATCH_INVARIANT and backend == "torch" and kind not in _WARNED:
        _WARNED.add(kind)
        log.warning(f"{kind}: the torch path is forced on cuda with batch invariance on; it is not batch-"
                    "invariant there, so speculative output may differ from plain decoding in the last bits "
                    "(near-ties can flip tokens)")
    return backend


def dense_backend(device: torch.device) -> str:
    """Dense and per-head matmuls and RMSNorm: the batch-invariant Triton kernels or torch."""
    return _invariant_backend("dense (GEMM, per-head GEMM, RMSNorm)", _DENSE_FORCED, device)


def _training(*tensors: torch.Tensor) -> bool:
    """Autograd or autocast is active for these operands (drafter training): the Triton kernels have no
    backward and want equal dtypes, so torch runs them (logged once)."""
    dev = tensors[0].device
    busy = torch.is_autocast_enabled(dev.type) or (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    if busy:
        log_once(f"dense:training:{dev.type}", f"dense kernels on {dev.type}: torch where autograd or autocast "
                 "is active (training; the batch-invariant Triton kernels have no backward)")
    return busy


def _use_triton(*tensors: torch.Tensor) -> bool:
    return dense_backend(tensors[0].device) == "triton" and not _training(*tensors)


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] for dense weights (same dtype)."""
    if _use_triton(x, w):
        from .gemm import bi_linear
        return bi_linear(x, w)
    return F.linear(x, w)


# Where the shared expert runs on CUDA (the same kernels and sum either way, so the same bits): "before"
# the router and routed experts on the same stream, "after" them, "side": on a side stream beside them, or
# "router-side": the router (its GEMM and top-k launches) on a side stream beside the shared expert, the routed
# experts after both.
# Measured on an H200:
#   K2 layer (shared expert 88 MB; bench/results/k2_step-h200-shared-*.md, us at T = 1 / 4 / 16 / 64):
#     before 206 / 399 / 966 / 2368, after 206 / 398 / 960 / 2374, side 211 / 421 / 1036 / 2561: the routed
#     kernels, sized for the whole GPU, share it with the shared expert's GEMMs and run a long tail;
#   demo model (shared expert 0.3 MB; bench/results/round-h200-shared-*.md, ms per graph round plain /
#     DDTree-8): side 0.253 / 0.606, before 0.277 / 0.630: its kernels leave most SMs idle.
#   K2 layer, router-side against before in one call (bench/results/k2_step-h200-rside.md, -before.md; us at T =
#     1 / 4 / 8 / 16 / 32 / 64): 189 / 350 / 538 / 957 / 1543 / 2381 against 197 / 364 / 550 / 900 / 1478 / 2203:
#     the router's small launches hide beside the shared GEMMs up to 8 tokens; from 16 they contend with them.
# So by the shared expert's weight bytes (the threshold lies between the two measured models): side stream
# under SHARED_SIDE_BYTES; else router-side up to ROUTER_SIDE_MAX_T tokens, before beyond. KDTREE_MOE_SHARED
# forces one (measurements).
SHARED_PLACEMENTS = ("before", "after", "side", "router-side")
SHARED_SIDE_BYTES = 16 << 20
ROUTER_SIDE_MAX_T = 8
_SHARED = _forced("KDTREE_MOE_SHARED", SHARED_PLACEMENTS)


def shared_placement(shared_bytes: int, tokens: int) -> str:
    """Where a shared expert of this many weight bytes runs on CUDA for a launch of `tokens` tokens (above);
    logged once per choice."""
    if _SHARED is not None:
        log_once(f"moe-shared:{_SHARED}", f"MoE on cuda: the shared expert placed '{_SHARED}' (KDTREE_MOE_SHARED)")
        return _SHARED
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


def router_matmul(x: torch.Tensor, w: torch.Tensor, partials: bool = False,
                  bf16x3: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """Router logits: x [M, K] (any float dtype) @ w [N, K].T (float32) -> [M, N] float32. partials: split
    partials [S, M, N] where a kernel makes them (their sum in split order is the logits; `route` takes either),
    else the logits. bf16x3: returns the gate's bf16 parts [3, N, K] (router_gemm.split_bf16x3, built once by
    the owner), the operand of the tensor-core router for bfloat16 activations (_ROUTER_GEMM)."""
    if not _use_triton(x, w):
        return F.linear(x.float(), w)
    kind = _ROUTER_GEMM or ("bf16x3" if x.dtype == torch.bfloat16 and bf16x3 is not None else "router")
    how = {"bf16x3": "the float32 gate as three bf16 parts on the tensor cores",
           "router": "the float32 FMA router kernel", "generic": "the generic batch-invariant GEMM on x.float()"}
    log_once(f"router-gemm:{kind}:{x.dtype}", f"router GEMM for {x.dtype} activations: {how[kind]} "
             f"({'KDTREE_ROUTER_GEMM' if _ROUTER_GEMM else 'automatic: bf16x3 for bfloat16, else the FMA kernel'})")
    if kind == "generic":
        from .gemm import bi_linear
        return bi_linear(x.float(), w)
    if kind == "bf16x3":
        if x.dtype != torch.bfloat16 or bf16x3 is None:
            raise ValueError(f"KDTREE_ROUTER_GEMM=bf16x3 needs bfloat16 activations and the gate's bf16 parts; got "
                             f"{x.dtype} activations{'' if bf16x3 is not None else ', no parts'}")
        from .router_gemm import router_logits_bf16x3
        parts = router_logits_bf16x3(x, bf16x3())
        if partials:
            return parts
        from .pdl import pdl_supported
        from .split_sum import split_sum
        logits = torch.empty(parts.shape[1:], device=x.device, dtype=torch.float32)
        if logits.numel():   # the partials in index order, as the router tail adds them
            split_sum(parts, logits, parts.shape[0], pdl=pdl_supported(x.device))
        return logits
    from .router_gemm import router_logits
    return router_logits(x, w, partials=partials)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head product x [T, B, K], w [B, N, K] (any strides) -> [T, B, N]: out[t, b] = x[t, b] @ w[b].T."""
    if _use_triton(x, w):
        from .gemm import bi_head_linear
        return bi_head_linear(x, w)
    return torch.einsum("tbk,bnk->tbn", x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, HF convention (layers.rms_norm_torch)."""
    if _use_triton(x, weight):
        from .rmsnorm import bi_rmsnorm
        return bi_rmsnorm(x, weight, eps)
    from ..model.layers import rms_norm_torch
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = h + d (the residual stream and the next sublayer's input)."""
    if _use_triton(h, d, weight):
        from .rmsnorm import bi_add_rmsnorm
        return bi_add_rmsnorm(h, d, weight, eps)
    s = h + d
    return s, rms_norm(s, weight, eps)


def _elementwise_backend(kind: str, device: torch.device, *tensors: torch.Tensor) -> bool:
    """Per-row Triton kernels that replace several torch launches (router tail, SwiGLU): Triton on CUDA
    whether batch invariance is on or off (they are per row either way), torch on the CPU and in training."""
    return _backend(kind, _DENSE_FORCED, device) == "triton" and not _training(*tensors)


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router tail: logits [T, E] float32, or split-K partials [S, T, E] (router_matmul partials=True: summed in
    split order, the bits of the logits) -> (expert ids int64 [T, k], weights float32 [T, k])."""
    if _elementwise_backend("router tail (sigmoid, group top-k, weights)", logits.device, logits):
        from .router import route_triton
        return route_triton(logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                            cfg.norm_topk_prob, cfg.routed_scaling_factor)
    from ..model.moe import route_torch
    return route_torch(logits, bias, cfg)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise (SwiGLU)."""
    if _elementwise_backend("SwiGLU (silu(gate) * up)", gate.device, gate, up):
        from .swiglu import silu_mul as triton_silu_mul
        return triton_silu_mul(gate, up)
    return F.silu(gate) * up


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half rope (the drafter's q / k): x [T, H, d], cos / sin [T, d]."""
    if _elementwise_backend("drafter head norm + rope", x.device, x, weight):
        from .head_norm_rope import head_norm_rope as triton_head_norm_rope
        return triton_head_norm_rope(x, weight, eps, cos, sin)
    from ..model.dflash import apply_rope_half
    return apply_rope_half(rms_norm(x, weight, eps), cos, sin)


def draft_attention_backend(q: torch.Tensor, k: torch.Tensor) -> str:
    """The drafter's attention (block queries over the cached context + the block): one Triton launch on
    CUDA (kernels/draft_attention.py), else torch (model/dflash.py: concatenation, GQA repeat, masked sdpa)."""
    return "triton" if _elementwise_backend("drafter attention", q.device, q, k) else "torch"


def mla_tail_backend(device: torch.device) -> str:
    """Rope of the query heads and the latent cache write: Triton on CUDA (batch invariance on or off:
    the kernels are per row), torch on the CPU."""
    return _backend("MLA tails (query rope, latent cache write)", _DENSE_FORCED, device)


def rope_heads(q: torch.Tensor, nope: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q [T, N, nope + R] -> rope(q[..., nope:]) [T, N, R] (model/layers.py apply_rope)."""
    if mla_tail_backend(q.device) == "triton" and not _training(q):
        from .rope import rope_heads as triton_rope_heads
        return triton_rope_heads(q, nope, cos, sin)
    from ..model.layers import apply_rope
    return apply_rope(q[..., nope:], cos, sin)


def latent_write(kva: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 kv: torch.Tensor, slots: torch.Tensor) -> None:
    """kv[slots[t]] = [rmsnorm(kva[t, :C]) | rope(kva[t, C:])]: the T new latent cache rows of a layer."""
    if mla_tail_backend(kv.device) == "triton" and not _training(kva):
        from .rope import latent_write as triton_latent_write
        triton_latent_write(kva, norm_weight, eps, cos, sin, kv, slots)
        return
    from ..model.layers import apply_rope
    C = norm_weight.shape[0]
    row = torch.cat([rms_norm(kva[:, :C], norm_weight, eps), apply_rope(kva[:, C:], cos, sin)], dim=-1)
    kv.index_copy_(0, slots, row.to(kv.dtype))


def w4a16_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/8], scale [N, K/g]).T -> [M, N], float32 accumulate (through
    dense_matmul, so batch-invariant on CUDA when that is on)."""
    w = dequantize(packed, scale, group_size, torch.float32)  # [N, K]
    return dense_matmul(x.float(), w).to(x.dtype)


def w4a16_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    """x [M, K] @ the INT4 weight of ``layer`` (model.layers.Linear) -> [M, N]."""
    from ..model.int4_order import checkpoint_int4
    kind = layer.int4_prepare(x.dtype)
    if kind == "frag":
        from .w4_frag import ENGINE_ORDER, frag_linear
        return frag_linear(x.to(torch.bfloat16), layer.weight_packed, layer.weight_scale, **ENGINE_ORDER)
    if kind == "triton":
        from .w4a16 import w4a16_linear
        return w4a16_linear(x, layer.weight_packed, layer.weight_scale, layer.group_size)
    return w4a16_matmul_reference(x, *checkpoint_int4(layer, "weight_packed"), layer.group_size)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: int,
                  tree_mask: torch.Tensor | None, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache + the new block; see mla_attention_reference."""
    if attn_backend(kv.device) == "triton":
        from .mla_attention import mla_attention as triton_mla
        return triton_mla(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)
    from ..model.mla import mla_attention_reference
    return mla_attention_reference(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)


def attn_backend(device: torch.device) -> str:
    """Triton on CUDA when batch invariance is on (the torch reference is not invariant), else torch."""
    return _invariant_backend("MLA attention", _ATTN_FORCED, device)


_STATIC = False


@contextmanager
def static_shapes() -> Iterator[None]:
    """Inside: every kernel choice must be free of host reads and data-dependent shapes."""
    global _STATIC
    prev, _STATIC = _STATIC, True
    try:
        yield
    finally:
        _STATIC = prev


def static_active() -> bool:
    return _STATIC


def mla_attention_static(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: torch.Tensor,
                         tree_mask: torch.Tensor, visible: torch.Tensor | None, scale: float,
                         kv_lora_rank: int, gather_index: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """Absorbed MLA attention over the whole cache buffer kv [S_cap, C+R] with the committed length
    ``start`` on the device: the Triton kernel's device-length launch (same reduction as the host-length
    one), or the torch reference with the visibility mask ``visible`` [T, S_cap] (None: the Triton path). ``gather_index``: the
    Triton kernel's :func:`attention_gather_index` of ``tree_mask``, computed once for all layers (else
    per call)."""
    if attn_backend(kv.device) == "triton":
        from .mla_attention import mla_attention_device
        return mla_attention_device(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank,
                                    gather_index=gather_index)
    if visible is None:
        raise ValueError("the torch MLA attention of a static step needs the visibility mask")
    from ..model.mla import mla_attention_masked
    return mla_attention_masked(q_lat, q_pe, kv, visible, scale, kv_lora_rank)


def attention_gather_index(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What every layer's static attention derives from the step's tree mask (the Triton kernel's per-query
    visible-slot index), built once per forward; None for the torch path (it uses the visibility mask)."""
    if attn_backend(tree_mask.device) == "triton":
        from .mla_attention import tree_gather_index
        return tree_gather_index(tree_mask)
    return None


def build_draft_tree(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: torch.Tensor,
                     start: torch.Tensor):
    """The DDTree of a device-resident round (no host read): CUDA: one Triton program
    (kernels/tree_ops.py); CPU: the vectorized torch builder (speculative/tree.py). Identical trees."""
    if _backend("DDTree builder (device rounds)", _TREE_FORCED, lp.device) == "triton":
        from .tree_ops import build_tree_triton
        return build_tree_triton(lp, ids, budget, root_token, start)
    from ..speculative.tree import build_tree
    return build_tree(lp, ids, budget, root_token, start)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis, ties to the lowest index (greedy picks): [..., V] -> [...] long. CUDA: one
    Triton program per row (kernels/row_select.py; torch.argmax's result); CPU: torch.argmax."""
    from .common import DTYPES
    if x.dim() >= 1 and x.numel() and x.dtype in DTYPES and _elementwise_backend("row argmax (greedy picks)",
                                                                                  x.device, x):
        from .row_select import argmax_rows
        rows = x.reshape(-1, x.shape[-1])
        return argmax_rows(rows if rows.stride(-1) == 1 else rows.contiguous()).reshape(x.shape[:-1])
    return torch.argmax(x, dim=-1)


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's per-position top-k log-probs: logits [L, V] -> (lp [L, k'] float32 descending, ids
    [L, k'] long), k' = min(k, V). CUDA with V <= TOPK_MAX_V and k' <= TOPK_MAX_K: one Triton program per row
    (kernels/row_select.py, ties to the lower id); otherwise torch (speculative/tree.py: topk + logsumexp), logged."""
    from .common import DTYPES
    from .row_select import TOPK_MAX_K, TOPK_MAX_V
    V = logits.shape[-1]
    if logits.dim() == 2 and V and logits.dtype in DTYPES and _elementwise_backend(
            "drafter top-k log-probs", logits.device, logits):
        if V <= TOPK_MAX_V and min(k, V) <= TOPK_MAX_K:
            from .row_select import topk_logprobs_rows
            return topk_logprobs_rows(logits if logits.stride(-1) == 1 else logits.contiguous(), min(k, V))
        log_once(f"topk:wide:{V}:{k}", f"drafter top-k log-probs: torch for {k} of {V} (the Triton kernel "
                 f"takes k <= {TOPK_MAX_K} of V <= {TOPK_MAX_V})")
    from ..speculative.tree import topk_logprobs_torch
    return topk_logprobs_torch(logits, k)


def accept_backend(device: torch.device) -> str:
    """The accept walk and its bookkeeping in a device-resident round: CUDA: one Triton program
    (kernels/accept_walk.py); CPU: the vectorized torch walk (speculative/accept.py, speculative/device_round.py).
    The same accepted nodes, emitted tokens and bonus."""
    return _backend("accept walk (device rounds)", _TREE_FORCED, device)


def log_choices(device: torch.device) -> None:
    """Log, once, the kernel each concern will use on ``device`` (before the first forward)."""
    int4_backend(device)
    dense_backend(device)
    attn_backend(device)
    if device.type == "cuda":
        set_batch_invariant(_BATCH_INVARIANT)
