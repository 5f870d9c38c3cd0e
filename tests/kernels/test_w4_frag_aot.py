"""The dense fragment kernel's asynchronous warpgroup-MMA form (w4_frag mma 'wgmma-async'), compiled offline for
sm_90 by Triton's bundled ptxas as frag_linear launches it (bench/frag_aot.py): no GPU needed. What the SASS
must show: the loop keeps one wgmma group in flight (the synchronous form, compiled the same way, waits for
each: the check tells them apart), and at 8 / 16 tokens the plan's register cap holds it without spills."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from bench.frag_aot import a_operand_hazards, compile_dense  # noqa: E402
from kdtree_engine.kernels.w4_frag import dense_maxnreg  # noqa: E402


@pytest.mark.parametrize("tok", [8, 16])
def test_wgmma_async_keeps_a_group_in_flight_without_spills(tok):
    r = compile_dense(tok, "wgmma-async")
    assert r["maxnreg"] == dense_maxnreg("wgmma-async", tok) == 128
    assert r["regs"] <= 128 and r["stack"] == 0, r
    assert r["mma"] == 16, r   # 256 k per block: 16 k16 steps of m64nTOK
    assert r["in_flight"] and not r["waits_all"], r
    assert r["hazards"] == [], r["hazards"]   # no A register written while its group is in flight


def test_wgmma_async_64_tokens_no_spills_no_hazards():
    r = compile_dense(64, "wgmma-async")
    assert r["stack"] == 0 and r["in_flight"] and not r["waits_all"] and r["hazards"] == [], r


def test_a_operand_hazard_check_finds_early_writes():
    """The check on hand-written SASS: A registers R80-R83 of a group written before / after the wait that
    retires it, a vector load over them, a group carried across the loop's back edge."""
    mma = (0x10, "HGMMA.64x16x16.F32.BF16 R24, R80, gdesc[UR16], R24, gsb0")
    assert a_operand_hazards([mma, (0x20, "WARPGROUP.DEPBAR.LE gsb0, 0x0"), (0x30, "HADD2.BF16_V2 R81, R1, R2")]) == []
    assert len(a_operand_hazards([mma, (0x20, "HADD2.BF16_V2 R81, R1, R2")])) == 2   # walked twice: once per pass
    assert a_operand_hazards([mma, (0x20, "WARPGROUP.DEPBAR.LE gsb0, 0x1"), (0x30, "LDG.E.128 R78, desc[UR4][R2.64]")])
    # a group in flight at the back edge, retired at the top of the next trip: a write there after the wait is
    # safe, one before it is not
    write, wait = (0x0, "LOP3.LUT R82, R1, 0xf, R2, 0xea, !PT"), (0x8, "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert a_operand_hazards([wait, write, mma]) == []
    assert a_operand_hazards([write, wait, mma])


def test_synchronous_wgmma_waits_for_each_group():
    r = compile_dense(16, "wgmma")
    assert r["mma"] == 16 and r["waits_all"], r
