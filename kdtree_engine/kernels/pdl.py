"""Programmatic dependent launch (sm_90+) for the chained launches of a layer: the INT4 and batch-invariant
GEMMs with their epilogues, the router GEMM and the per-layer tails (norms, rope, latent write, router tail,
SwiGLU, attention chunks and merge).

A kernel launched with `launch_pdl=True` may start while the kernel before it on the stream is finishing.
It first does what does not read that kernel's outputs (index math, the first weight block's loads), then
`pdl_wait`: griddepcontrol.wait (the previous kernel complete, its writes visible) followed by
griddepcontrol.launch_dependents (the next launch may start once every program of this one got here). The
release comes after the wait, so a kernel that starts early finds everything two launches back complete.
Both instructions are no-ops in a kernel launched without the attribute; they exist from sm_90 on
(`pdl_supported`: older devices launch without them). The launch order, the data and the
arithmetic are unchanged: the same bits with or without (GPU-tested); CUDA-graph capture keeps the
programmatic edges.

Asking L2 for each program's first weight lines before the wait gained nothing and was dropped
(docs/performance_history.md).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from .common import interpreting

log = logging.getLogger(__name__)

PDL_ASM = "griddepcontrol.wait; griddepcontrol.launch_dependents; // $0"
_ASM = tl.constexpr(PDL_ASM)


@triton.jit
def pdl_wait():
    """Wait for the previous launch, then release the next one (Triton kernels; not in the interpreter)."""
    tl.inline_asm_elementwise(_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    major, minor = torch.cuda.get_device_capability(device)
    ok = major >= 9
    log.debug("programmatic dependent launches on %s (sm_%d%d): %s", device, major, minor, "on" if ok else "off")
    return ok


def pdl_supported(device: torch.device) -> bool:
    """Dependent launches exist on CUDA devices of compute capability 9.0 and later (logged once per device),
    never in the Triton interpreter."""
    return device.type == "cuda" and not interpreting() and _capable(device)


def pdl_launch(on: bool) -> dict:
    """The keywords of a launch of a kernel with a `PDL` constexpr that calls pdl_wait when it is set: the
    constexpr and, when on, the launch attribute."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


__all__ = ["PDL_ASM", "pdl_launch", "pdl_supported", "pdl_wait"]
