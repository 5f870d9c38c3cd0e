"""The load-aware budget of tree slots (``budget="auto"`` for greedy requests in a batch): one tree budget a step for
every slot of a group, chosen from what each budget has delivered.

A step of a group costs what it costs as a whole (one replay and one read: every slot's draft pass, one verify
forward over every slot's tree), so the choice is the group's: the budget whose measured tokens per second over the
group's slots is the highest, where a budget's tokens per slot and step are the running mean of what its steps
emitted (1 for budget 0: a plain step) and its seconds the recent median of its steps at this slot count (a step
that captured a graph is not a sample). As the batch grows, a verify forward over many trees costs more than the
tokens it adds, and budget 0 wins: speculation shrinks with the load.

A group looks near its best, not everywhere: at each slot count it tries the best budget (at a count not measured
yet, the best of the nearest count measured: the rates move smoothly with the load), the rungs next to it on the
ladder, and budget 0 (a plain step: the draft pass makes trees a step apart from it, so it is always weighed); a
neighbour that wins becomes the best and its own neighbours are tried next. Until a group has run ``BACKOFF_MAX``
steps at a slot count, only the budgets along that climb are measured there (each try at a new (slot count, budget)
captures a graph); after that the far rungs are tried too, now and then, so a rate that is not single-peaked along
the ladder is still found in a long run. Nothing but the best
is tried until the group has run ``SETTLE`` steps in a row at a slot count: the counts a burst's tail passes through
as its requests end (the slots halve) would each capture graphs for tries that a few steps cannot repay. No tree
is tried where plain steps were the best at fewer slots (a tree's verify rows grow with the slots; a plain step's
cost less), and such a slot count prefers plain steps outright. One that lost is tried again after a wait that
doubles with each loss (up to ``BACKOFF_MAX`` steps; ``NEAR_MAX`` for one within ``NEAR`` of the best, whose loss
may be its estimate's noise), so the price of looking is a step now and then. The choice never changes a request's
tokens (every budget emits the target's greedy picks), only how many a step brings.
"""

from __future__ import annotations

from typing import Callable

from ..speculative.budget import RecentMedian, RunningMean

LADDER = (4, 8, 16, 32)   # the tree budgets a group weighs besides 0 (up to the request's cap)
START = 16                # the first budget tried where nothing is measured (the largest rung up to it)
BACKOFF_MAX = 256         # steps at most between two tries of a budget that lost
FIRST_WAIT = 2            # steps before a budget that lost is tried again the first time
NEAR, NEAR_MAX = 0.9, 16  # a budget within this share of the best's rate waits at most this many steps
SETTLE = 8                # steps in a row at a slot count before other budgets are tried there


def ladder(cap: int) -> tuple[int, ...]:
    """Budget 0 (plain steps) and the tree budgets up to ``cap`` (``cap`` itself when no rung fits)."""
    return (0,) + (tuple(b for b in LADDER if b <= cap) or (cap,))


