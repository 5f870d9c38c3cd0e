"""The drafter's batched pass over static slots (kdtree_engine/batch/draft_slots.py), run eagerly on the CPU (the
arithmetic a CUDA graph replays).

Oracles: each request's eager draft passes alone (DFlashDrafter.propose over its own draft cache) for the logits;
each request's solo run for the tokens of requests batched through a scheduler whose draft passes take the slots.
Seeds printed."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from kdtree_engine.batch.draft_slots import MIN_SLOTS, DraftSlots

N = 4   # the tests' scale: several requests, more than the first slots hold
from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.tokenizer import load_tokenizer

from batch_cases import Case, batched, first_difference, make_cases, solo


def demo():
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    return target, load_drafter(DEMO_DIR / "draft", target)


def seeded_slots() -> tuple:
    """(random source, torch generator, the demo target, its drafter, draft slots run eagerly), the seed printed."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target, drafter = demo()
    return random.Random(seed), torch.Generator().manual_seed(seed), target, drafter, DraftSlots(target, drafter,
                                                                                                   "static")


def test_slot_passes_equal_each_requests_eager_passes() -> None:
    """Requests take slots (more than the first slots: the slots double), draft in changing subsets (an idle slot
    runs on its scratch block), first passes carrying whole prompts (rows past a block go in eagerly), later passes a
    round's accepted rows; a request that ends gives its slot to a new one. Every pass's logits == the request's
    eager pass over its own cache."""
    rng, gen, target, drafter, slots = seeded_slots()
    B, V = drafter.cfg.block_size, target.cfg.vocab_size
    feat = len(drafter.target_layer_ids) * target.cfg.hidden_size

    def new_request() -> dict:
        prompt = rng.randint(1, 3 * B)
        limit = rng.randint(8, 40)
        where = slots.take(prompt + limit + 1)
        slots.cache(where).length = 0
        return {"where": where, "eager": drafter.new_cache(prompt + limit + 1), "start": prompt, "end": prompt + limit,
                "ctx": torch.randn(prompt, feat, generator=gen)}

    live = [new_request() for _ in range(N + 3)]
    for step in range(12):
        asked = [r for r in live if rng.random() < 0.7]
        if not asked:
            continue
        asks = []
        for r in asked:
            r["bonus"] = torch.tensor(rng.randrange(V))
            asks.append((r["where"], r["ctx"], r["bonus"], r["start"]))
        got = slots.propose(asks)
        for r, logits in zip(asked, got):
            want = drafter.propose(target, r["ctx"], r["bonus"], r["eager"], r["start"])
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
            accepted = rng.randint(1, B)   # the next round's context: its accepted rows
            r["start"] += accepted
            r["ctx"] = torch.randn(accepted, feat, generator=gen)
        for r in [r for r in live if r["start"] + B > r["end"]]:
            slots.give(r["where"])
            live.remove(r)
            live.append(new_request())
    assert len({r["where"] for r in live}) == len(live)
    slots.release()


