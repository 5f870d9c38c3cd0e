"""The Triton kernel modules, imported on first use: only where the dispatch (kernels/dispatch.py) chooses a Triton
backend (CUDA, or a forced ``triton`` backend, which the tests run on the CPU under TRITON_INTERPRET=1). The CPU
path never calls it, so it runs without triton installed; the plain-torch helpers it needs live beside the kernels
in files that do not import triton (layouts.py, bf16x3.py, common.py, reference.py, streams.py).

    triton_kernels()   the kernel modules (TritonKernels), imported once per process; where triton is not
                       installed, TritonMissing: bad input, one line, exit 2 from the CLI.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from types import ModuleType

from ..errors import BadInput

INSTALL_HINT = ("pip install triton, or pip install -e '.[gpu]' from the source checkout (torch's CUDA wheels for "
                "Linux bring a matching triton)")


class TritonMissing(BadInput):
    """A Triton backend was chosen (CUDA, or a forced KDTREE_*_BACKEND=triton) and triton is not installed."""


@dataclass(frozen=True)
class TritonKernels:
    """The Triton (and Gluon) kernel modules the dispatch launches, one field per file of kernels/."""

    accept_walk: ModuleType
    draft_attention: ModuleType
    gemm: ModuleType
    head_norm_rope: ModuleType
    mla_attention: ModuleType
    moe_frag: ModuleType
    moe_grouped: ModuleType
    moe_w4a16: ModuleType
    pdl: ModuleType
    prefill_attention: ModuleType
    rmsnorm: ModuleType
    rope: ModuleType
    router: ModuleType
    router_gemm: ModuleType
    row_select: ModuleType
    split_sum: ModuleType
    swiglu: ModuleType
    tree_ops: ModuleType
    w4_frag: ModuleType
    w4a16: ModuleType
    w8a16: ModuleType


@functools.cache
def triton_kernels() -> TritonKernels:
    """The kernel modules, imported on the first call (the one place that imports them; cached per process, which
    changes nothing but the import's cost). Raises TritonMissing where triton is not installed; any other import
    failure propagates as it is."""
    try:
        import triton  # noqa: F401  (installed or not: the one question asked here)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise TritonMissing("triton is not installed, and the Triton kernels chosen for this run need it (CUDA, or "
                            f"a KDTREE_*_BACKEND=triton): {INSTALL_HINT}") from e
    from . import (accept_walk, draft_attention, gemm, head_norm_rope, mla_attention, moe_frag, moe_grouped, moe_w4a16,
                   pdl, prefill_attention, rmsnorm, rope, router, router_gemm, row_select, split_sum, swiglu, tree_ops, w4_frag, w4a16,
                   w8a16)
    return TritonKernels(accept_walk=accept_walk, draft_attention=draft_attention, gemm=gemm,
                         head_norm_rope=head_norm_rope, mla_attention=mla_attention, moe_frag=moe_frag, moe_grouped=moe_grouped,
                         moe_w4a16=moe_w4a16, pdl=pdl, prefill_attention=prefill_attention, rmsnorm=rmsnorm, rope=rope, router=router,
                         router_gemm=router_gemm, row_select=row_select, split_sum=split_sum, swiglu=swiglu,
                         tree_ops=tree_ops, w4_frag=w4_frag, w4a16=w4a16, w8a16=w8a16)


def compiled_variants() -> int | None:
    """Kernel variants compiled so far in this process (the entries of the Triton caches of the engine's kernels), or
    None where the kernels were never loaded (the CPU path) or this triton's caches are not readable."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None or triton_kernels.cache_info().currsize == 0:
        return None
    try:
        n = 0
        for module in vars(triton_kernels()).values():
            for obj in vars(module).values():
                if isinstance(obj, jit.JITFunction):
                    n += sum(len(caches[0]) for caches in obj.device_caches.values())
        return n
    except (AttributeError, IndexError, TypeError):   # another triton's internals: not counted
        return None


__all__ = ["INSTALL_HINT", "TritonKernels", "TritonMissing", "compiled_variants", "triton_kernels"]
