"""Where the MoE's shared expert runs on CUDA (kernels/dispatch.py shared_placement): a side stream for small shared
experts, before the routed experts for large ones; a placement forced through the kernel policy (the tests' way
to compare them) wins. (The placements order the same kernels; on the GPU the demo's round and spec benches
decoded losslessly with the shared expert beside and before the routed experts.)"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels import dispatch
from kdtree_engine.kernels.policy import SHARED_PLACEMENTS, KernelPolicy


def test_default_placement_follows_the_shared_expert_bytes():
    p = KernelPolicy()
    for t in (1, 8, 64):
        assert dispatch.shared_placement(p, 300 << 10, t) == "side"                 # the demo: 0.3 MB
        assert dispatch.shared_placement(p, dispatch.SHARED_SIDE_BYTES - 1, t) == "side"
    k2 = 3 * 7168 * 2048 * 2                                                        # K2: 88 MB
    assert dispatch.shared_placement(p, dispatch.SHARED_SIDE_BYTES, 1) == "router-side"
    assert [dispatch.shared_placement(p, k2, t) for t in (1, 4, 8, 9, 16, 129)] == ["router-side"] * 3 + ["before"] * 3


@pytest.mark.parametrize("forced", SHARED_PLACEMENTS)
def test_forced_placement_wins(forced):
    p = KernelPolicy(shared_placement=forced)
    assert dispatch.shared_placement(p, 1, 1) == forced
    assert dispatch.shared_placement(p, 1 << 40, 64) == forced


def test_bad_placement_is_refused_by_name():
    with pytest.raises(ValueError, match="shared_placement.*sideways"):
        KernelPolicy(shared_placement="sideways")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [None, "w4a16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_every_placement_gives_the_same_bits_on_cuda(quant, tokens):
    """The placements order the same launches: the k2-tiny MoE layer gives the same bits under each (where the
    shared expert runs first, the routed experts' top-k sum adds it; else an add after both); on the INT4
    experts (the fragment kernels, graph-capturable) also replayed in a CUDA graph with fresh inputs (the side
    streams captured as a fork / join)."""
    from kdtree_engine.config import preset
    from kdtree_engine.model.moe import MoE

    cfg = preset("k2-tiny")
    g = torch.Generator(device="cuda").manual_seed(0)
    layer = MoE(cfg, dtype=torch.bfloat16, group_size=32 if quant else None).cuda()
    for t in [*layer.parameters(), *layer.buffers()]:
        if t.is_floating_point():
            t.data.copy_(torch.randn(t.shape, device="cuda", generator=g) * 0.05)
        else:                                  # INT4 words: any bits are int4 values
            t.data.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, t.shape, device="cuda", generator=g,
                                       dtype=torch.int64).to(t.dtype))
    x = (torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    x2 = (torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    outs = {}
    for place in SHARED_PLACEMENTS:
        layer.policy = KernelPolicy(shared_placement=place)   # the placement is the MoE module's choice
        outs[place] = layer(x)
        if quant:
            xb = x.clone()
            layer(xb)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = layer(xb)
            xb.copy_(x2)
            graph.replay()
            assert torch.equal(y, layer(x2)), f"{place}: graph replay differs from eager"
    for place, y in outs.items():
        assert torch.equal(y, outs["before"]), f"{place} gives other bits than 'before'"
