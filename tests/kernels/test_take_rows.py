"""take_rows (the row gather of the device rounds: rope tables, the drafter's context rows, the cache
compaction) against torch.index_select on fresh random inputs: the same values, shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.common import take_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long])
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("n_idx", [1, 5, 16, 17, 40])
def test_take_rows_equals_index_select(dtype, dim, n_idx):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    shape = [7, 23, 5]
    x = (torch.randn(shape, generator=g) * 100).to(dtype)
    idx = torch.randint(0, shape[dim], (n_idx,), generator=g)
    got, want = take_rows(x, idx, dim), x.index_select(dim, idx)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
