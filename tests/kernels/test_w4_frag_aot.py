"""The dense fragment kernel's asynchronous warpgroup-MMA form (w4_frag mma 'wgmma-async'), compiled offline for
sm_90 by Triton's bundled ptxas as frag_linear launches it (bench/frag_aot.py): no GPU needed. What the SASS
must show: the loop keeps one wgmma group in flight (the synchronous form, compiled the same way, waits for
each: the check tells them apart), and at 8 / 16 tokens the plan's register cap holds it without spills."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from bench.frag_aot import compile_dense  # noqa: E402
from kdtree_engine.kernels.w4_frag import wgmma_async_maxnreg  # noqa: E402


@pytest.mark.parametrize("tok", [8, 16])
def test_wgmma_async_keeps_a_group_in_flight_without_spills(tok):
    r = compile_dense(tok, "wgmma-async")
    assert r["maxnreg"] == wgmma_async_maxnreg(tok) == 128
    assert r["regs"] <= 128 and r["stack"] == 0, r
    assert r["mma"] == 16, r   # 256 k per block: 16 k16 steps of m64nTOK
    assert r["in_flight"] and not r["waits_all"], r


def test_synchronous_wgmma_waits_for_each_group():
    r = compile_dense(16, "wgmma")
    assert r["mma"] == 16 and r["waits_all"], r
