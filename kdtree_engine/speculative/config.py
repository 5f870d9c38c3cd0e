"""How to decode: the user's speculative-decoding settings, and the round shape they resolve to.

``SpecConfig`` is what the user says (method, budget). ``RoundShape`` is what every round reads, resolved
once against the drafter: the block size, how many drafts a round uses, the tree budget (or that it is chosen
per round), and the largest verify width. The rule "no budget means the drafter's whole chain, block size - 1
drafts" lives here and nowhere else, and so does its bound: a budget above :data:`MAX_BUDGET` is an error.

Messages name the arguments (``spec=``, ``draft=``, ``budget=``); the CLI shows them as its flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SpecError
from .budget import AUTO, AUTO_MAX_BUDGET, auto_max_budget
from .tree import tree_size

SPEC_METHODS: tuple[str, ...] = ("none", "dflash", "ddtree")

# The largest DDTree a round verifies, fixed or chosen per round (``budget="auto"`` considers up to it too). A
# tree over a real vocabulary could hold far more nodes (sum over depths 1..B-1 of k^d), but the verify width, the
# cache's tree slots and the tree's buffers grow with the budget, and a budget above the tree's capacity only
# yields the full tree.
MAX_BUDGET = AUTO_MAX_BUDGET


@dataclass(frozen=True)
class SpecConfig:
    """How to decode: ``method`` none | dflash | ddtree; ``budget`` = non-root tree nodes.

    ddtree: ``budget`` None means block size - 1 (the chain's node count); ``"auto"`` picks it per
    round (see :mod:`kdtree_engine.speculative.budget`). dflash: ``budget`` is the chain's length (the first
    ``budget`` argmax drafts, at most block size - 1; None: all of them), the chain at the same verify
    width as a tree of that budget.
    """

    method: str = "none"
    budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise SpecError(f"spec={self.method!r} is not a decoding method: use one of {', '.join(SPEC_METHODS)}")
        if self.budget is not None:
            if isinstance(self.budget, str):
                if self.budget != AUTO:
                    raise SpecError(f"budget={self.budget!r} must be a positive integer or {AUTO!r}")
            elif not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
                raise SpecError(f"budget={self.budget!r} must be a positive integer or {AUTO!r}")
            if self.method == "none":
                raise SpecError(f"budget={self.budget} applies to spec=ddtree / spec=dflash only (spec is none)")
            if self.method == "dflash" and self.budget == AUTO:
                raise SpecError(f"budget={AUTO} applies to spec=ddtree only; spec=dflash takes a chain length")

    def resolve(self, block_size: int, vocab_size: int) -> "RoundShape":
        """The round shape for a drafter of ``block_size`` (1 for "none") over a vocabulary of ``vocab_size``.

        The budget's bound: dflash, the drafter's chain (block size - 1 drafts); ddtree, :data:`MAX_BUDGET`."""
        B = block_size if self.method != "none" else 1
        if self.method == "dflash" and isinstance(self.budget, int) and self.budget > B - 1:
            raise SpecError(f"budget={self.budget} for spec=dflash is longer than the drafter's chain "
                            f"(block size {B}: at most {B - 1} drafts)")
        if self.method == "ddtree" and isinstance(self.budget, int) and self.budget > MAX_BUDGET:
            raise SpecError(f"budget={self.budget} is above the largest DDTree the engine verifies "
                            f"({MAX_BUDGET} nodes, also the largest that budget={AUTO} considers)")
        auto = self.method == "ddtree" and self.budget == AUTO
        if self.method == "none":
            budget = 0
        elif auto:
            budget = auto_max_budget(B, vocab_size)
        else:
            budget = self.budget or B - 1
        return RoundShape(self.method, B, budget, auto, self.budget is not None or self.method == "ddtree",
                          vocab_size)


@dataclass(frozen=True)
class RoundShape:
    """What every round reads. ``budget``: ddtree: the tree's non-root nodes (the largest one considered when
    ``auto``); dflash: the chain's drafts; none: 0. ``reports_budget``: stats carry a budget (ddtree, or dflash
    with an explicit chain length)."""

    method: str
    block_size: int
    budget: int
    auto: bool
    reports_budget: bool
    vocab_size: int

    @property
    def drafts(self) -> bool:
        return self.method != "none"

    @property
    def chain(self) -> int:
        """Drafts the drafter proposes per round (its positions past the root that are used)."""
        return self.budget if self.method == "dflash" else self.block_size - 1

    @property
    def max_nodes(self) -> int:
        """The widest verify of a host-driven round, root included."""
        return 1 + self.budget

    @property
    def full_nodes(self) -> int:
        """N1, the verify width of a device-resident round, whose tree always has the full depth B - 1."""
        if self.method == "ddtree":
            return tree_size(self.budget, self.block_size - 1, min(self.budget, self.vocab_size)) + 1
        return 1 + self.budget

    def stats(self) -> dict[str, Any]:
        """The budget fields of a request's stats."""
        if not self.reports_budget:
            return {}
        return {"budget": AUTO if self.auto else self.budget}


def resolve_spec(spec: str | SpecConfig, drafter: Any, budget: int | str | None) -> SpecConfig:
    """The SpecConfig of a call's arguments (a ``budget`` given beside a SpecConfig replaces its own); a
    drafting method without a drafter is an error that names the ``draft`` argument."""
    sc = spec if isinstance(spec, SpecConfig) else SpecConfig(method=spec, budget=budget)
    if isinstance(spec, SpecConfig) and budget is not None:
        sc = SpecConfig(method=sc.method, budget=budget)
    if sc.method != "none" and drafter is None:
        raise SpecError(f"spec={sc.method} needs a drafter: pass draft=DIR (a DFlash drafter directory)")
    return sc
