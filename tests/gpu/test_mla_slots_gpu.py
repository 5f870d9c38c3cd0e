"""One decode launch for many requests' static slots (kernels/mla_attention.mla_attention_slots): every slot's rows
bit for bit those of its own device-length launch (mla_attention_device, T = 1), at K2 shapes (C = 512, R = 64; 8
heads a rank under TP8, and 64), over a paged pool with shuffled block tables, lengths from empty to past many
chunks, an unused slot reading the trash block."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.mla_attention import mla_attention_device, mla_attention_slots, slots_unsupported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

C, R, PAGE = 512, 64, 64
SCALE = 0.1352


@pytest.mark.parametrize("N,B,capacity", [(8, 1, 4096), (8, 16, 4096), (8, 5, 1024), (64, 4, 8192), (8, 64, 512)])
def test_slots_equal_solo_launches_bf16(N: int, B: int, capacity: int) -> None:
    seed = int(torch.randint(1 << 30, (1,)))
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = capacity // PAGE
    num_blocks = B * blocks + 1                       # the last block: the trash block of an unused slot
    pool = torch.randn(num_blocks, PAGE, C + R, generator=g, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(B * blocks, generator=g, device="cuda").to(torch.int32)
    tables = perm.view(B, blocks).contiguous()
    starts = torch.randint(0, capacity, (B,), generator=g, device="cuda")
    starts[0] = capacity - 1                          # the last slot of a full cache
    if B > 2:
        starts[1] = 0                                 # an empty cache
        tables[2].fill_(num_blocks - 1)               # an unused slot: the trash block, length 0
        starts[2] = 0
    q_lat = torch.randn(B, N, C, generator=g, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(B, N, R, generator=g, device="cuda").to(torch.bfloat16)
    assert slots_unsupported(q_lat, q_pe, pool) is None
    out = mla_attention_slots(q_lat, q_pe, pool, tables, capacity, starts, SCALE, C)
    one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    for b in range(B):
        solo = mla_attention_device(q_lat[b:b + 1], q_pe[b:b + 1], pool, starts[b], one, SCALE, C,
                                    table=tables[b], capacity=capacity)
        assert torch.equal(out[b:b + 1], solo), f"slot {b} (length {int(starts[b])}) differs from its own launch"
        assert torch.isfinite(out[b]).all()
