"""The fixed-order reduction of split-K partials shared by the GEMM kernels (no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_wait


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, N, rows, iters, work, programs, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False, STREAM: tl.constexpr = False):
    """out[i] = (((part[0, i] + part[1, i]) + part[2, i]) + ...), in split order. STREAM: column n adds only
    the slots its row tile (n // rows) has in the stream partition of the dense fragment kernel (w4_frag.py:
    dense_partition; the rest are never written). PDL: launched dependent on the GEMM that wrote the
    partials (pdl.py)."""
    if PDL:
        pdl_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    if STREAM:
        first = ((offs % N) // rows) * iters
        used = ((first + iters) * programs - 1) // work - ((first + 1) * programs - 1) // work + 1
    for s in tl.static_range(1, SPLIT):
        if STREAM:
            more = mask & (s < used)
            acc = tl.where(more, acc + tl.load(part_ptr + s * MN + offs, mask=more, other=0.0), acc)
        else:
            acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_sum(parts: torch.Tensor, out: torch.Tensor, split: int, pdl: bool = False,
              stream: tuple[int, int, int, int] | None = None) -> None:
    """out [M, N] = sum over s of parts [split, M, N] (float32), added in the order s = 0, 1, ...
    stream: (rows, iters, work, programs) of a stream partition (w4_frag.dense_partition): column n adds
    only its row tile's slots. pdl: a programmatic dependent launch (pdl.py; CUDA sm_90+ only)."""
    mn = out.numel()
    block = 1024
    rows, iters, work, programs = stream or (1, 1, 1, 1)
    _split_sum_kernel[(triton.cdiv(mn, block),)](parts, out, mn, out.shape[-1], rows, iters, work, programs,
                                                SPLIT=split, BLOCK=block, STREAM=stream is not None,
                                                num_warps=4, **pdl_launch(pdl))
