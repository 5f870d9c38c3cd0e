"""The fragment MoE's config (kdtree_engine/kernels/moe_frag.py) on the CPU: bad fields are refused with a
message that names them, and the launch table keeps its reduction (splits, groups per block) fixed while
the token count changes (the kernels themselves are GPU-tested)."""

import pytest

from kdtree_engine.kernels.moe_frag import FragMoEConfig, frag_moe_config
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
    cfgs = {frag_moe_config(T * 8, E) for T in range(1, 2049, 7)}
    assert len(cfgs) >= 2
    assert {(c.SPLIT13, c.SPLIT2, c.GPB) for c in cfgs} == {(None, 1, None)}


def test_dependent_launches_only_where_they_exist():
    """No dependent launches off CUDA (the kernels' wait instruction exists from sm_90 on)."""
    import torch

    from kdtree_engine.kernels.pdl import pdl_launch, pdl_supported
    assert not pdl_supported(torch.device("cpu"))
    assert pdl_launch(False) == {"PDL": False} and pdl_launch(True) == {"PDL": True, "launch_pdl": True}
