"""The drafter's batched pass over static slots, replayed from a CUDA graph.

An eager draft pass launches every kernel from Python (milliseconds for a small drafter, more than a replayed target
step), so in a batch a tree round lost to plain decoding before its tree was built. Here each drafting request owns a
slot for its life: a draft cache of the slots' capacity (the cache's address is the slot's, so a graph captured over
the slots stays valid as requests come and go), and rows of the slots' static inputs: its context rows [B, K*D] and
their count, its committed length and its block [bonus, MASK x (B-1)]. A pass is the device-resident draft pass
(:meth:`DFlashDrafter.context` with a device start: no host read) of every slot at once, row-wise work over all their
rows, and the drafter logits of every slot; it is captured once per slot count and capacity and replayed.

A slot whose request does not draft this step runs too, on a scratch context: no context rows, its block at the end of
its cache, past anything its request has committed (the capacity holds a block past the request's last token), where
its next real pass writes before any query reads. A request's drafts can differ from its solo run's in the last bits
(the pass reads the whole cache under a mask, not the committed rows alone); its tokens cannot: the target verifies
every draft, so the emitted tokens are the target's picks either way.
"""

from __future__ import annotations

from typing import Any

import torch

from ..logs import log, log_once
from ..model.capture import CapturedStep, derived_owners, watched
from ..model.dflash import DraftCache
from ..model.target import Target
from ..speculative.graph import capacity_bucket

MIN_SLOTS = 1   # slots made at first; doubled when a request finds none free (a lone request runs no empty slots)


def shrunk(slots: int, held: int) -> int:
    """The slot count after a burst: halved (down to MIN_SLOTS) while at most a quarter of the slots hold requests
    (a pass runs every slot: a few requests must not pay for many empty ones)."""
    while slots > MIN_SLOTS and held <= slots // 4:
        slots //= 2
    return slots


def move_first(caches: list[DraftCache], keep: list[int]) -> None:
    """Slot j < len(keep) takes the draft cache contents of slot keep[j] (keep ascending: slot j's source is at j or
    later, not yet written); the cache objects stay where they are (graphs captured over them stay valid)."""
    for j, i in enumerate(keep):
        if i != j:
            caches[j].k.copy_(caches[i].k)
            caches[j].v.copy_(caches[i].v)
            caches[j].length = caches[i].length


