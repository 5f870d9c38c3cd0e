"""The accept walk: which draft nodes the target agrees with, and the bonus token.

The target picks one token at every tree node with its own decoding rule (argmax, or an independent
sample from its temperature/top-k/top-p distribution). The walk starts at the root and moves to the
child whose token equals the target's pick at the current node, as long as one exists; the pick at
the last node reached is the bonus token. Every emitted token is therefore the target's pick given
exactly the emitted prefix, so greedy output equals plain greedy decoding and sampled output has the
target's distribution whatever the drafter proposed (picks at off-path nodes are never looked at).
Siblings carry distinct tokens, so the accepted nodes form one root-to-node path.

The walks the rounds run are elsewhere: many trees at once on the device (:mod:`.walks`, also the CPU path of a
device-resident round) and one program on CUDA (kernels/accept_walk.py); :func:`accept_reference` is the rule
written literally, their oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.policy import KernelPolicy
from ..parallel.vocab import VocabShard
from ..sampling import SamplingParams, sample
from .tree import DraftTree


@dataclass(frozen=True)
class AcceptResult:
    accepted: torch.Tensor  # [A] long: accepted node indices, root first, ascending (A >= 1)
    bonus: torch.Tensor     # [] long: the target's pick at the last accepted node

    @property
    def num_accepted(self) -> int:
        """Accepted nodes including the root (= tau for the round: drafts accepted + bonus)."""
        return int(self.accepted.shape[0])


def target_picks(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
                 policy: KernelPolicy, vocab: VocabShard | None = None) -> torch.Tensor:
    """One target token per node: logits [N1, V] -> [N1] (argmax for greedy, else a sample); ``vocab``: the
    target's vocabulary slice when tensor parallel (sampling.py)."""
    return sample(logits, params, generator, policy=policy, vocab=vocab)


def accept_reference(tree: DraftTree, picks: torch.Tensor) -> tuple[list[int], int]:
    """Host walk over child maps (the literal rule), for tests: (accepted node indices, bonus)."""
    toks, pars, pk = tree.tokens.tolist(), tree.parents.tolist(), picks.tolist()
    children: list[dict[int, int]] = [dict() for _ in toks]
    for i in range(1, len(toks)):
        children[pars[i]][toks[i]] = i
    acc, cur = [0], 0
    while pk[cur] in children[cur]:
        cur = children[cur][pk[cur]]
        acc.append(cur)
    return acc, pk[cur]
