"""Expert parallelism: a rank applies only the routed experts it owns to the routes every rank computed."""

from __future__ import annotations

import torch

# the expert id of a route that another rank serves: every MoE path skips ids outside [0, E)
NOT_OWNED = -1


def owned_routes(ids: torch.Tensor, weights: torch.Tensor, owned: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Global routes (ids [T, k], weights [T, k]) -> this rank's: ids of owned experts made local (id - first), a
    route to another rank's expert becomes NOT_OWNED with weight 0, which no path computes (no host read, the same
    shapes for every step)."""
    local = ids - owned.start
    mine = (local >= 0) & (local < len(owned))
    return (torch.where(mine, local, torch.full_like(local, NOT_OWNED)),
            torch.where(mine, weights, torch.zeros_like(weights)))
