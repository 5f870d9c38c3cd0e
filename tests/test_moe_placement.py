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
    assert dispatch.shared_placement(300 << 10) == "side"                        # the demo: 0.3 MB
    assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES - 1) == "side"
    assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES) == "before"
    assert dispatch.shared_placement(3 * 7168 * 2048 * 2) == "before"           # K2: 88 MB


@pytest.mark.parametrize("forced", dispatch.SHARED_PLACEMENTS)
def test_forced_placement_wins(monkeypatch, forced):
    monkeypatch.setattr(dispatch, "_SHARED", forced)
    assert dispatch.shared_placement(1) == forced
    assert dispatch.shared_placement(1 << 40) == forced


def test_bad_placement_is_refused_by_name():
    env = dict(os.environ, KDTREE_MOE_SHARED="sideways")
    r = subprocess.run([sys.executable, "-c", "import kdtree_engine.kernels.dispatch"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "KDTREE_MOE_SHARED" in r.stderr and "sideways" in r.stderr



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [None, "w4a16"])
def test_every_placement_gives_the_same_bits_on_cuda(monkeypatch, quant):
    """The placements order the same launches: the k2-tiny MoE layer gives the same bits under each, eager and
    replayed in a CUDA graph with fresh inputs (the side streams captured as a fork / join)."""
    from kdtree_engine.config import preset
    from kdtree_engine.model.moe import MoE

    cfg = preset("k2-tiny")
    torch.manual_seed(0)
    layer = MoE(cfg, dtype=torch.bfloat16, group_size=32 if quant else None).cuda()
    for t in [*layer.parameters(), *layer.buffers()]:
        if t.is_floating_point():
            t.data.normal_(0, 0.05)
        else:                                  # INT4 words: any bits are int4 values
            t.data.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, t.shape, device=t.device, dtype=torch.int64).to(t.dtype))
    x = torch.randn(5, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    outs = {}
    for place in dispatch.SHARED_PLACEMENTS:
        monkeypatch.setattr(dispatch, "_SHARED", place)
        eager = layer(x)
        xb = x.clone()
        graph = torch.cuda.CUDAGraph()
        layer(xb)
        with torch.cuda.graph(graph):
            y = layer(xb)
        xb.copy_(x)
        graph.replay()
        assert torch.equal(y, eager), f"{place}: graph replay differs from eager"
        outs[place] = eager
    first = outs["before"]
    for place, y in outs.items():
        assert torch.equal(y, first), f"{place} gives other bits than 'before'"
