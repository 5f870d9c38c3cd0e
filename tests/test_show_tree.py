"""``show_tree``: the ASCII tree marks exactly the accepted nodes; decode records the last drafting round."""

from __future__ import annotations

import re

import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.show_tree import format_tree, render_last_round
from kdtree_engine.speculative.accept import accept_reference
from kdtree_engine.speculative.decode import generate
from kdtree_engine.speculative.tree import build_tree_heap, chain_tree
from kdtree_engine.sampling import topk_logprobs
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

CFG = preset("k2-tiny")
NODE = re.compile(r"\[(\d+)\]")


def marked(text: str) -> set[int]:
    return {int(NODE.search(line).group(1)) for line in text.splitlines() if line.endswith("  *")}


def node_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if NODE.search(line)]


def small_tree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 2
    lp, ids = topk_logprobs(logits, 10, policy=POLICY)
    return build_tree_heap(lp, ids, 10, root_token=3, start=7)


@pytest.mark.parametrize("seed", range(4))
def test_marks_exactly_the_accepted_nodes(seed) -> None:
    tree = small_tree()
    toks = tree.tokens.tolist()
    # picks that follow the tree down a random branch for a while, then leave it
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, 12, (tree.num_nodes,), generator=g)
    cur = 0
    for _ in range(seed):
        kids = [i for i in range(1, tree.num_nodes) if tree.parents[i] == cur]
        if not kids:
            break
        cur = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
        picks[int(tree.parents[cur])] = toks[cur]
    accepted, bonus = accept_reference(tree, picks)
    text = format_tree(tree, accepted, decode=lambda t: f"t{t}", bonus=bonus)
    assert marked(text) == set(accepted)
    assert len(node_lines(text)) == tree.num_nodes
    assert {int(NODE.search(l).group(1)) for l in node_lines(text)} == set(range(tree.num_nodes))
    assert text.splitlines()[-1] == f"bonus: 't{bonus}' (id {bonus})"


def test_children_are_indented_under_their_parent() -> None:
    tree = small_tree()
    text = format_tree(tree, [0], decode=None)
    lines = node_lines(text)
    assert lines[0].startswith("[0] id 3 d0 root")
    # depth in the drawing (4 columns a level) equals the node's depth
    for line in lines[1:]:
        i = int(NODE.search(line).group(1))
        col = line.index("[")
        assert col // 4 == int(tree.depths[i]), line
    assert "lp" not in text  # no log-probs given


def test_text_is_repr_and_truncated() -> None:
    tree = chain_tree(5, torch.tensor([6, 7]), 0)
    text = format_tree(tree, [0, 1], decode=lambda t: "x" * 40 if t == 6 else "\n", logprobs=[None, -0.5, -1.25])
    assert "'\\n' (id 7)" in text and "...'" in text and "lp -0.50" in text and "lp -1.25" in text
    assert marked(text) == {0, 1}
    with pytest.raises(ValueError):
        format_tree(tree, [0, 5])


@pytest.fixture(scope="module")
def one_thread():
    # tiny matmuls: one thread is much faster than several contending for a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(one_thread):
    target = Target.random(CFG, seed=0)
    dcfg = DraftConfig(hidden_size=CFG.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=CFG.vocab_size - 1,
                       target_layer_ids=(0, 2), num_target_layers=CFG.num_hidden_layers, vocab_size=CFG.vocab_size)
    return target, DFlashDrafter.random(dcfg, seed=1)


@pytest.mark.parametrize("spec,budget", [("ddtree", 6), ("dflash", None)])
def test_generation_records_the_last_round(models, spec, budget) -> None:
    target, drafter = models
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    res = generate(target, [3, 1, 4, 1, 5], params, spec=spec, drafter=drafter, budget=budget)
    plain = generate(target, [3, 1, 4, 1, 5], params)
    assert res.token_ids == plain.token_ids  # recording the round changes nothing
    tree, acc = res.last_tree, res.last_accepted
    assert tree is not None and acc[0] == 0 and tree.num_nodes >= 2
    parents = tree.parents.tolist()
    assert all(parents[b] == a for a, b in zip(acc, acc[1:]))  # a root path
    lps = res.last_draft_logprobs
    assert len(lps) == tree.num_nodes and lps[0] is None and all(x <= 0 for x in lps[1:])
    # the accepted drafts and the bonus are the tail of the generated tokens
    toks = tree.tokens.tolist()
    emitted = [toks[i] for i in acc[1:]] + [res.last_bonus]
    n = len(res.token_ids)
    assert any(res.token_ids[k:k + len(emitted)] == emitted for k in range(n - len(emitted) + 1))
    text = render_last_round(res, None)
    assert marked(text) == set(acc)
    assert text.splitlines()[0].startswith(f"last drafting round ({spec}")


def test_plain_decoding_has_no_tree(models) -> None:
    target, _ = models
    res = generate(target, [3, 1, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    assert res.last_tree is None
    assert "no draft tree" in render_last_round(res, None)