def test_scheduler_over_draft_slots_keeps_solo_tokens(monkeypatch) -> None:
    """More drafting requests than the first slots, arriving at different steps, through static steps and draft
    slots (sampled requests: the greedy fixed-budget ones take tree slots, tests/batch/test_tree_slots.py): every
    request's tokens == its solo run's, every slot back once all have ended."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target, drafter = demo()
    tok = load_tokenizer(DEMO_DIR)
    # the first N + 2 together (their prompts in one step: more drafting requests than the first slots)
    cases = [Case(c.prompt, replace(c.params, max_tokens=max(c.params.max_tokens, 8), temperature=0.8),
                  "ddtree" if i % 2 else "dflash", 8 if i % 2 else None, 0 if i < N + 2 else c.arrives)
             for i, c in enumerate(make_cases(tok, 2 * N + 1, seed, max_prompt=70, max_tokens=14))]
    passes, at_close = [], []
    real_propose, real_release = DraftSlots.propose, DraftSlots.release
    monkeypatch.setattr(DraftSlots, "propose",
                        lambda self, asks: (passes.append(len(asks)), real_propose(self, asks))[1])
    monkeypatch.setattr(DraftSlots, "release", lambda self: (at_close.extend(
        (len(h.free), h.slots) for h in self.sets.values()), real_release(self))[1])
    results, _, sched = batched(target, drafter, cases, 48, token_budget=1024, step_mode="static")
    assert max(passes) > N and at_close and all(free == n for free, n in at_close)
    for i, (case, res) in enumerate(zip(cases, results)):
        ref, _ = solo(target, drafter, case, 48)
        assert res.token_ids == ref.token_ids, (i, case.method, first_difference(res.token_ids, ref.token_ids))


def test_slots_shrink_and_keep_each_requests_passes() -> None:
    """After most requests give their slots back the slots halve (at most a quarter held), the held requests' caches
    moved to the first slots; their later passes still equal their eager passes."""
    rng, gen, target, drafter, slots = seeded_slots()
    B, V = drafter.cfg.block_size, target.cfg.vocab_size
    feat = len(drafter.target_layer_ids) * target.cfg.hidden_size
    live = []
    for _ in range(16):
        prompt = rng.randint(1, 2 * B)
        where = slots.take(prompt + 40)
        slots.cache(where).length = 0
        live.append({"where": where, "eager": drafter.new_cache(prompt + 40), "start": prompt,
                     "ctx": torch.randn(prompt, feat, generator=gen)})
    for step in range(3):
        if step == 1:   # all but the last two leave (those move to the first slots)
            for r in live[:-2]:
                slots.give(r["where"])
            live = live[-2:]
            moved = slots.shrink()
            # 16 slots halved while at most a quarter hold requests: 16 -> 8 -> 4 (2 held of 4 is more than a quarter)
            assert {slots.sets[c].slots for c in slots.sets} == {max(4, MIN_SLOTS)}
            for r in live:
                r["where"] = moved.get(r["where"], r["where"])
        asks = []
        for r in live:
            r["bonus"] = torch.tensor(rng.randrange(V))
            asks.append((r["where"], r["ctx"], r["bonus"], r["start"]))
        for r, logits in zip(live, slots.propose(asks)):
            want = drafter.propose(target, r["ctx"], r["bonus"], r["eager"], r["start"])
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
            accepted = rng.randint(1, B)
            r["start"] += accepted
            r["ctx"] = torch.randn(accepted, feat, generator=gen)
    # a second burst grows the slots inside the buffers of the first (same addresses: their graphs stay valid)
    (held,) = slots.sets.values()
    room, addresses = held.room, [t.data_ptr() for t in held.buf.values()]
    for _ in range(14):   # the 2 held + 14: the first burst's 16 slots again
        slots.take(40)
    assert held.slots == 16 and held.room == room
    assert [t.data_ptr() for t in held.buf.values()] == addresses


def test_feeding_context_rows_writes_the_pass_s_cache_entries() -> None:
    """DFlashDrafter.feed_batch (a plain step's context rows into the draft caches, no pass: tree slots at budget 0)
    writes the K/V a device-resident draft pass over the same rows writes, at the committed positions."""
    rng, gen, target, drafter, _ = seeded_slots()
    B = drafter.cfg.block_size
    feat = len(drafter.target_layer_ids) * target.cfg.hidden_size
    n = 5
    caps = [rng.randint(2 * B, 6 * B) for _ in range(n)]
    starts = [rng.randint(B, c - B) for c in caps]
    n_ctx = [rng.randint(0, B) for _ in range(n)]
    rows = [torch.randn(B, feat, generator=gen) for _ in range(n)]
    passed, fed = ([drafter.new_cache(c) for c in caps] for _ in range(2))
    items = [(r, c, torch.tensor(s)) for r, c, s in zip(rows, passed, starts)]
    blocks = torch.randint(0, target.cfg.vocab_size, (n * B,), generator=gen)
    drafter.forward_batch(items, target.embed(blocks), n_ctx=[torch.tensor(k) for k in n_ctx])
    drafter.feed_batch([(r, c, torch.tensor(s)) for r, c, s in zip(rows, fed, starts)],
                       [torch.tensor(k) for k in n_ctx])
    for a, b, s, k in zip(passed, fed, starts, n_ctx):
        assert torch.equal(a.k[:, :, s - k:s], b.k[:, :, s - k:s]) and torch.equal(a.v[:, :, s - k:s], b.v[:, :, s - k:s])
        assert k == 0 or b.k[:, :, s - k:s].abs().sum() > 0   # written, not the zeros of a new cache
