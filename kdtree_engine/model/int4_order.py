"""The storage order of a module's INT4 words: the checkpoint's (compressed-tensors, as loaded) or the
fragment order of the Gluon kernels (kernels/w4_frag.py), converted in place, once.

  module                 words (int32)                         input width K
  layers.Linear          weight_packed [N, K/8]                in_features
  moe.Experts            w13_packed [E, 2I, H/8], w2_packed [E, H, I/8]   H, I

Fragment order also stores each K block of FRAG_TILE rows contiguously (frag_tile, per matrix: a
permutation of the rows' blocks, so that one program's loads of a block are one contiguous run), and the
module's scales the same way (scale_tile: `<words>` -> `<scales>` is `*_packed` -> `*_scale`).

A module starts in checkpoint order. The kernel dispatch (kernels/dispatch.int4_prepare) asks for the
order its kernel reads (`set_order`); anything that needs the checkpoint's bytes (the torch paths,
dequantized views) reads them through `checkpoint_int4`, and loading restores the
checkpoint order first (the loader calls `set_order(module, CHECKPOINT)` before it writes). The conversion is
a permutation inside each matrix (the nibbles of each row's blocks, then the rows' blocks; the scales' row
blocks; same shapes), so it needs no second copy of the weights: one matrix at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.layouts import (frag_gpb, from_engine_int4, from_engine_order, from_engine_scales, to_engine_order,
                                to_engine_scales)
from ..logs import log_once

CHECKPOINT, FRAG = "checkpoint", "frag"
_ATTR = "_int4_order"


def int4_words(module: nn.Module) -> list[tuple[str, int]]:
    """(buffer name, input width K) of the module's INT4 words; [] for dense modules."""
    if getattr(module, "group_size", None) is None:
        return []
    if hasattr(module, "weight_packed"):
        return [("weight_packed", module.in_features)]
    if hasattr(module, "w13_packed"):
        return [("w13_packed", module.hidden), ("w2_packed", module.inter)]
    return []


def scale_name(words: str) -> str:
    """The scale buffer beside INT4 words `words` (weight_packed -> weight_scale, w13_packed -> w13_scale)."""
    return words.replace("_packed", "_scale")


def order_of(module: nn.Module) -> str:
    return module.__dict__.get(_ATTR, CHECKPOINT)


@torch.no_grad()
def set_order(module: nn.Module, order: str) -> None:
    """Convert the module's INT4 words and their scales to `order` in place (no-op when already there)."""
    if order not in (CHECKPOINT, FRAG):
        raise ValueError(f"INT4 word order must be {CHECKPOINT!r} or {FRAG!r}, got {order!r}")
    if order_of(module) == order:
        return
    words = int4_words(module)
    if not words:
        raise ValueError(f"{type(module).__name__} has no INT4 words to reorder")
    for name, _ in words:
        buf = getattr(module, name)
        if buf.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"INT4 {name} would be reordered to {order} order inside a CUDA graph capture; "
                               "run one eager forward (or kernels.dispatch.prepare_int4) before capturing")
    convert = to_engine_order if order == FRAG else from_engine_order
    convert_scales = to_engine_scales if order == FRAG else from_engine_scales
    for name, k in words:
        gpb = frag_gpb(k)
        for buf, conv in ((getattr(module, name), convert), (getattr(module, scale_name(name)), convert_scales)):
            mats = buf.unbind(0) if buf.dim() == 3 else (buf,)
            for m in mats:                       # one matrix at a time: the codes take 32x the words' memory
                m.copy_(conv(m, gpb))
    module.__dict__[_ATTR] = order
    log_once(f"int4-order:{order}:{buf.device.type}",
             f"INT4 words and scales reordered in place to {order} order on {buf.device.type} (once per module)")


def checkpoint_int4(module: nn.Module, words: str, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 words `words` and their scales in checkpoint order (for the torch paths and dequantized views): the
    buffers themselves, or unrepacked / untiled copies when the module holds them in fragment order. expert:
    only that matrix of [E, ..] buffers (converted alone)."""
    w, s = getattr(module, words), getattr(module, scale_name(words))
    if expert is not None:
        w, s = w[expert], s[expert]
    if order_of(module) == CHECKPOINT:
        return w, s
    return from_engine_int4(w, s, dict(int4_words(module))[words])
