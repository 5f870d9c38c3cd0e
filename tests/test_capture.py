"""What makes a captured graph stale (kdtree_engine/model/capture.py): a weight it read replaced (a reload rebuilds the
derived weights) or the rope tables grown; a weight derived after the capture, which the graph never read, does not."""

import random

from kdtree_engine.config import preset
from kdtree_engine.model.capture import derived_owners, replaced, watched
from kdtree_engine.model.target import Target


def test_only_what_was_read_makes_a_graph_stale():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target = Target.random(preset("k2-tiny").replace(num_hidden_layers=2, vocab_size=96), seed=seed)
    owners = derived_owners([target])
    attn = target.layers[random.Random(seed).randrange(2)].self_attn
    attn.reset_absorbed()
    at_capture = watched(target, owners)
    read = attn.absorbed_weights()                  # derived after the capture: never read by it
    later = watched(target, owners)
    assert later != at_capture and not replaced(at_capture, later)
    attn.reset_absorbed()                           # a reload: the weights the graph read are gone ...
    assert replaced(later, watched(target, owners))
    attn.absorbed_weights()                         # ... and rebuilt elsewhere (``read`` holds the old address;
    assert replaced(later, watched(target, owners))  # rebuilt at the same one, the graph would read the new values)
    del read
    now = watched(target, owners)
    target.rope.ensure(target.rope.cos.shape[0] * 4)   # the tables grown: new addresses
    assert replaced(now, watched(target, owners))
