"""Target latent KV cache: one 576-wide entry (kv_lora_rank latent + rope key) per token per layer.

Slots [0, length) hold committed tokens. A multi-token step writes its entries after them; a
causal step commits them at once, a tree step leaves them *pending* until :meth:`commit` keeps the
accepted nodes (compacted into contiguous slots) and drops the rest.
"""

from __future__ import annotations

import torch

from .errors import CacheFullError
from .config import ModelConfig
from .kernels.common import take_rows



class LatentCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.cfg = cfg
        self.capacity = max_tokens
        # [layers, S, kv_lora_rank + rope]
        self.kv = torch.zeros(cfg.num_hidden_layers, max_tokens, cfg.kv_cache_dim, dtype=dtype, device=device)
        self.length = 0
        self.pending = 0

    def reserve(self, n: int) -> int:
        """Start a step of n new tokens; returns the first slot they go to."""
        if self.length + n > self.capacity:
            raise CacheFullError(f"cache holds {self.capacity} tokens; {self.length} used, {n} more asked")
        self.pending = n
        return self.length

    def layer(self, i: int) -> torch.Tensor:
        return self.kv[i]  # [S, 576]

    def commit_all(self) -> None:
        self.length += self.pending
        self.pending = 0

    def commit(self, keep: torch.Tensor) -> None:
        """Keep pending entries ``keep`` (indices into the pending block, ascending) as the next slots."""
        n = keep.numel()
        if n > self.pending:
            raise ValueError(f"commit keeps {n} of {self.pending} pending entries")
        start = self.length
        src = self.kv[:, start:start + self.pending].index_select(1, keep.to(self.kv.device))  # [L, n, 576]
        self.kv[:, start:start + n] = src
        self.length += n
        self.pending = 0

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside [0, {self.length}]")
        self.length = n
        self.pending = 0

    def compact_static(self, start: torch.Tensor, keep: torch.Tensor) -> None:
        """Device-side commit of a tree step written at slots start.. (``start`` a [] long tensor):
        slot start + j gets the entry of slot start + keep[j], for every j < len(keep).

        No host read and fixed shapes: ``keep`` [M] lists the accepted nodes first (ascending); the
        entries after the accepted ones land past the new length, where the next step overwrites them.
        The host-side ``length`` is not changed (the caller keeps the length on the device).
        """
        M = keep.shape[0]
        src = take_rows(self.kv, start + keep, dim=1)  # [layers, M, 576]
        self.kv.index_copy_(1, start + torch.arange(M, device=self.kv.device), src)
