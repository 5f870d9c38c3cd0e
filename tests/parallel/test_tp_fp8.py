"""FP8 block-quantized checkpoints at tp > 1: each rank reads its slices of the FP8 weights and of their block scales,
and the ranks decode the tokens of one process; a split that would cut an FP8 block is refused by the scale's name."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import load_target
from kdtree_engine.errors import LoadError
from kdtree_engine.parallel.comm import SINGLE, LocalCommunicator
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import save_checkpoint

from helpers_ckpt import fp8_checkpoint, fp8_config, new_seed
from ranks import run_ranks

CFG = preset("k2-tiny")
PROMPT = [5, 9, 2, 77, 31, 140]


def fp8_dir(tmp_path, block: tuple[int, int], seed: int):
    tensors, _ = fp8_checkpoint(CFG, reference.random_weights(CFG, seed), block)
    save_checkpoint(tmp_path / "fp8", fp8_config(CFG, block), tensors)
    return tmp_path / "fp8"


def decode(comm, path: str) -> tuple[list[int], int]:
    target = load_target(path, device=torch.device("cpu"), dtype=torch.float32, progress=False, comm=comm)
    scales = sum(b.numel() for n, b in target.named_buffers() if n.endswith("weight_scale_inv"))
    return generate(target, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids, scales


def test_tp2_fp8_decodes_the_tokens_of_one_process(tmp_path) -> None:
    # blocks of 16: every split slice (q_b / kv_b 64 rows, o_proj 32 inputs, the dense MLP 48, the shared expert 16
    # a rank) is a whole number of blocks
    path = fp8_dir(tmp_path, (16, 16), new_seed())
    one, scales_one = decode(SINGLE, str(path))
    two = run_ranks(2, decode, str(path))
    assert [tokens for tokens, _ in two] == [one, one]
    assert all(0 < scales < scales_one for _, scales in two)  # each rank holds a part of the block scales


def test_a_split_through_an_fp8_block_is_refused_by_name(tmp_path) -> None:
    # blocks of 32: the dense MLP's 96 rows over 2 ranks are 48 a rank, one block and a half
    path = fp8_dir(tmp_path, (32, 32), 0)
    with pytest.raises(LoadError, match=r"'layers\.0\.mlp\.gate_proj\.weight_scale_inv': its 48-wide slice per rank "
                                        r"\(output rows 96 / tp=2\) is not a whole number of FP8 blocks of 32"):
        load_target(str(path), device=torch.device("cpu"), dtype=torch.float32, progress=False,
                    comm=LocalCommunicator(0, 2))
