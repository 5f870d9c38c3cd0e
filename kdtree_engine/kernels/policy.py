"""The kernel policy: one frozen object, built once per engine from its arguments and the environment,
held by the model and passed to every kernel choice (kernels/dispatch.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..env import BACKENDS, INT4_BACKENDS, read_env
from ..logs import log_once

SHARED_PLACEMENTS = ("before", "after", "side", "router-side")
TP_SUMS = ("gather", "scatter", "all_reduce")


@dataclass(frozen=True)
class KernelPolicy:
    """batch_invariant: CUDA kernels whose per-row result does not depend on the rows sharing the launch
    (True, the default) or the fastest ones (False: cuBLAS matmuls, torch norm and attention).
    int4 / dense / attn / tree: a forced backend (None: the automatic choice; see kernels/dispatch.py).
    shared_placement: a forced CUDA placement of the MoE's shared expert, for tests that compare the
    placements (None, the product's only value: by its weight bytes and the tokens).
    tp_sum: the cross-rank sum of a tensor-parallel model (parallel/comm.py tp_sum): "gather" (all-gather, then
    a rank-order sum: batch-invariant; large messages in the scattered form), "scatter" (always all-to-all, rank-order
    sum of a slice, all-gather: the same bits) or "all_reduce"; None: gather with batch invariance on, else
    all_reduce."""

    batch_invariant: bool = True
    int4: str | None = None
    dense: str | None = None
    attn: str | None = None
    tree: str | None = None
    shared_placement: str | None = None
    tp_sum: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"KernelPolicy.batch_invariant must be a bool, got {self.batch_invariant!r}")
        for name, allowed in (("int4", INT4_BACKENDS), ("dense", BACKENDS), ("attn", BACKENDS),
                              ("tree", BACKENDS), ("shared_placement", SHARED_PLACEMENTS),
                              ("tp_sum", TP_SUMS)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"KernelPolicy.{name} must be one of {', '.join(allowed)} or None, got {value!r}")

    @classmethod
    def from_env(cls, batch_invariant: bool = True, environ: Mapping[str, str] | None = None) -> "KernelPolicy":
        """The policy of an engine: ``batch_invariant`` from its arguments, the forced backends from the
        ``KDTREE_*_BACKEND`` variables (kdtree_engine/env.py, read now). Logged once."""
        env = read_env(environ)
        policy = cls(batch_invariant=bool(batch_invariant), int4=env.int4_backend, dense=env.dense_backend,
                     attn=env.attn_backend, tree=env.tree_backend)
        policy.log()
        return policy

    def log(self) -> None:
        """Log the policy's choices, once per distinct policy."""
        if self.batch_invariant:
            msg = ("batch invariance on: dense and per-head matmuls through the batch-invariant Triton GEMM, "
                   "RMSNorm and MLA attention through their Triton kernels on cuda")
        else:
            msg = ("batch invariance off: cuBLAS matmuls, torch RMSNorm and attention on cuda (speculative "
                   "output equals plain decoding up to floating point only)")
        forced = [f"{var}={value}" for var, value in (
            ("KDTREE_INT4_BACKEND", self.int4), ("KDTREE_DENSE_BACKEND", self.dense),
            ("KDTREE_ATTN_BACKEND", self.attn), ("KDTREE_TREE_BACKEND", self.tree)) if value is not None]
        if forced:
            msg += f"; forced: {', '.join(forced)}"
        log_once(f"kernel-policy:{self}", msg)


def policy_or_env(policy: KernelPolicy | None) -> KernelPolicy:
    """``policy``, or for None the environment's (:meth:`KernelPolicy.from_env`, batch invariance on): what a
    module built without its model's policy (a test, a training script) runs."""
    return KernelPolicy.from_env() if policy is None else policy
