"""Prompt steps per length bucket (kdtree_engine/model/prompt_graph.py) on the CPU, without capture: a prompt laid into
its bucket's padded buffers gives the logits, aux rows and cache latents of the eager prompt forward (float32: to
rounding), buckets are re-used by prompts of other lengths and other caches, and what the path does not take is
refused by name."""

import random

import pytest
import torch

from kdtree_engine.config import preset
from kdtree_engine.model.prompt_graph import MAX_BUCKET, MIN_BUCKET, PromptGraphs, bucket_of
from kdtree_engine.model.target import Target


def test_bucket_is_the_next_power_of_two():
    for t in range(1, 2000):
        assert bucket_of(t) == min(b for b in (2 ** k for k in range(12)) if b >= max(t, MIN_BUCKET))


def test_prompt_steps_equal_the_eager_prompt_forward():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cfg = preset("k2-tiny").replace(num_hidden_layers=3, vocab_size=96)
    target = Target.random(cfg, seed=seed)
    free = sorted(target.pool().free_ids())
    graphs = PromptGraphs(target, capture=False)
    for T in [rng.randint(1, 16), rng.randint(17, 64), rng.randint(1, 16), rng.randint(65, 200)]:
        ids = torch.tensor([rng.randrange(96) for _ in range(T)])
        aux = tuple(sorted(rng.sample(range(3), 2)))
        # a cache with room for the whole bucket and one without (its padded rows go to the trash block)
        room = rng.choice([T, T + 300])
        a, b = target.new_cache(room), target.new_cache(room)
        ref = target.prefill(ids, a, aux)
        assert graphs.takes(T, b)
        logits, got_aux = graphs.run(ids, b, aux)
        torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_aux, ref.aux, rtol=1e-5, atol=1e-5)
        assert b.length == a.length == T and b.pending == 0
        torch.testing.assert_close(b.kv[:, :T], a.kv[:, :T], rtol=1e-5, atol=1e-5)
        a.release()
        b.release()
        target.rope.ensure(2 * target.rope.cos.shape[0])   # a longer round moves the rope tables: buckets unaffected
    assert sorted(target.pool().free_ids()) == free


def test_prefill_takes_the_prompt_graphs_when_set():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    cfg = preset("k2-tiny").replace(num_hidden_layers=2, vocab_size=96)
    target = Target.random(cfg, seed=seed)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(seed))
    a = target.new_cache(64)
    ref = target.prefill(ids, a, (0, 1))
    target.prompt_graphs = PromptGraphs(target, capture=False)
    b = target.new_cache(64)
    out = target.prefill(ids, b, (0, 1))
    assert (40, (0, 1)) not in target.prompt_graphs.buckets and (64, (0, 1)) in target.prompt_graphs.buckets
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux, ref.aux, rtol=1e-5, atol=1e-5)


def test_what_the_path_does_not_take_is_refused():
    cfg = preset("k2-tiny").replace(num_hidden_layers=1, vocab_size=96)
    target = Target.random(cfg, seed=0)
    graphs = PromptGraphs(target, capture=False)
    long = target.new_cache(MAX_BUCKET + 10)
    assert not graphs.takes(MAX_BUCKET + 1, long)
    with pytest.raises(ValueError, match=f"takes 1..{MAX_BUCKET} tokens into an empty cache; got {MAX_BUCKET + 1}"):
        graphs.run(torch.zeros(MAX_BUCKET + 1, dtype=torch.long), long, ())
    used = target.new_cache(64)
    target.prefill(torch.tensor([1, 2, 3]), used)
    assert not graphs.takes(4, used)
    with pytest.raises(ValueError, match="after 3"):
        graphs.run(torch.tensor([4, 5]), used, ())
    with pytest.raises(ValueError, match="need a CUDA device"):
        PromptGraphs(target, capture=True)
