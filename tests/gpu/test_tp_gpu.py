"""Tensor + expert parallelism on several GPUs of one host (NCCL, rank r on cuda:r), against one GPU:

* float32: the greedy tokens at TP-N equal TP-1's, on the embedded demo (each rank reading its slices of the
  checkpoint) and on a random K2-shaped model (heads, experts and vocabulary split);
* bfloat16, batch invariance on: DDTree emits exactly plain decoding's tokens at TP-N, host-driven and replayed from
  CUDA graphs whose rounds hold the NCCL collectives; every rank emits the same tokens;
* bfloat16: a continuous batch at TP-N (rank 0's RankedScheduler, the other ranks following its steps, batched steps
  replayed from graphs holding the collectives) gives each request the tokens of its run alone at TP-N.

Needs two GPUs or more (skipped otherwise); NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the related settings,
set by scripts/gpu_suite.sh multi).

    pytest -m gpu tests/gpu/test_tp_gpu.py -v
"""

from __future__ import annotations

import os

import pytest
import torch

from kdtree_engine.parallel.comm import SINGLE
from tests.gpu.tp_cases import batch_case, decode_case
from tests.parallel.ranks import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs two GPUs or more")]
WORLDS = [n for n in (2, 4) if n <= GPUS]   # the demo and k2-tiny have 4 heads and 8 experts
SEED = int.from_bytes(os.urandom(3), "little")


@pytest.fixture(autouse=True)
def _no_multicast(monkeypatch):
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(k, v)   # the spawned ranks inherit them


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["demo", "k2-tiny"])
def test_tp_float32_tokens_equal_one_gpu(model: str, world: int) -> None:
    print(f"seed {SEED}")
    one = decode_case(SINGLE, model, SEED, "float32")
    ranks = run_ranks(world, decode_case, model, SEED, "float32", device_type="cuda", timeout_s=300.0)
    for r in ranks:
        assert r["plain"] == one["plain"], f"{model} TP-{world} rank {r['rank']}: plain tokens differ from one GPU's"
        for k in ("ddtree", "graph-plain", "graph-ddtree"):
            assert r[k] == one["plain"], f"{model} TP-{world} rank {r['rank']}: {k} differs from plain"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["demo", "k2-tiny"])
def test_tp_bf16_spec_equals_plain(model: str, world: int) -> None:
    print(f"seed {SEED}")
    ranks = run_ranks(world, decode_case, model, SEED, "bfloat16", device_type="cuda", timeout_s=300.0)
    plain = ranks[0]["plain"]
    assert len(plain) > 0
    for r in ranks:
        for k in ("plain", "ddtree", "graph-plain", "graph-ddtree"):
            assert r[k] == plain, f"{model} TP-{world} bf16 rank {r['rank']}: {k} differs from rank 0's plain tokens"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", ["demo", "k2-tiny"])
def test_tp_bf16_batch_equals_each_request_alone(model: str, world: int) -> None:
    print(f"seed {SEED}")
    ranks = run_ranks(world, batch_case, model, SEED, "bfloat16", device_type="cuda", timeout_s=300.0)
    solo, batch = ranks[0]["solo"], ranks[0]["batch"]
    for i, (s, b) in enumerate(zip(solo, batch)):
        assert len(s) > 0 and b == s, f"{model} TP-{world} bf16: request {i} in the batch differs from its solo run"
    for r in ranks[1:]:
        assert r["solo"] == solo, f"{model} TP-{world} rank {r['rank']}: solo tokens differ from rank 0's"
