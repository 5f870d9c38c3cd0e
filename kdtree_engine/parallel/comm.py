"""Communication between the ranks of a tensor-parallel model, behind one object the model holds.

Every collective the model runs goes through a :class:`Communicator`: :class:`LocalCommunicator` (one process,
no ``torch.distributed``: world size 1, or one rank of a pretended group for building and timing a single
shard) and :class:`DistCommunicator` (a ``torch.distributed`` group: gloo on the CPU, NCCL on CUDA). The calls
are graph-capturable: no host reads, no Python branch on tensor values.

Cross-rank sums of partial results (after o_proj, after the MoE) go through :func:`tp_sum`, the one dispatch
point between the two implementations (``KernelPolicy.tp_sum``, see :func:`tp_sum_kind`):
  gather      all-gather the partials, add them in rank order in float32 on every rank: a row's sum does not
              depend on how many rows share the message (batch-invariant; the default with batch invariance on)
  all_reduce  the backend's all-reduce (NCCL may change its summation order with the message size)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.dispatch import ordered_sum
from ..kernels.policy import KernelPolicy
from ..kernels.reference import ordered_sum_torch
from ..logs import log_once

class Communicator:
    """The collectives of one rank. ``rank`` / ``world_size``: this rank's place in the group."""

    rank: int = 0
    world_size: int = 1

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: [N, *x.shape]."""
        raise NotImplementedError

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (the backend's order)."""
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...]: slice j goes to rank j; returns [N, ...] whose slice j is rank j's slice ``rank``."""
        raise NotImplementedError

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place on the others)."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


class LocalCommunicator(Communicator):
    """No other process. World size 1 (the default): every collective returns its input. ``world_size`` > 1
    builds ONE rank's shard of an N-rank model in one process (a benchmark of rank 0 of 8): the collectives
    return data of the right shape (copies of this rank's) but not the other ranks' values."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(self.world_size, *x.shape).contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rank].unsqueeze(0).expand(self.world_size, *x.shape[1:]).contiguous()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x


SINGLE = LocalCommunicator()


class DistCommunicator(Communicator):
    """A ``torch.distributed`` process group (the default group when ``group`` is None). NCCL gathers into one
    tensor (capturable in a CUDA graph); gloo through a list."""

    def __init__(self, group: object | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out, x, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src=src, group=self.group)
        return x

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.backend})"


def backend_for(device: torch.device) -> str:
    """The process-group backend of a device type: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def tp_sum_kind(policy: KernelPolicy) -> str:
    """The cross-rank sum the policy picks: its ``tp_sum`` when forced, else gather with batch invariance on
    and all_reduce with it off."""
    if policy.tp_sum is not None:
        return policy.tp_sum
    return "gather" if policy.batch_invariant else "all_reduce"


# What a link moves in one collective's latency (published NVLink latency x bandwidth: docs/parallel.md). The scattered
# rank-order sum costs one collective more than the gathered one and saves (N-1)(1-2/N) of the message per rank.
LATENCY_BYTES = 2_800_000


def scatter_pays(world: int, nbytes: int) -> bool:
    """Whether the scattered rank-order sum moves enough fewer bytes than the gathered one to pay its extra
    collective (never at 2 ranks: both move one message)."""
    return world > 2 and nbytes * (world - 1) * (1 - 2 / world) > LATENCY_BYTES


def tp_sum(policy: KernelPolicy, comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of the partials ``x`` [..., H] (x itself at world size 1: no collective). "gather" and
    "scatter" give the same bits (each element added in rank order in float32, rounded once); "gather" takes the
    scattered form where it moves fewer bytes (:func:`scatter_pays`)."""
    if comm.world_size == 1:
        return x
    kind = tp_sum_kind(policy)
    if kind == "gather" and scatter_pays(comm.world_size, x.numel() * x.element_size()):
        kind = "scatter"
    log_once(f"tp-sum:{kind}:{comm.world_size}", f"cross-rank sums over {comm.world_size} ranks: {kind}"
             + (" (large messages; the same bits as gather)" if kind == "scatter" and policy.tp_sum is None else ""))
    if kind == "all_reduce":
        return comm.all_reduce(x)
    if kind == "scatter":
        return scattered_rank_order_sum(policy, comm, x)
    # gathered in x's dtype (half the bytes of float32 for bf16) and added in float32: exact either way
    return ordered_sum(policy, comm.all_gather(x), x.dtype)


def scattered_rank_order_sum(policy: KernelPolicy, comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """The rank-order sum of ``x`` [..., H] as reduce-scatter + all-gather: the rows cut into N slices (padded),
    slice r of every rank sent to rank r (all-to-all), summed there in rank order, and the sums gathered. Each
    element is the same float32 rank-order sum as the gathered form's; a rank moves 2(N-1)/N of the message
    instead of N-1 times it."""
    N, H = comm.world_size, x.shape[-1]
    rows = x.reshape(-1, H)
    T = rows.shape[0]
    per = -(-T // N)
    if per * N != T:
        rows = torch.cat([rows, rows.new_zeros(per * N - T, H)])
    mine = ordered_sum(policy, comm.all_to_all(rows.view(N, per, H)), x.dtype)   # [per, H]: slice `rank`, summed
    return comm.all_gather(mine).reshape(N * per, H)[:T].reshape(x.shape)


def rank_order_sum(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``x`` (float32: the vocabulary reductions' small tensors), added in rank order on every
    rank (the same bits everywhere, and a row's sum does not depend on the other rows of the message)."""
    return ordered_sum_torch(comm.all_gather(x))
