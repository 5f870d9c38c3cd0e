"""What a rank holds: its weight bytes and the device's free memory after loading (logged by rank 0 for every rank),
and the bytes of a rank's shard counted from shapes."""

from __future__ import annotations

import torch
from torch import nn

from ..logs import log
from .comm import Communicator


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


def free_memory(device: torch.device) -> tuple[float, float]:
    """(free, total) bytes of a CUDA device's memory; (-1, -1) on the CPU (host memory is not reported)."""
    if device.type != "cuda":
        return -1.0, -1.0
    free, total = torch.cuda.mem_get_info(device)
    return float(free), float(total)


def log_load(comm: Communicator, what: str, model: nn.Module, read_bytes: int, seconds: float,
             device: torch.device) -> None:
    """Every rank's weight bytes, bytes read, read rate and free memory, gathered to rank 0 and logged there one
    line per rank (a collective: every rank calls it after loading)."""
    mine = torch.tensor([weight_bytes(model), read_bytes, seconds, *free_memory(device)], dtype=torch.float64,
                        device=device)
    for r, (held, read, secs, free, total) in enumerate(comm.all_gather(mine).tolist()):
        if comm.rank != 0:
            return
        mem = "host memory" if total < 0 else f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
        log.info("rank %d of %d: %s: %.3f GB of weights held, %.3f GB read in %.1f s (%.2f GB/s), %s", r,
                 comm.world_size, what, held / 1e9, read / 1e9, secs, read / 1e9 / max(secs, 1e-9), mem)


def shard_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, counted from shapes (works on the meta device)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def latent_bytes_per_token(num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
    """The latent cache of one token on one rank: every rank holds the whole latent (all heads read it)."""
    return num_layers * (kv_lora_rank + rope_dim) * dtype.itemsize
