"""The fragment MoE's config (kdtree_engine/kernels/moe_frag.py) on the CPU: bad fields are refused with a
message that names them, and the launch table keeps its reduction (splits, groups per block) fixed while
the token count changes (the kernels themselves are GPU-tested)."""

import pytest

from kdtree_engine.kernels.moe_frag import FEW_PAIRS, FragMoEConfig, frag_moe_config
from kdtree_engine.kernels.w4_frag import X_LOADS


@pytest.mark.parametrize("field,value", [("XLOAD", "registers"), ("XLOAD2", "shared"), ("XLOAD", None),
                                         ("BLOCK_M", 32), ("EPI_BLOCK", 100), ("EPI_BLOCK", 64),
                                         ("MAXNREG13", 8), ("MAXNREG2", 300)])
def test_bad_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        FragMoEConfig(**{field: value})


def test_every_activation_load_is_accepted_for_both_gemms():
    for a in X_LOADS:
        for b in (None, *X_LOADS):
            FragMoEConfig(XLOAD=a, XLOAD2=b)


@pytest.mark.parametrize("E", [8, 384])
def test_launch_table_keeps_the_reduction(E):
    """Whatever T picks, the fields that enter the reduction (splits, groups per block) are the same: a
    token's output does not depend on the batch it is launched in."""
    cfgs = {frag_moe_config(T * 8, E) for T in range(1, 2049, 7)} | {frag_moe_config(FEW_PAIRS, E)}
    assert len(cfgs) >= 2
    assert {(c.SPLIT13, c.SPLIT2, c.GPB) for c in cfgs} == {(None, 1, None)}


def test_dependent_launches_only_where_they_exist():
    """No dependent launches off CUDA (the kernels' wait instruction exists from sm_90 on)."""
    import torch

    from kdtree_engine.kernels.pdl import pdl_launch, pdl_supported
    assert not pdl_supported(torch.device("cpu"))
    assert pdl_launch(False) == {"PDL": False} and pdl_launch(True) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("depth,gpb,xload", [(4, 8, "smem-ahead"), (-1, 8, "smem"), (1, 4, "smem-ahead"),
                                             (2, 8, "operand")])
def test_group_loop_refuses_what_it_cannot_run(depth, gpb, xload):
    """The dense kernel's group loop (depth 1..3) needs 8 groups per block and activations staged in shared
    memory; anything else is refused with a message naming the depth (never silently run another loop)."""
    from kdtree_engine.kernels.w4_frag import check_depth
    with pytest.raises(ValueError, match="depth"):
        check_depth(depth, gpb, xload, "frag_linear")


def test_dense_plan_keeps_the_reduction_and_a_valid_depth():
    from kdtree_engine.kernels.w4_frag import check_depth, dense_plan
    for N, K in ((36864, 7168), (4096, 7168), (7168, 2048), (192, 512)):
        gpb, mt, split, depth = dense_plan(N, K)
        check_depth(depth, gpb, "smem-ahead", "dense_plan")
        assert (K // (32 * gpb)) % split == 0
