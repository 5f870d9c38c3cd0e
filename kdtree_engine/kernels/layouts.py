"""The storage order of INT4 words for the fragment-ordered W4A16 kernels (kernels/w4_frag.py, kernels/moe_frag.py),
in plain torch: the one-off repack at load (model/int4_order.py), its inverse for the torch paths, and which shapes
the fragment kernels take. Nothing here needs triton, so the CPU path imports it freely.

    repacked word t*GPB + g of a block of GPB groups (32*GPB k), thread lane = 4*r + t:
      nibble j   (j = 0..3) <- k = 32*g + 16*(j >> 1) + 8*(j & 1) + 2*t
      nibble j+4            <- that k + 1

(w4_frag.py says why: one word holds the 8 codes of one thread's A fragments for one quantization group.) The
engine then stores each K block of FRAG_TILE rows contiguously (frag_tile) and the scales the same way
(scale_tile): ENGINE_ORDER names that order to the kernels.
"""

from __future__ import annotations

import torch

from ..quant import pack_int4, unpack_int4

LANES_T = 4          # threads of one MMA row group that share a row (lane % 4)
GROUP = 32           # the only group size of the fragment order (one word = one group of one lane)
MAX_GPB = 8          # groups per K block: 8 (256 k) measured fastest at K2 shapes (docs/performance_history.md)
MOE_PARTITION_ROWS = 64   # rows of a partition tile of the MoE fragment kernels = a program's rows (moe_frag.MOE_WARPS
#                           warps x one 16-row MMA tile)


def frag_perm(gpb: int) -> torch.Tensor:
    """[32*gpb] int64: position p of a repacked block holds logical k = perm[p] of the same block."""
    perm = torch.empty(32 * gpb, dtype=torch.int64)
    for t in range(LANES_T):
        for g in range(gpb):
            base = (t * gpb + g) * 8
            for j in range(4):
                k = 32 * g + 16 * (j >> 1) + 8 * (j & 1) + 2 * t
                perm[base + j] = k
                perm[base + j + 4] = k + 1
    return perm


