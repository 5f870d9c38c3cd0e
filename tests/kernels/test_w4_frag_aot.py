"""The dense fragment kernel compiled offline for sm_90 by Triton's bundled ptxas as frag_linear launches it
(bench/frag_aot.py): no GPU needed. The engine's wgmma programs (synchronous MMA) wait for each warpgroup-MMA
group, and the engine's 8-token mma.sync programs compile without spills."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from bench.frag_aot import compile_dense  # noqa: E402


def test_synchronous_wgmma_waits_for_each_group():
    r = compile_dense(16, "wgmma")
    assert r["mma"] == 16 and r["waits_all"], r   # 256 k per block: 16 k16 steps of m64nTOK


def test_engine_mma_sync_8_tokens_no_spills():
    r = compile_dense(8, "sync")
    assert r["stack"] == 0, r
