"""The fragment MoE's config (kdtree_engine/kernels/moe_frag.py) on the CPU: bad fields are refused with a
message that names them, and the launch table keeps its reduction (splits, groups per block) fixed while
the token count changes (the kernels themselves are GPU-tested)."""

import pytest

from kdtree_engine.kernels.moe_frag import FragMoEConfig, frag_moe_config
from kdtree_engine.kernels.w4_frag import X_LOADS


@pytest.mark.parametrize("field,value", [("XLOAD", "registers"), ("XLOAD2", "shared"), ("XLOAD", None),
                                         ("BLOCK_M", 24), ("EPI_BLOCK", 100), ("EPI_BLOCK", 64),
                                         ("MAXNREG13", 8), ("MAXNREG2", 300)])
def test_bad_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        FragMoEConfig(**{field: value})


def test_wgmma_blocks_need_warpgroups_of_single_tiles():
    """32 / 64-row expert blocks run on wgmma: one or two warpgroups (4 / 8 warps), one MMA tile per warp, or a
    named error."""
    assert FragMoEConfig(BLOCK_M=32).wgmma and not FragMoEConfig(BLOCK_M=16).wgmma
    assert FragMoEConfig(BLOCK_M=32, num_warps=8).wgmma
    for kw in (dict(MT=2), dict(MT2=2), dict(num_warps=2)):
        with pytest.raises(ValueError, match="wgmma"):
            FragMoEConfig(BLOCK_M=64, **kw)


def test_two_warpgroup_blocks_fall_back_where_128_rows_do_not_divide():
    """The table's 32-row wgmma blocks run two warpgroups (128 weight rows per program) at K2 shapes and one on
    experts whose widths 128 does not divide (the demo's I = 192), so no shape the table reaches is refused."""
    from kdtree_engine.kernels.moe_frag import frag_moe_unsupported, warps_for
    k2 = warps_for(frag_moe_config(2048 * 8, 384), 7168, 2048)
    assert k2.wgmma and k2.num_warps == 8 and frag_moe_unsupported(7168, 2048, 32, k2) is None
    demo = warps_for(frag_moe_config(512 * 2, 8), 256, 192)
    assert demo.wgmma and demo.num_warps == 4 and frag_moe_unsupported(256, 192, 32, demo) is None
    assert warps_for(frag_moe_config(8, 384), 7168, 2048) == frag_moe_config(8, 384)


def test_dense_token_tiles_and_instructions():
    """The dense plan's token tile follows M (8 / 16 on mma.sync, 32 / 64 on wgmma); launches that cannot take
    wgmma programs stay at 16."""
    from kdtree_engine.kernels.w4_frag import token_mma, token_tile
    assert [token_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 1000)] == [8, 8, 16, 16, 32, 32, 64, 64, 64]
    assert [token_tile(m, wide=False) for m in (1, 9, 17, 1000)] == [8, 16, 16, 16]
    assert [token_mma(t) for t in (8, 16, 32, 64)] == ["sync", "sync", "wgmma", "wgmma"]


def test_dense_programs_cover_one_partition_tile():
    """A dense program's warps hold the rows of one partition tile at every token tile (wgmma: 64 rows one
    warpgroup, 128 two)."""
    from kdtree_engine.kernels.w4_frag import token_warps
    assert token_warps(64) == 4 and token_warps(128) == 8 and token_warps(128, 2) == 4 and token_warps(64, 2) == 2


def test_every_activation_load_is_accepted_for_both_gemms():
    for a in X_LOADS:
        for b in (None, *X_LOADS):
            FragMoEConfig(XLOAD=a, XLOAD2=b)


@pytest.mark.parametrize("E", [8, 384])
def test_launch_table_keeps_the_reduction(E):
    """Whatever T picks, the fields that enter the reduction (splits, groups per block) are the same: a
    token's output does not depend on the batch it is launched in."""
    cfgs = {frag_moe_config(T * 8, E) for T in range(1, 2049, 7)}
    assert len(cfgs) >= 2
    assert {(c.SPLIT13, c.SPLIT2, c.GPB) for c in cfgs} == {(None, 1, None)}


def test_dependent_launches_only_where_they_exist():
    """No dependent launches off CUDA (the kernels' wait instruction exists from sm_90 on)."""
    import torch

    from kdtree_engine.kernels.pdl import pdl_launch, pdl_supported
    assert not pdl_supported(torch.device("cpu"))
    assert pdl_launch(False) == {"PDL": False} and pdl_launch(True) == {"PDL": True, "launch_pdl": True}