def _permute_codes(packed: torch.Tensor, gpb: int, perm: torch.Tensor, what: str) -> torch.Tensor:
    K = packed.shape[-1] * 8
    bk = 32 * gpb
    if packed.dtype != torch.int32:
        raise TypeError(f"{what}: int32 packed words required, got {packed.dtype}")
    if K % bk:
        raise ValueError(f"{what}: K={K} is not a multiple of the block {bk} (32 x gpb={gpb})")
    if packed.dim() > 2:   # one matrix at a time: the unpacked codes take 32x the words' memory
        return torch.stack([_permute_codes(p, gpb, perm, what) for p in packed.unbind(0)])
    q = unpack_int4(packed)                                              # [N, K] int8
    perm = perm.to(q.device)
    return pack_int4(q.reshape(q.shape[0], K // bk, bk)[..., perm].reshape(q.shape[0], K))


def frag_repack(packed: torch.Tensor, gpb: int) -> torch.Tensor:
    """int32 [.., N, K/8] compressed-tensors words -> the same codes in fragment order (K % (32*gpb) == 0)."""
    return _permute_codes(packed, gpb, frag_perm(gpb), "frag_repack")


FRAG_TILE = 64      # rows per tile of the fragment kernels' words and scales as the engine stores them (frag_tile,
#                     scale_tile): a program's loads of one block are one contiguous run


FRAG_CHUNK = 4      # words of one thread's 16-byte load


def frag_tile(words: torch.Tensor, gpb: int, tile: int, inverse: bool = False) -> torch.Tensor:
    """Fragment-ordered words [.., N, K/8] -> the same words with each block (32*gpb k) of each `tile` rows
    stored contiguously ([.., N/tile, blocks, tile, 4*gpb]; same shape): a program's loads of one block are
    then one contiguous run instead of `tile` runs of 16*gpb bytes. Within a row's 4*gpb words of a block,
    gpb > FRAG_CHUNK stores them chunk-major ([gpb/4 chunks, 4 threads t, 4 words]: `frag_chunks`), so that one
    16-byte load of the 4 threads of a row reads 64 contiguous bytes (whole 32-byte sectors) instead of every
    other 16 bytes of 128. inverse: back to row-major. The scales' tiles: scale_tile."""
    N, kw = words.shape[-2:]
    lead, width = words.shape[:-2], 4 * gpb

    def chunks(w: torch.Tensor, inv: bool) -> torch.Tensor:   # each block's words, chunk-major or back
        return frag_chunks(w.reshape(*lead, N, kw // width, width), gpb, inverse=inv).reshape(*lead, N, kw)

    if inverse:
        return _tile_rows(chunks(words, True), tile, width, True, "frag_tile: words")
    return chunks(_tile_rows(words, tile, width, False, "frag_tile: words"), False)


def _tile_rows(t: torch.Tensor, tile: int, width: int, inverse: bool, what: str) -> torch.Tensor:
    """[.., N, C] -> the same values with each block of `width` columns of each `tile` rows stored contiguously
    ([.., N/tile, C/width, tile, width]; same shape); inverse: back to row-major. `what` names the tensor in errors."""
    N, C = t.shape[-2:]
    if tile <= 0 or N % tile or C % width:
        raise ValueError(f"{what} {tuple(t.shape)} do not tile by {tile} rows and blocks of {width} columns")
    lead, nblk = t.shape[:-2], C // width
    src = (N // tile, nblk, tile) if inverse else (N // tile, tile, nblk)
    return t.reshape(*lead, *src, width).transpose(-3, -2).contiguous().reshape(*lead, N, C)


def scale_tile(scales: torch.Tensor, gpb: int, tile: int, inverse: bool = False) -> torch.Tensor:
    """Row-major group scales [.., N, K/32] -> the same scales with each block (gpb groups) of each `tile` rows
    stored contiguously ([.., N/tile, blocks, tile, gpb]; same shape): the scales a program reads for one block
    are then one run of tile * gpb values instead of `tile` runs of gpb (one 32-byte sector request per row).
    inverse: back to row-major."""
    return _tile_rows(scales, tile, gpb, inverse, "scale_tile: scales")


def frag_chunks(words: torch.Tensor, gpb: int, inverse: bool = False) -> torch.Tensor:
    """[.., 4*gpb] words of one row's block, thread-major ([4 threads t, gpb words g]) -> chunk-major
    ([gpb/4 chunks, t, 4 words]: word (t, g) at (g // 4) * 16 + t * 4 + g % 4) where gpb > FRAG_CHUNK; else
    unchanged. inverse: back."""
    if gpb <= FRAG_CHUNK:
        return words
    lead, chunks = words.shape[:-1], gpb // FRAG_CHUNK
    shape = (chunks, LANES_T, FRAG_CHUNK) if inverse else (LANES_T, chunks, FRAG_CHUNK)
    return words.reshape(*lead, *shape).transpose(-3, -2).contiguous().reshape(*lead, 4 * gpb)


def to_engine_order(words: torch.Tensor, gpb: int) -> torch.Tensor:
    """Checkpoint-ordered words [.., N, K/8] -> the order the engine keeps for the fragment kernels: the
    fragment repack, then FRAG_TILE-row tiles."""
    return frag_tile(frag_repack(words, gpb), gpb, FRAG_TILE)


def from_engine_order(words: torch.Tensor, gpb: int) -> torch.Tensor:
    """Inverse of to_engine_order."""
    return frag_unrepack(frag_tile(words, gpb, FRAG_TILE, inverse=True), gpb)


def to_engine_scales(scales: torch.Tensor, gpb: int) -> torch.Tensor:
    """Checkpoint (row-major) group scales [.., N, K/32] -> the order the engine keeps beside engine-ordered
    words: FRAG_TILE-row tiles (scale_tile)."""
    return scale_tile(scales, gpb, FRAG_TILE)


def from_engine_scales(scales: torch.Tensor, gpb: int) -> torch.Tensor:
    """Inverse of to_engine_scales."""
    return scale_tile(scales, gpb, FRAG_TILE, inverse=True)


def to_engine_int4(words: torch.Tensor, scales: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint-ordered words [.., N, K/8] and scales [.., N, K/32] of input width K -> both in the engine's order
    (to_engine_order, to_engine_scales at frag_gpb(K))."""
    gpb = frag_gpb(K)
    return to_engine_order(words, gpb), to_engine_scales(scales, gpb)


def from_engine_int4(words: torch.Tensor, scales: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of to_engine_int4."""
    gpb = frag_gpb(K)
    return from_engine_order(words, gpb), from_engine_scales(scales, gpb)


# the fragment kernels' keywords for words and scales in the engine's order (to_engine_order, to_engine_scales)
ENGINE_ORDER = {"tile": FRAG_TILE, "stile": FRAG_TILE}


def tile_unsupported(rows: int, tile: int, bn: int) -> str | None:
    """Why words in `tile`-row tiles cannot feed programs of `bn` rows of an [rows, K] matrix (None: they can;
    tile 0 is row-major)."""
    if tile and (tile < 0 or rows % tile or (bn % tile and tile % bn)):
        return f"tile {tile} must divide the {rows} rows and divide or be a multiple of {bn} rows per program"
    return None


def frag_unrepack(packed: torch.Tensor, gpb: int) -> torch.Tensor:
    """Inverse of frag_repack."""
    return _permute_codes(packed, gpb, torch.argsort(frag_perm(gpb)), "frag_unrepack")


def frag_gpb(K: int) -> int:
    """Groups per K block for input width K: the largest power of 2 <= MAX_GPB dividing K / 32. A function
    of K alone, so the repack at load and every launch agree."""
    if K % GROUP:
        raise ValueError(f"fragment order needs K % {GROUP} == 0, got K={K}")
    g = MAX_GPB
    while (K // GROUP) % g:
        g //= 2
    return g


def frag_unsupported(N: int, K: int, group_size: int, bn: int = 64) -> str | None:
    """Why an [N, K] INT4 weight cannot take the fragment kernels (None: it can)."""
    if group_size != GROUP:
        return f"group size {group_size} (the fragment order needs {GROUP})"
    if K % GROUP:
        return f"input width {K} not a multiple of {GROUP}"
    if N % bn:
        return f"{N} output rows not a multiple of {bn}"
    return None


def frag_moe_unsupported(H: int, I: int, group_size: int) -> str | None:
    """Why experts with hidden H and intermediate I cannot take the fragment kernels (None: they can)."""
    bn = MOE_PARTITION_ROWS
    return frag_unsupported(I, H, group_size, bn) or frag_unsupported(H, I, group_size, bn)


__all__ = ["LANES_T", "GROUP", "MAX_GPB", "MOE_PARTITION_ROWS", "frag_perm", "frag_repack", "FRAG_TILE",
           "FRAG_CHUNK", "frag_tile", "scale_tile", "frag_chunks", "to_engine_order", "from_engine_order",
           "to_engine_scales", "from_engine_scales", "to_engine_int4", "from_engine_int4", "ENGINE_ORDER",
           "tile_unsupported", "frag_unrepack", "frag_gpb", "frag_unsupported", "frag_moe_unsupported"]
