"""Expert parallelism: a rank applies only the routed experts it owns to the routes every rank computed."""

from __future__ import annotations

import torch


def owned_routes(ids: torch.Tensor, weights: torch.Tensor, owned: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Global routes (ids [T, k], weights [T, k]) -> this rank's: ids of owned experts made local (id - first),
    a route to another rank's expert becomes local expert 0 with weight exactly 0 (it adds 0 to the token's
    sum; no host read, the same shapes for every step)."""
    local = ids - owned.start
    mine = (local >= 0) & (local < len(owned))
    return torch.where(mine, local, torch.zeros_like(local)), torch.where(mine, weights, torch.zeros_like(weights))
