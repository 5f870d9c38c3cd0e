"""The fragment MoE's config (kdtree_engine/kernels/moe_frag.py) on the CPU: bad fields are refused with a
message that names them, and the launch table keeps its reduction (splits, groups per block) fixed while
the token count changes (the kernels themselves are GPU-tested)."""

import pytest

from kdtree_engine.kernels.moe_frag import FragMoEConfig, frag_moe_config


@pytest.mark.parametrize("field,value", [("BLOCK_M", 24), ("P13", 0), ("P2", -3)])
def test_bad_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        FragMoEConfig(**{field: value})


def test_wgmma_blocks():
    assert FragMoEConfig(BLOCK_M=32).wgmma and FragMoEConfig(BLOCK_M=64).wgmma and not FragMoEConfig(BLOCK_M=16).wgmma


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_moe_plans(sms):
    """The MoE partitions: at K2 widths a token's 8 gate/up expert blocks fill one wave of 3 programs per SM
    with at least 4 K blocks per program and at most 2 tiles of blocks each (fewer SMs: more programs than one
    wave); the down GEMM runs whole row tiles. They depend on the shape, top-k and SM count only."""
    from kdtree_engine.kernels.layouts import MOE_PARTITION_ROWS, frag_gpb
    from kdtree_engine.kernels.moe_frag import MOE_DOWN_PER_SM, MOE_GATE_UP_PER_SM, moe_plan
    from kdtree_engine.kernels.w4_frag import dense_partition
    gu = moe_plan(2048, 7168, frag_gpb(7168), sms, 8, MOE_GATE_UP_PER_SM)
    down = moe_plan(7168, 2048, frag_gpb(2048), sms, 8, MOE_DOWN_PER_SM)
    assert (gu.rows, gu.tiles, gu.iters) == (MOE_PARTITION_ROWS, 32, 28)
    assert (down.rows, down.tiles, down.iters, down.programs) == (MOE_PARTITION_ROWS, 112, 8, 112)
    assert dense_partition(down.tiles, down.iters, down.programs) == (1, 1)
    assert gu.programs == max(min(sms * 3 // 8, gu.work // 4), -(-gu.tiles // 2))
    slots, segments = dense_partition(gu.tiles, gu.iters, gu.programs)
    assert 1 <= slots and segments <= 3
    if sms == 132:
        assert gu.programs == 49 and 8 * 49 <= 132 * 3 and (slots, segments) == (3, 2)
    stream_down = moe_plan(7168, 2048, frag_gpb(2048), sms, 8, 5)
    assert stream_down.programs == max(min(sms * 5 // 8, stream_down.work // 4), 56)


def test_moe_plan_refuses_nothing_the_engine_reaches():
    """Every expert shape the fragment kernels accept gets a partition whose segments the kernel unrolls (the
    demo's H 256 / I 192 included)."""
    from kdtree_engine.kernels.layouts import frag_gpb, frag_moe_unsupported
    from kdtree_engine.kernels.moe_frag import moe_plan
    from kdtree_engine.kernels.w4_frag import dense_partition
    for H, I in ((256, 192), (1024, 512), (2048, 1024), (7168, 2048), (7168, 64), (64, 7168)):
        assert frag_moe_unsupported(H, I, 32) is None
        for topk in (1, 2, 8):
            for sms in (1, 132):
                for part in (moe_plan(I, H, frag_gpb(H), sms, topk, 3), moe_plan(H, I, frag_gpb(I), sms, topk, 5),
                             moe_plan(H, I, frag_gpb(I), sms, topk, None)):
                    dense_partition(part.tiles, part.iters, part.programs)


def test_dense_token_tiles_and_instructions():
    """The dense launch's token tile follows M (8 / 16 on mma.sync, 32 / 64 on wgmma)."""
    from kdtree_engine.kernels.w4_frag import token_mma, token_tile
    assert [token_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 1000)] == [8, 8, 16, 16, 32, 32, 64, 64, 64]
    assert [token_mma(t) for t in (8, 16, 32, 64)] == ["sync", "sync", "wgmma", "wgmma"]


def test_two_blocks_per_trip_only_for_8_token_programs():
    """The mma.sync loop runs two blocks per trip for 8-token programs only (16-token ones would spill)."""
    from kdtree_engine.kernels.w4_frag import token_pairs
    assert token_pairs(8)
    assert not token_pairs(16) and not token_pairs(32)


def test_dense_launch_follows_the_plan_and_refuses_bad_tiles():
    """The engine's launch: the plan's partition whatever M, the token tile and MMA by M; mma.sync takes at most
    16 tokens per program, and an unknown MMA is refused."""
    from dataclasses import replace

    from kdtree_engine.kernels.w4_frag import DenseLaunch, dense_launch, dense_plan
    for M, tok, mma in ((1, 8, "sync"), (16, 16, "sync"), (17, 32, "wgmma"), (300, 64, "wgmma")):
        launch = dense_launch(M, 36864, 7168, 132, 64, 64)
        assert (launch.gpb, launch.programs) == dense_plan(36864, 7168, 132)
        assert (launch.tok, launch.mma, launch.tile, launch.stile) == (tok, mma, 64, 64)
    with pytest.raises(ValueError, match="mma.sync"):
        replace(dense_launch(1, 4096, 7168, 132), tok=32)
    with pytest.raises(ValueError, match="mma"):
        DenseLaunch(gpb=8, programs=4, tok=8, mma="wgmma-async")


@pytest.mark.parametrize("E", [8, 384])
def test_launch_table_keeps_the_reduction(E):
    """Whatever T picks, the fields that enter the reduction (partitions, groups per block) are the same: a
    token's output does not depend on the batch it is launched in."""
    cfgs = {frag_moe_config(T * 8, E) for T in range(1, 2049, 7)}
    assert len(cfgs) >= 2
    assert {(c.P13, c.P2, c.GPB) for c in cfgs} == {(None, None, None)}


def test_dependent_launches_only_where_they_exist():
    """No dependent launches off CUDA (the kernels' wait instruction exists from sm_90 on)."""
    import torch

    from kdtree_engine.kernels.pdl import pdl_launch, pdl_supported
    assert not pdl_supported(torch.device("cpu"))
    assert pdl_launch(False) == {"PDL": False} and pdl_launch(True) == {"PDL": True, "launch_pdl": True}


def test_fused_epilogues_for_small_mma_sync_launches():
    """The SwiGLU and top-k sum ride in the GEMMs' last programs for launches of up to FUSE_MAX_PAIRS pairs on
    mma.sync blocks (never wgmma blocks); their arrival counters are disjoint zeroed slices, kept per device."""
    import torch

    from kdtree_engine.kernels import moe_frag
    from kdtree_engine.kernels.moe_frag import FUSE_MAX_PAIRS, fused_epilogues

    assert FUSE_MAX_PAIRS == 8                               # one token at top-8 (moe_frag: measured)
    assert fused_epilogues(8, frag_moe_config(8, 384)) and fused_epilogues(FUSE_MAX_PAIRS, FragMoEConfig(BLOCK_M=16))
    assert not fused_epilogues(FUSE_MAX_PAIRS + 1, FragMoEConfig())
    assert not fused_epilogues(8, FragMoEConfig(BLOCK_M=32))
    dev = torch.device("cpu")
    a, b = moe_frag._counters(dev, 9 * 32, 112)
    assert a.numel() == 288 and b.numel() == 112 and a.data_ptr() + 288 * 4 == b.data_ptr()
    assert not a.any() and not b.any()
    a2, _ = moe_frag._counters(dev, 100, 10)
    assert a2.data_ptr() == a.data_ptr()                     # reused
    big, _ = moe_frag._counters(dev, 5000, 10)
    assert big.numel() == 5000 and not big.any()
    moe_frag._COUNTERS.pop(dev)
