"""The cross-rank sum's fixed order on the GPU (kernels/dispatch.py ordered_sum, one launch of kernels/split_sum.py):
bit for bit the torch loop of float32 additions in rank order (kernels/reference.py ordered_sum_torch), bfloat16 and
float32 partials, and a row's sum the same alone as among 64 rows (the message size never changes a row)."""

from __future__ import annotations

import os

import pytest
import torch

from kdtree_engine.kernels import dispatch
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.kernels.reference import ordered_sum_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W,R,H", [(2, 1, 7168), (8, 64, 7168), (4, 17, 129)])
def test_ordered_sum_bits(dtype, W, R, H):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    parts = (torch.randn(W, R, H, generator=g, device="cuda") * 50).to(dtype)
    got = dispatch.ordered_sum(KernelPolicy(), parts, torch.bfloat16)
    assert torch.equal(got, ordered_sum_torch(parts).to(torch.bfloat16)), f"seed={seed}"
    assert torch.equal(dispatch.ordered_sum(KernelPolicy(), parts[:, -1:], torch.bfloat16)[0], got[-1])
