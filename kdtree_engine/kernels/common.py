"""Small pieces every Triton kernel module shares: the interpreter switch, the supported dtypes and the
lookup in an M-bucket config table."""

from __future__ import annotations

import os
from typing import Sequence, TypeVar

import torch

C = TypeVar("C")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation dtypes the kernels take


def interpreting() -> bool:
    """Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def bucket(table: Sequence[tuple[int, C]], size: int) -> C:
    """The config of the first (max size, config) entry with size <= max size; the last one beyond."""
    for max_size, cfg in table:
        if size <= max_size:
            return cfg
    return table[-1][1]


def take_rows(x: torch.Tensor, idx: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """x.index_select(dim, idx), copied by torch's elementwise index kernel (advanced indexing): for up to 16
    indices index_select runs its small-index kernel, which walks the indices one after another, each a
    dependent load (measured on an H200: docs/performance_history.md), where the elementwise kernel copies every
    element at once. The same values (a copy)."""
    if dim == 0:
        return x[idx]
    return x[(slice(None),) * dim + (idx,)]
