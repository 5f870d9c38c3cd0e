"""Paged latent cache addressing: slot s of a request lives at (table[s // BLOCK], s % BLOCK) of one layer's
pool [num_blocks, BLOCK, D]. The torch paths read a request's slots as a contiguous copy through its table;
the Triton kernels do the same address math per key (kernels/mla_attention.py)."""

from __future__ import annotations

import torch


def page_rows(table: torch.Tensor, slots: torch.Tensor, block: int) -> torch.Tensor:
    """Rows of a layer's pool viewed as [num_blocks * block, D] that hold the request's ``slots`` [n] (device
    work only: a captured graph can run it)."""
    slots = slots.to(torch.long)
    return table.to(torch.long).index_select(0, slots // block) * block + slots % block


def gather_slots(kv: torch.Tensor, table: torch.Tensor, end: int, begin: int = 0) -> torch.Tensor:
    """Slots [begin, end) of a request, contiguous: kv [num_blocks, BLOCK, D] read through ``table`` -> a copy
    [end - begin, D] (the pages that hold them, then the rows cut out)."""
    block, D = kv.shape[1], kv.shape[2]
    first, last = begin // block, -(-end // block)
    rows = kv.index_select(0, table[first:last]).reshape((last - first) * block, D)
    return rows[begin - first * block:end - first * block]


def contiguous_table(rows: int, block: int, device: torch.device) -> torch.Tensor:
    """The table of a contiguous buffer of ``rows`` slots seen as pages of ``block``: page i is block i."""
    return torch.arange(-(-rows // block), dtype=torch.int32, device=device)
