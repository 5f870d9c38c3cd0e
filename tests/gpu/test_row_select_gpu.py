"""The per-row selections on CUDA (kernels/row_select.py): argmax_rows equals torch.argmax at the demo's
shape and at K2's vocabulary (ties to the lowest column); topk_logprobs_rows gives the stable descending
sort's ids exactly and log-probs within a few fp32 ulps of the sort minus torch.logsumexp, at the demo's
shape for k = 4 .. 128 (both selections) and at the register tile's limit; both read fresh inputs when
replayed from a CUDA graph.

    pytest -m gpu tests/gpu/test_row_select_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.row_select import TOPK_MAX_V, argmax_rows, topk_logprobs_rows, topk_logprobs_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
LP_TOL = 1e-5  # |lp - oracle| <= LP_TOL * max(1, |oracle|)


def _logits(L: int, V: int, dt: torch.dtype, seed: int) -> torch.Tensor:
    """randn * 3 in dt (bf16: many equal values near the top); in every third row the max copied to an
    earlier and to later columns, some a multiple of 1024 columns apart (the same lane of argmax_rows)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(L, V, generator=g, device=DEV) * 3).to(dt)
    for r in range(0, L, 3):
        j = int(x[r].float().argmax())
        top = x[r, j].clone()
        for c in (j // 2, j + 1, j + 1024, j + 2048, j + 4096, V - 1):
            if c < V:
                x[r, c] = top
    return x


def _check_topk(x: torch.Tensor, k: int) -> None:
    lp, ids = topk_logprobs_rows(x, k)
    rlp, rids = topk_logprobs_torch(x, k)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == ids.shape == (x.shape[0], k)
    bad = (ids != rids).any(dim=-1).nonzero().flatten().tolist()
    assert not bad, f"k={k} row {bad[0]}: ids {ids[bad[0]].tolist()} != sort {rids[bad[0]].tolist()}"
    err = float(((lp - rlp).abs() / rlp.abs().clamp_min(1)).max())
    assert err <= LP_TOL, f"k={k}: log-prob error {err:.3g} x max(1, |lp|)"


@pytest.mark.parametrize("dts", list(DT))
@pytest.mark.parametrize("L,V", [(15, 4096), (17, 4096), (300, 4096), (17, 163840), (3, 5000)])
def test_argmax_rows_is_torch_argmax(L: int, V: int, dts: str) -> None:
    x = _logits(L, V, DT[dts], L * V)
    y = argmax_rows(x)
    assert y.dtype == torch.int64 and torch.equal(y, torch.argmax(x, dim=-1))
    wide = _logits(L, V + 40, DT[dts], L * V + 1)  # a row view of a wider tensor
    assert torch.equal(argmax_rows(wide[:, :V]), torch.argmax(wide[:, :V], dim=-1))


@pytest.mark.parametrize("dts", list(DT))
@pytest.mark.parametrize("L", [15, 17])
def test_topk_logprobs_rows_is_stable_sort(L: int, dts: str) -> None:
    x = _logits(L, 4096, DT[dts], L)
    for k in (4, 8, 16, 32, 64, 128):
        _check_topk(x, k)
    _check_topk(_logits(L, 4096 + 40, DT[dts], L + 1)[:, :4096], 16)  # a row view of a wider tensor


@pytest.mark.parametrize("dts", list(DT))
def test_topk_logprobs_rows_at_the_tile_limit(dts: str) -> None:
    x = _logits(5, TOPK_MAX_V, DT[dts], 7)
    for k in (16, 128):
        _check_topk(x, k)


def test_row_selects_read_fresh_inputs_in_graphs() -> None:
    """Captured once, replayed with new values copied into the captured input: each replay equals an
    eager call bit for bit."""
    for fn in (argmax_rows, lambda t: topk_logprobs_rows(t, 8), lambda t: topk_logprobs_rows(t, 64)):
        src = torch.randn(15, 4096, device=DEV).to(torch.bfloat16)
        buf = torch.empty_like(src)
        torch.mul(src, 1, out=buf)
        fn(buf)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(src, 1, out=buf)  # a kernel writing the input (the dependent launch waits for it)
            out = fn(buf)
        outs = out if isinstance(out, tuple) else (out,)
        for r in range(3):
            src.copy_(torch.randn(15, 4096, device=DEV).to(torch.bfloat16))
            graph.replay()
            want = fn(src.clone())
            want = want if isinstance(want, tuple) else (want,)
            assert all(torch.equal(a, b) for a, b in zip(outs, want)), f"replay {r} differs from eager"