def draft_logits(target: Target, drafter: Any, ctx: torch.Tensor, n_ctx: torch.Tensor, caches: list[DraftCache],
                 starts: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The device-resident draft pass of every slot at once (row-wise work over all their rows, attention per slot
    over its own cache): context rows ctx [S, B, K*D] of which n_ctx [S] are new, committed lengths starts [S],
    blocks [S, B] -> draft logits [S * (B-1), V]."""
    S, B = blocks.shape
    h = drafter.forward_batch([(ctx[i], caches[i], starts[i]) for i in range(S)], target.embed(blocks.reshape(-1)),
                              n_ctx=[n_ctx[i] for i in range(S)])
    return target.lm_head(h.view(S, B, -1)[:, 1:].reshape(S * (B - 1), -1))


class SlotSet:
    """The slots of one capacity: their draft caches, static inputs, logits and graphs. The buffers hold ``room``
    slots; a pass over n slots reads their first n rows and is captured once per n, so a slot count seen before a
    shrink replays its graph after it (the held requests' caches are copied to the first slots, not moved)."""

    def __init__(self, target: Target, drafter: Any, capacity: int, slots: int, mode: str) -> None:
        self.target, self.drafter, self.capacity, self.mode = target, drafter, capacity, mode
        self.room, self.n = 0, 0
        self.buf: dict[str, torch.Tensor] = {}
        self.caches: list[DraftCache] = []
        self.graphs: dict[int, CapturedStep] = {}
        self.logits: dict[int, torch.Tensor] = {}   # by slot count: the pass's output (a graph's, replayed in place)
        self.free: list[int] = []
        self.pool: Any = None   # the graphs' memory pool (a new one each time the buffers grow)
        self.resize(slots, [])

    @property
    def slots(self) -> int:
        return self.n

    def _grow(self, room: int) -> None:
        """Buffers and caches for ``room`` slots (the graphs over the old buffers dropped)."""
        target, drafter, dev, B = self.target, self.drafter, self.target.device, self.drafter.cfg.block_size
        feat = len(drafter.target_layer_ids) * target.cfg.hidden_size
        self.buf = {"ctx": torch.zeros(room, B, feat, dtype=target.dtype, device=dev),
                    "n_ctx": torch.zeros(room, dtype=torch.long, device=dev),
                    "starts": torch.full((room,), self.capacity - B, dtype=torch.long, device=dev),
                    "blocks": torch.full((room, B), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)}
        self.caches += [drafter.new_cache(self.capacity) for _ in range(room - self.room)]
        self.room = room
        self.graphs.clear()
        self.logits.clear()
        # a new pool for the graphs over the new buffers: a pool whose graphs are all gone cannot take a capture
        # while a tensor made in it lives on (PyTorch's caching allocator asserts)
        self.pool = None

    def resize(self, n: int, keep: list[int]) -> None:
        """``n`` slots, slot j < len(keep) taking slot keep[j]'s draft cache (keep ascending), the others free."""
        if n > self.room:
            self._grow(n)
        move_first(self.caches, keep)
        self.n = n
        self.ctx, self.n_ctx, self.starts, self.blocks = (self.buf[k][:n] for k in ("ctx", "n_ctx", "starts", "blocks"))
        self.free = list(range(len(keep), n))[::-1]   # the lowest taken first

    def run(self) -> None:
        """Every slot's draft pass (the captured body): logits [slots * (B-1), V]."""
        self.logits[self.n] = draft_logits(self.target, self.drafter, self.ctx, self.n_ctx, self.caches[:self.n],
                                           self.starts, self.blocks)


class DraftSlots:
    """The slots of a :class:`~.scheduler.Scheduler`'s drafting requests (``mode`` "graph": the pass replayed from a
    CUDA graph; "static": run eagerly, the graph's arithmetic on any device)."""

    def __init__(self, target: Target, drafter: Any, mode: str) -> None:
        self.target, self.drafter, self.mode = target, drafter, mode
        self.sets: dict[int, SlotSet] = {}
        self.owners = derived_owners([target, drafter])
        self.captures = 0
        log_once(f"draft-slots:{mode}", "batched draft passes over static slots"
                 + (" replayed from CUDA graphs" if mode == "graph" else " (run eagerly)"))

    def take(self, tokens: int) -> tuple[int, int]:
        """A slot whose draft cache holds ``tokens`` positions and a block past them: (capacity, slot)."""
        cap = capacity_bucket(tokens + self.drafter.cfg.block_size)
        held = self.sets.get(cap)
        if held is None:
            held = self.sets[cap] = SlotSet(self.target, self.drafter, cap, MIN_SLOTS, self.mode)
        elif not held.free:   # the requests holding slots keep them (and their caches)
            held.resize(2 * held.slots, list(range(held.slots)))
            log.debug("draft slots: %d of capacity %d", held.slots, cap)
        return cap, held.free.pop()

    def shrink(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Capacities where at most a quarter of the slots hold requests: the slots halved (down to MIN_SLOTS) until
        more do, the held ones (their caches) moved to the first slots (a pass runs every slot). Returns {old slot:
        new slot} of the moved requests."""
        moved: dict[tuple[int, int], tuple[int, int]] = {}
        for cap, held in list(self.sets.items()):
            taken = sorted(set(range(held.slots)) - set(held.free))
            n = shrunk(held.slots, len(taken))
            if n == held.slots:
                continue
            held.resize(n, taken)
            moved.update({(cap, i): (cap, j) for j, i in enumerate(taken)})
            log.debug("draft slots: %d of capacity %d, %d held", n, cap, len(taken))
        return moved

    def cache(self, where: tuple[int, int]) -> DraftCache:
        return self.sets[where[0]].caches[where[1]]

    def give(self, where: tuple[int, int]) -> None:
        """A request's slot back (its cache is kept for the next request)."""
        self.sets[where[0]].free.append(where[1])

    def propose(self, asks: list[tuple[tuple[int, int], torch.Tensor | None, torch.Tensor, int]]) -> list[torch.Tensor]:
        """Draft logits [B-1, V] for each ask (slot, context rows [R, K*D] or None, bonus [], start): each capacity's
        slots in one pass. Rows past a block's worth go into the cache eagerly first (a request's first pass holds
        its prompt's)."""
        B = self.drafter.cfg.block_size
        out: list[torch.Tensor | None] = [None] * len(asks)
        for cap, held in self.sets.items():
            mine = [k for k, a in enumerate(asks) if a[0][0] == cap]
            if not mine:
                continue
            n_ctx, starts = [0] * held.slots, [cap - B] * held.slots   # idle slots: the scratch block
            rows, dest, bonus, at = [], [], [], []
            for k in mine:
                (_, i), ctx, b, start = asks[k]
                r = 0 if ctx is None else ctx.shape[0]
                if r > B:
                    cache = held.caches[i]
                    cache.length = start - r
                    self.drafter.append_context(ctx[:r - B], cache)
                    ctx, r = ctx[r - B:], B
                if r:
                    rows.append(ctx)
                    dest.extend(range(i * B, i * B + r))
                n_ctx[i], starts[i] = r, start
                bonus.append(b.reshape(1))
                at.append(i)
            dev = held.ctx.device
            host = torch.tensor(n_ctx + starts + at + dest, dtype=torch.long).to(dev)   # one copy
            S, A = held.slots, len(at)
            held.n_ctx.copy_(host[:S])
            held.starts.copy_(host[S:2 * S])
            slots = host[2 * S:2 * S + A]
            if rows:
                flat = held.ctx.view(S * B, -1)
                flat.index_copy_(0, host[2 * S + A:], torch.cat(rows).to(dtype=flat.dtype))
            held.blocks[:, 0].index_copy_(0, slots, torch.cat(bonus).to(dev))
            self._run(held)
            got = held.logits[S].view(S, B - 1, -1).index_select(0, slots)   # a copy: the next pass rewrites them
            for k, logits in zip(mine, got):
                out[k] = logits
        return out

    def _run(self, held: SlotSet) -> None:
        if self.mode != "graph":
            with torch.no_grad():
                held.run()
            return
        step = held.graphs.get(held.n)
        if step is None:
            target, owners = self.target, self.owners
            step = held.graphs[held.n] = CapturedStep(held.run, target.device,
                                                      lambda: watched(target, owners, rope=False), "draft pass")
        with torch.no_grad():
            held.pool, captured = step.replay(held.pool)
        if captured:
            self.captures += 1
            log.info("draft slots: captured %d slots of capacity %d", held.slots, held.capacity)

    def release(self) -> None:
        self.sets.clear()
