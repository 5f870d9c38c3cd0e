"""What a rank holds after loading: its weight bytes and the device's free memory, logged once per rank."""

from __future__ import annotations

import torch
from torch import nn

from ..logs import log


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (each storage once: tied and stacked weights count once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen or t.device.type == "meta":
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def free_memory(device: torch.device) -> str:
    """The device's free / total memory as text (CUDA), or 'host memory' on the CPU."""
    if device.type != "cuda":
        return "host memory"
    free, total = torch.cuda.mem_get_info(device)
    return f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def log_rank_load(what: str, rank: int, world: int, model: nn.Module, read_bytes: int, seconds: float,
                  device: torch.device) -> None:
    log.info("rank %d of %d: %s: %.3f GB of weights held, %.3f GB read in %.1f s (%.2f GB/s), %s", rank, world, what,
             weight_bytes(model) / 1e9, read_bytes / 1e9, seconds, read_bytes / 1e9 / max(seconds, 1e-9),
             free_memory(device))
