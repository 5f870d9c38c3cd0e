"""The drafter's one-launch attention on CUDA against the float64 oracle of tests/kernels/test_draft_attention.py
at the demo's shapes (block 16, 4 query heads on 2 kv heads, head dim 64) and K2-drafter-like ones (32 heads on
8, head dim 128), with and without a sliding window, contexts of 0 .. 4000 keys; and in a CUDA graph whose
context length (a device scalar) and inputs change between replays.

    pytest -m gpu tests/gpu/test_draft_attention_gpu.py -v
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from kdtree_engine.kernels.draft_attention import draft_attention  # noqa: E402
from test_draft_attention import _inputs, oracle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("window", [None, 7, 300])
@pytest.mark.parametrize("start", [0, 1, 63, 64, 517, 4000])
@pytest.mark.parametrize("shape", [(16, 4, 2, 64), (16, 32, 8, 128)])
def test_matches_oracle(shape: tuple[int, int, int, int], start: int, window: int | None) -> None:
    B, H, Hkv, d = shape
    g = torch.Generator().manual_seed(start * 31 + (window or 0) + H)
    q, kc, vc, kb, vb = _inputs(B, H, Hkv, d, 4096 + 16, torch.bfloat16, True, g)
    y = draft_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), kb.to(DEV), vb.to(DEV), torch.tensor(start, device=DEV),
                        window)
    assert _rel(y, oracle(q, kc, vc, kb, vb, start, window)) < 1e-2


def test_graph_replay_reads_fresh_length_and_inputs() -> None:
    B, H, Hkv, d, S = 16, 4, 2, 64, 1024
    g = torch.Generator().manual_seed(5)
    bufs = [t.to(DEV) for t in _inputs(B, H, Hkv, d, S, torch.bfloat16, False, g)]
    start = torch.tensor(10, device=DEV)
    draft_attention(*bufs, start)   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draft_attention(*bufs, start)
    for n in (3, 200, 1000):
        fresh = _inputs(B, H, Hkv, d, S, torch.bfloat16, False, g)
        for b, f in zip(bufs, fresh):
            b.copy_(f)
        start.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, oracle(*fresh, n, None)) < 1e-2
