"""Target.forward_batch with device-resident steps (the committed length on the device, as a captured batched round
would run them) against each request's own device-resident forward (eager batches: tests/batch/test_batch_vs_solo.py)."""

import random

import torch

from kdtree_engine.config import preset
from kdtree_engine.model.target import BatchPart, Target


def _target(seed: int) -> Target:
    return Target.random(preset("k2-tiny").replace(num_hidden_layers=3, vocab_size=128), seed=seed)


def _chain_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _prefilled(target: Target, rng: random.Random, n: int):
    cache = target.new_cache(n + 40)
    ids = torch.tensor([rng.randrange(target.cfg.vocab_size) for _ in range(n)])
    target(ids, cache)
    return cache


def test_device_resident_batch_equals_each_request_alone():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target = _target(seed)
    lengths, widths = [7, 19, 3], [1, 5, 3]
    solo, parts = [], []
    for n, T in zip(lengths, widths):
        ids = torch.tensor([rng.randrange(target.cfg.vocab_size) for _ in range(T)])
        pos, mask, start = torch.arange(n, n + T), _chain_mask(T), torch.tensor(n)
        target.rope.ensure(n + T + 1)
        alone = _prefilled(target, random.Random(seed + n), n)
        solo.append(target(ids, alone, positions=pos, tree_mask=mask, start=start).logits)
        shared = _prefilled(target, random.Random(seed + n), n)
        parts.append(BatchPart(ids, shared, pos, mask, start=start))
    outs = target.forward_batch(parts)
    for want, got, p, n in zip(solo, outs, parts, lengths):
        torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
        assert p.cache.length == n   # a device-resident step leaves the host length alone


def test_a_batch_mixes_no_eager_and_device_resident_steps():
    target = _target(1)
    a, b = _prefilled(target, random.Random(1), 4), _prefilled(target, random.Random(2), 4)
    eager = BatchPart(torch.tensor([3]), a)
    static = BatchPart(torch.tensor([5]), b, torch.tensor([4]), _chain_mask(1), start=torch.tensor(4))
    try:
        target.forward_batch([eager, static])
    except ValueError as e:
        assert "all device-resident or all eager" in str(e)
    else:
        raise AssertionError("a mixed batch ran")
