"""Where the MoE's shared expert runs on CUDA (kernels/dispatch.py shared_placement): a side stream for small shared
experts, before the routed experts for large ones, an override by KDTREE_MOE_SHARED; a bad value is refused
by name. (The placements order the same kernels; on the GPU the demo's round and spec benches decoded
losslessly with the shared expert beside and before the routed experts: bench/results/round-h200*.md,
spec-h200*.md.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kdtree_engine.kernels import dispatch as dispatch


def test_default_placement_follows_the_shared_expert_bytes(monkeypatch):
    monkeypatch.setattr(dispatch, "_SHARED", None)
    for t in (1, 8, 64):
        assert dispatch.shared_placement(300 << 10, t) == "side"                 # the demo: 0.3 MB
        assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES - 1, t) == "side"
    k2 = 3 * 7168 * 2048 * 2                                                     # K2: 88 MB
    assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES, 1) == "router-side"
    assert [dispatch.shared_placement(k2, t) for t in (1, 4, 8, 9, 16, 129)] == ["router-side"] * 3 + ["before"] * 3


@pytest.mark.parametrize("forced", dispatch.SHARED_PLACEMENTS)
def test_forced_placement_wins(monkeypatch, forced):
    monkeypatch.setattr(dispatch, "_SHARED", forced)
    assert dispatch.shared_placement(1, 1) == forced
    assert dispatch.shared_placement(1 << 40, 64) == forced


def test_bad_placement_is_refused_by_name():
    env = dict(os.environ, KDTREE_MOE_SHARED="sideways")
    r = subprocess.run([sys.executable, "-c", "import kdtree_engine.kernels.dispatch"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "KDTREE_MOE_SHARED" in r.stderr and "sideways" in r.stderr



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [None, "w4a16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_every_placement_gives_the_same_bits_on_cuda(monkeypatch, quant, tokens):
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
    for place in dispatch.SHARED_PLACEMENTS:
        monkeypatch.setattr(dispatch, "_SHARED", place)
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