class SlotBudget:
    """The per-step budget of one group of tree slots."""

    def __init__(self, cap: int, plain_rate: Callable[[int], float | None] | None = None) -> None:
        self.budgets = ladder(cap)
        self.plain_rate = plain_rate   # plain batched steps outside the slots: tokens per second at a slot count
        self.seconds: dict[tuple[int, int], RecentMedian] = {}     # (budget, slots) -> a step's seconds
        self.tokens = {b: RunningMean(prior=1.0) for b in self.budgets if b}   # per slot and step
        self.wait = {b: FIRST_WAIT for b in self.budgets}                     # its next try waits this many steps
        self.due = {b: 0 for b in self.budgets}                      # ... until this step
        self.step = 0
        self.since: dict[int, int] = {}   # slot count -> the step a group first ran at it
        self.count, self.stay = 0, 0      # the slot count of the last step, and the steps in a row at it

    def rate(self, budget: int, slots: int) -> float | None:
        """Tokens per second of a step at ``budget`` over ``slots`` slots (None: not measured there); for budget 0
        the better of the slots' own plain steps and the plain batched steps outside them (which run ahead of
        their reads, where the slots' plain steps wait for theirs), as the group would run once handed over."""
        sec = self.seconds.get((budget, slots))
        own = None
        if sec is not None and sec.n > 0:
            own = (self.tokens[budget].value if budget else 1.0) / max(sec.value, 1e-9)
        outside = self.plain_rate(slots) if budget == 0 and self.plain_rate is not None else None
        return own if outside is None else outside if own is None else max(own, outside)

    def plain_below(self, slots: int) -> bool:
        """Whether plain steps were the best at some smaller slot count (halving from ``slots``): then no tree is tried
        at ``slots`` (a step's tree rows grow with the slots and a plain step's cost less, so a tree that lost with
        fewer slots loses here too). The counts from the smallest up, each judged with no tree ruled out (a count
        where one would be is past the first that answers); ``below`` in the helpers is this answer."""
        m, chain = slots // 2, []
        while m >= 1:
            chain.append(m)
            m //= 2
        return any(self.rate(0, m) is not None and self._prefers_plain(m, False) for m in reversed(chain))

    def _measured_best(self, slots: int, below: bool) -> int | None:
        rates = {b: r for b in self.budgets if not (below and b) and (r := self.rate(b, slots)) is not None}
        return max(rates, key=lambda b: (rates[b], -b)) if rates else None

    def _best(self, slots: int, below: bool) -> int:
        got = self._measured_best(slots, below)
        if got is not None:
            return got
        if below:
            return 0
        counts = sorted({n for (_, n) in self.seconds}, key=lambda n: (abs(n.bit_length() - slots.bit_length()), n))
        for n in counts:
            near = self._measured_best(n, self.plain_below(n))
            if near is not None:
                return near
        return max((b for b in self.budgets if b <= START), default=self.budgets[-1])

    def _candidates(self, slots: int, below: bool) -> tuple[int, ...]:
        i = self.budgets.index(self._best(slots, below))
        near = {0, *self.budgets[max(i - 1, 0):i + 2]}
        return tuple(b for b in self.budgets if b in near and not (below and b))

    def _prefers_plain(self, slots: int, below: bool) -> bool:
        return below or (self._measured_best(slots, below) == 0
                         and all(self.rate(b, slots) is not None for b in self._candidates(slots, below)))

    def best(self, slots: int) -> int:
        """The best measured at ``slots`` slots; where none is: the best of the nearest slot count measured (the
        smaller of two as near), else the start."""
        return self._best(slots, self.plain_below(slots))

    def prefers_plain(self, slots: int) -> bool:
        """Whether plain steps are the best at ``slots`` slots: they were at fewer slots, or budget 0 is the best
        measured here and every budget weighed here has been measured."""
        return self._prefers_plain(slots, self.plain_below(slots))

    def settled(self, slots: int) -> bool:
        """Whether the group has run more than ``SETTLE`` steps in a row at ``slots`` slots, the last at the best."""
        return self.count == slots and self.stay > SETTLE and self.rate(self.best(slots), slots) is not None

    def choose(self, slots: int) -> int:
        """This step's budget: the best if not measured here yet or the group has not settled at this slot count, else a
        weighed budget due for a try (never measured at this slot count, or its wait over), else the best."""
        self.step += 1
        self.since.setdefault(slots, self.step)
        self.stay = self.stay + 1 if slots == self.count else 1
        self.count = slots
        below = self.plain_below(slots)
        best = self._best(slots, below)
        if self.rate(best, slots) is None or self.stay <= SETTLE:
            return best
        weighed = self._candidates(slots, below)
        if self.step - self.since[slots] >= BACKOFF_MAX:   # long at this count: the far rungs too
            weighed = tuple(b for b in self.budgets if not (below and b))
        for b in weighed:
            if b != best and (self.rate(b, slots) is None or self.due[b] <= self.step):
                return b
        return best

    def record(self, budget: int, slots: int, seconds: float, tokens: float | None, captured: bool) -> None:
        """A step's outcome: its seconds, the tokens a held slot emitted on average (None: no slot held a request),
        whether it captured a graph (then its seconds are not a sample)."""
        if tokens is not None and budget:
            self.tokens[budget].update(tokens)
        if not captured:
            self.seconds.setdefault((budget, slots), RecentMedian()).update(seconds)
        best = self.best(slots)
        top = self.rate(best, slots)
        this = (self.tokens[budget].value if budget else 1.0) / max(seconds, 1e-9)   # this step alone
        if best == budget or (not captured and top is not None and this > top):
            self.wait[budget] = FIRST_WAIT   # the best, or a try that beat it: soon again (its median lags)
            self.due[budget] = self.step + FIRST_WAIT
        else:   # it lost: its next try waits twice as long (a near one not long: its estimate may be what lost)
            mine = self.rate(budget, slots)
            near = mine is not None and top is not None and mine >= NEAR * top
            self.due[budget] = self.step + self.wait[budget]
            self.wait[budget] = min(2 * self.wait[budget], NEAR_MAX if near else BACKOFF_MAX)
