"""The fixed-order reduction of split-K partials (no atomics): of the GEMM launches too large for their arrival
counters (gemm.py), of the cross-rank partials, and of the stream partition's partials of the fragment W4A16
kernels (w4_frag.py, moe_frag.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..logs import log_once
from .pdl import pdl_launch, pdl_wait


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[i] = (((part[0, i] + part[1, i]) + part[2, i]) + ...), in split order. PDL: launched dependent
    on the GEMM that wrote the partials (pdl.py)."""
    if PDL:
        pdl_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    # float32 additions whatever the partials' dtype (a no-op for float32 ones: the split-K GEMMs')
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_to_arrive(cnt_ptr, tile, n_split):
    """Whether this program is the last of the tile's n_split programs to arrive at its arrival counter (a CTA
    barrier, then one acquire-release atomic at GPU scope: the others' stores are visible to the last one, which
    must set the counter back to 0)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == n_split - 1


@triton.jit
def last_program_sums(p_ptrs, o_mask, stride_s, n_split, f_ptrs, cnt_ptr, tile):
    """The split partials of one output tile summed by the last of its n_split programs to arrive (last_to_arrive),
    in split order from the partials in memory (its own included): split_sum's additions, so the same bits. p_ptrs:
    split 0's partials of the tile (float32), stride_s apart; f_ptrs: the tile's outputs."""
    if last_to_arrive(cnt_ptr, tile, n_split):
        total = tl.load(p_ptrs, mask=o_mask, other=0.0, cache_modifier=".cg")
        for s in range(1, n_split):
            total += tl.load(p_ptrs + s * stride_s, mask=o_mask, other=0.0, cache_modifier=".cg")
        tl.store(f_ptrs, total.to(f_ptrs.dtype.element_ty), mask=o_mask)
        tl.store(cnt_ptr + tile, 0)


SERIAL_TILES = 4096  # arrival counters per stream: a split launch of more output tiles sums in a second kernel

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """int32 zeros, SERIAL_TILES of them per (device, stream), for last_to_arrive (a launch's last program of a
    tile sets its counter back to 0, so launches one after another on a stream share them; concurrent streams have
    their own); None for a launch of more tiles."""
    if tiles > SERIAL_TILES:
        log_once("gemm:split-sum", f"split-K launches of more than {SERIAL_TILES} output tiles sum their partials "
                 "in a second launch (split_sum), the same additions")
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None:   # kept for good: a captured graph holds its address
        buf = _COUNTERS[key] = torch.zeros(SERIAL_TILES, dtype=torch.int32, device=device)
    return buf


def split_sum(parts: torch.Tensor, out: torch.Tensor, split: int, pdl: bool = False) -> None:
    """out [M, N] = sum over s of parts [split, M, N] (any float dtype, added in float32), in the order s = 0, 1, ...
    pdl: a programmatic dependent launch (pdl.py; CUDA sm_90+ only)."""
    mn = out.numel()
    block = 1024
    _split_sum_kernel[(triton.cdiv(mn, block),)](parts, out, mn, SPLIT=split, BLOCK=block, num_warps=4,
                                                **pdl_launch(pdl))


@triton.jit
def _stream_program(block, work, programs):
    """w4_frag.stream_program: the program of the stream partition whose range holds global K block `block`."""
    return ((block + 1) * programs - 1) // work


@triton.jit
def stream_slots(n, rows, iters, work, programs):
    """The partials (slots) that output row n's tile n // rows has in the stream partition of row tiles of
    `rows` rows x iters K blocks over `programs` programs (w4_frag.dense_partition; the tile's other slots
    are never written). 32-bit arithmetic: dense_partition keeps (work + 1) * programs below 2^31."""
    first = (n // rows) * iters
    return _stream_program(first + iters - 1, work, programs) - _stream_program(first, work, programs) + 1


@dataclass(frozen=True)
class Partition:
    """A stream partition (w4_frag.dense_partition) as the partial sums read it: row tiles of `rows` rows x
    iters K blocks over `programs` programs (tiles: how many row tiles). Partition.split(rows, s): s equal
    K ranges per tile (each output row then has s slots)."""
    rows: int
    tiles: int
    iters: int
    programs: int

    @property
    def work(self) -> int:
        return self.tiles * self.iters

    def args(self) -> tuple[int, int, int, int]:
        """(rows, iters, work, programs): the sum kernels' arguments."""
        return self.rows, self.iters, self.work, self.programs

    @classmethod
    def split(cls, rows: int, s: int) -> "Partition":
        return cls(rows, 1, s, s)


@triton.jit
def _stream_sum_kernel(part_ptr, out_ptr, MN, N, rows, iters, work, programs, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """grid (M, cdiv(N, BLOCK)): out[m, n] = part[0, m, n] + part[1, m, n] + ... over the slots that row tile
    n // rows has in the stream partition (stream_slots), in slot order."""
    if PDL:
        pdl_wait()
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    used = stream_slots(n, rows, iters, work, programs)
    offs = tl.program_id(0).to(tl.int64) * N + n
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        more = mask & (s < used)
        acc = tl.where(more, acc + tl.load(part_ptr + s * MN + offs, mask=more, other=0.0), acc)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def stream_sum(parts: torch.Tensor, out: torch.Tensor, slots: int, partition: Partition, pdl: bool = False) -> None:
    """out [M, N] = the sum in slot order of the partials parts [slots, M, N] (float32) of `partition`
    (w4_frag.dense_partition): column n adds only its row tile's slots. pdl: a programmatic dependent launch
    (pdl.py; sm_90+ only)."""
    M, N = out.shape
    block = 512
    _stream_sum_kernel[(M, triton.cdiv(N, block))](parts, out, out.numel(), N, *partition.args(),
                                                  SPLIT=slots, BLOCK=block, num_warps=4, **pdl_launch(pdl))
