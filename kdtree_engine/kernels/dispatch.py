"""Kernel choice: one place, chosen by the weight's format and the device, each choice logged once.

  dense linear   CPU: torch ``F.linear``. CUDA: cuBLAS, or with batch invariance on the Triton GEMM
                 whose per-row reduction order does not depend on the number of rows (kernels/gemm.py).
  W4A16 linear   CPU: dequantize + float32 matmul. CUDA: Triton (kernels/w4a16.py).
  MLA attention  the torch reference (model/mla.py) by default on every device; the Triton kernel
                 (kernels/mla_attention.py, split-KV flash decoding, batch-invariant) with
                 ``KDTREE_ATTN_BACKEND=triton``. It passes its own GPU tests; it becomes the CUDA default
                 once the end-to-end GPU suite has run with it.

  static step     (a round captured in a CUDA graph, or run eagerly with device-side bookkeeping):
                 MLA attention over the whole cache buffer with the length on the device
                 (:func:`mla_attention_static`: the Triton kernel's device-length launch, or the torch
                 reference with a visibility mask, by the same backend choice); a MoE that would take the torch
                 per-expert loop (which reads the hit experts on the host) runs every expert with a
                 zero weight for tokens not routed to it (model/moe.py). :func:`static_shapes` marks
                 such a step.

  DDTree builder  (device-resident rounds) CUDA: one Triton program (kernels/tree_ops.py); CPU: the
                 vectorized torch builder (spec/tree.py); the same tree.

``KDTREE_INT4_BACKEND`` / ``KDTREE_ATTN_BACKEND`` / ``KDTREE_TREE_BACKEND`` = ``torch`` | ``triton`` force one
backend (tests run the Triton code on the CPU with ``TRITON_INTERPRET=1``). Batch invariance is set by
:func:`set_batch_invariant` (the CLI's ``--batch-invariant``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from ..model.layers import log_once
from ..quant import dequantize

BACKENDS = ("torch", "triton")


def _forced(var: str) -> str | None:
    value = os.environ.get(var) or None
    if value not in (None,) + BACKENDS:
        raise ValueError(f"{var} must be one of {BACKENDS}, got {value!r}")
    return value


_INT4_FORCED = _forced("KDTREE_INT4_BACKEND")
_TREE_FORCED = _forced("KDTREE_TREE_BACKEND")
_ATTN_FORCED = _forced("KDTREE_ATTN_BACKEND")
_BATCH_INVARIANT = False


def set_batch_invariant(on: bool) -> None:
    """Dense CUDA matmuls through the batch-invariant Triton GEMM (True) or cuBLAS (False)."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = bool(on)
    log_once(f"batch-invariant:{_BATCH_INVARIANT}",
             f"dense linears on cuda: {'batch-invariant Triton GEMM' if _BATCH_INVARIANT else 'cuBLAS'}")


def _backend(kind: str, forced: str | None, device: torch.device, cuda_default: str = "triton") -> str:
    backend = forced or (cuda_default if device.type == "cuda" else "torch")
    log_once(f"{kind}:{device.type}:{backend}", f"{kind} kernels on {device.type}: {backend}")
    return backend


def int4_backend(device: torch.device) -> str:
    return _backend("W4A16", _INT4_FORCED, device)


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] for dense weights (same dtype)."""
    if _BATCH_INVARIANT and x.is_cuda:
        from .gemm import bi_linear
        return bi_linear(x, w)
    return F.linear(x, w)


def w4a16_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/8], scale [N, K/g]).T -> [M, N], float32 accumulate."""
    w = dequantize(packed, scale, group_size, torch.float32)  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    if int4_backend(x.device) == "triton":
        from .w4a16 import w4a16_linear
        return w4a16_linear(x, packed, scale, group_size)
    return w4a16_matmul_reference(x, packed, scale, group_size)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: int,
                  tree_mask: torch.Tensor | None, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache + the new block; see mla_attention_reference."""
    if _backend("MLA attention", _ATTN_FORCED, kv.device, cuda_default="torch") == "triton":
        from .mla_attention import mla_attention as triton_mla
        return triton_mla(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)
    from ..model.mla import mla_attention_reference
    return mla_attention_reference(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)


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
                         tree_mask: torch.Tensor, visible: torch.Tensor, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the whole cache buffer kv [S_cap, C+R] with the committed length
    ``start`` on the device: the Triton kernel's device-length launch (same reduction as the host-length
    one), or the torch reference with the visibility mask ``visible`` [T, S_cap]."""
    if _backend("MLA attention", _ATTN_FORCED, kv.device, cuda_default="torch") == "triton":
        from .mla_attention import mla_attention_device
        return mla_attention_device(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)
    from ..model.mla import mla_attention_masked
    return mla_attention_masked(q_lat, q_pe, kv, visible, scale, kv_lora_rank)


def build_draft_tree(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: torch.Tensor,
                     start: torch.Tensor):
    """The DDTree of a device-resident round (no host read): CUDA: one Triton program
    (kernels/tree_ops.py); CPU: the vectorized torch builder (spec/tree.py). Identical trees."""
    if _backend("DDTree builder (device rounds)", _TREE_FORCED, lp.device) == "triton":
        from .tree_ops import build_tree_triton
        return build_tree_triton(lp, ids, budget, root_token, start)
    from ..spec.tree import build_tree
    return build_tree(lp, ids, budget, root_token, start)


def log_choices(device: torch.device) -> None:
    """Log, once, the kernel each concern will use on ``device`` (before the first forward)."""
    int4_backend(device)
    _backend("MLA attention", _ATTN_FORCED, device, cuda_default="torch")
    if device.type == "cuda":
        set_batch_invariant(_BATCH_INVARIANT)
