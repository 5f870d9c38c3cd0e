"""CUDA: the vectorized tree builder and accept mask run without host synchronization and return
the heap's tree; greedy speculative decoding equals plain decoding on the GPU."""

import pytest
import torch

from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.sampling import topk_logprobs
from kdtree_engine.speculative.walks import walk_flat
from kdtree_engine.speculative.tree import DraftTree, build_tree, build_tree_heap

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def graphed_build_tree(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: torch.Tensor,
                       start: torch.Tensor, replays: int = 2) -> DraftTree:
    """build_tree captured in a CUDA graph (static input buffers, warmed up on a side stream), then replayed:
    the sync-free builder is capturable and its replay returns the eager tree."""
    dev = lp.device
    s_lp, s_ids, s_root = lp.detach().clone(), ids.clone(), torch.zeros((), dtype=torch.long, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy init)
        build_tree(s_lp, s_ids, budget, s_root, 0)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree(s_lp, s_ids, budget, s_root, 0)
    for _ in range(replays):
        s_lp.copy_(lp)
        s_ids.copy_(ids)
        s_root.copy_(root_token.reshape(()))
        graph.replay()
    return DraftTree(tokens=out.tokens.clone(), parents=out.parents.clone(), depths=out.depths.clone(),
                     positions=out.depths + start, mask=out.mask.clone())


def test_vectorized_tree_no_host_sync():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    for L, V, budget in ((15, 1000, 64), (7, 50, 200), (3, 4, 100), (15, 32000, 256)):
        logits = (torch.randn(L, V, generator=g) * 3).to(dev)
        bonus = torch.tensor(5, device=dev)
        start = torch.tensor(100, device=dev)
        base, tree_of = torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(budget + 1, dtype=torch.long,
                                                                                   device=dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lp, ids = topk_logprobs(logits, budget, policy=POLICY)
            tree = build_tree(lp, ids, budget, bonus, start)
            picks = ids[:, 0].repeat(budget + 1)[:tree.num_nodes]
            walk_flat(tree.tokens, tree.parents, tree.depths, picks, base, tree_of[:tree.num_nodes], tree.num_nodes)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = build_tree_heap(lp.cpu(), ids.cpu(), budget, 5, 100)
        gt = graphed_build_tree(lp, ids, budget, bonus, start)
        for name in ("tokens", "parents", "depths", "positions", "mask"):
            assert torch.equal(getattr(ref, name), getattr(tree, name).cpu()), name
            assert torch.equal(getattr(ref, name), getattr(gt, name).cpu()), name


def test_greedy_spec_equals_plain_cuda():
    from kdtree_engine.config import preset
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.model.dflash import DFlashDrafter
    from kdtree_engine.model.target import Target
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate

    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=0, device="cuda")
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=6, mask_token_id=255, target_layer_ids=(0, 3),
                       num_target_layers=4, vocab_size=256)
    drafter = DFlashDrafter.random(dcfg, seed=0, device="cuda")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = generate(target, [5, 6, 7, 8], params).token_ids
    for spec, budget in (("dflash", None), ("dflash", 3), ("ddtree", 4), ("ddtree", 64)):
        for impl in ("auto", "vectorized"):
            r = generate(target, [5, 6, 7, 8], params, spec=spec, drafter=drafter, budget=budget, tree_impl=impl)
            assert r.token_ids == ref
