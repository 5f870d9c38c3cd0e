"""Sharded loading: each rank reads only the slices it owns (bytes counted at the file reader), INT4 row-parallel
weights cut on group boundaries load to the same tokens as one process, and sizes that do not divide are refused
by the tensor's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kdtree_engine.weights as weights_mod
from kdtree_engine.cli import main
from kdtree_engine.config import preset
from kdtree_engine.engine import load_target
from kdtree_engine.errors import LoadError
from kdtree_engine.model.target import Target
from kdtree_engine.parallel.comm import SINGLE, LocalCommunicator
from kdtree_engine.quant import k2_quantization_config, parse_quantization_config
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import save_checkpoint

from helpers_ckpt import random_checkpoint_tensors
from ranks import run_ranks

# every linear but lm_head INT4 (group 32), sizes whose halves are whole groups: o_proj 4 heads x 16 -> 32 a rank,
# the dense MLP 128 -> 64, the shared expert 64 -> 32
CFG = preset("k2-tiny").replace(intermediate_size=128, moe_intermediate_size=64, q_lora_rank=64)
QUANT = {**k2_quantization_config(32), "ignore": ["lm_head"]}
QCFG = CFG.replace(quantization=QUANT)
# by the layout (docs/parallel.md): split by output rows or input columns over the ranks
SPLIT = re.compile(r"(^|\.)(embed_tokens|lm_head)\.|\.self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.|"
                   r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.")
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
PROMPT = [5, 9, 2, 77, 31]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("int4-all")
    save_checkpoint(d, QCFG, random_checkpoint_tensors(QCFG, seed=3, quantized=True, dtype=torch.float32))
    return d


class CountingSlice:
    def __init__(self, sl, log: list) -> None:
        self.sl, self.log = sl, log

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, idx):
        t = self.sl[idx]
        self.log.append(("slice", t.nbytes))
        return t


class CountingFile:
    """safe_open's file with every byte handed out counted (get_tensor: whole tensors, get_slice[...]: parts)."""

    def __init__(self, f, log: list) -> None:
        self.f, self.log = f, log

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *a):
        return self.f.__exit__(*a)

    def keys(self):
        return self.f.keys()

    def get_slice(self, name):
        return CountingSlice(self.f.get_slice(name), self.log)

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.log.append((name, t.nbytes))
        return t


def load_counting(comm, path: str) -> tuple[int, list, list[int]]:
    log: list = []
    real = weights_mod.safe_open
    weights_mod.safe_open = lambda *a, **k: CountingFile(real(*a, **k), log)
    try:
        target = load_target(path, device=torch.device("cpu"), dtype=torch.float32, progress=False, comm=comm)
    finally:
        weights_mod.safe_open = real
    tokens = generate(target, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    return sum(n for _, n in log), [name for name, _ in log if name != "slice"], tokens


def owned_bytes(path: Path, rank: int, world: int) -> int:
    """What rank ``rank`` must read, from the file's tensors and the layout rules (not the loader's code)."""
    from safetensors import safe_open
    total = 0
    per = CFG.n_routed_experts // world
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for raw in f.keys():
            t = f.get_slice(raw)
            shape = t.get_shape()
            n = torch.zeros(shape, dtype=torch.float32 if t.get_dtype() == "F32" else torch.int32).nbytes
            m = EXPERT.search(raw)
            if raw.endswith(".weight_shape"):
                total += n
            elif m:
                total += n if int(m.group(1)) // per == rank else 0
            elif SPLIT.search(raw):
                total += n // world
            else:
                total += n
    return total


def test_sharded_loading_reads_only_the_owned_slices(ckpt) -> None:
    scheme = parse_quantization_config(QUANT)
    assert scheme.is_quantized("layers.0.self_attn.o_proj") and scheme.is_quantized("layers.0.mlp.down_proj")
    one = load_counting(SINGLE, str(ckpt))
    full = one[0]
    results = run_ranks(2, load_counting, str(ckpt))
    for rank, (read, whole, tokens) in enumerate(results):
        assert read == owned_bytes(ckpt, rank, 2), rank
        whole = [n for n in whole if not n.endswith(".weight_shape")]  # the strict check reads these everywhere
        assert not [n for n in whole if SPLIT.search(n)], whole  # split tensors: only their slices are read
        assert {int(m.group(1)) // 4 for n in whole if (m := EXPERT.search(n))} == {rank}  # its own experts only
        assert tokens == one[2]
    assert results[0][0] < 0.75 * full


def test_non_divisible_sizes_are_refused_by_name(ckpt, capsys) -> None:
    with pytest.raises(LoadError, match=r"'embed_tokens.weight': vocab_size 256 does not divide by tp=3"):
        Target(CFG, comm=LocalCommunicator(0, 3))
    with pytest.raises(LoadError, match=r"'layers.0.self_attn.q_b_proj.weight': num_attention_heads 4"):
        Target(CFG.replace(vocab_size=264), comm=LocalCommunicator(0, 8))
    with pytest.raises(LoadError, match=r"'layers.1.mlp.experts': n_routed_experts 8"):
        Target(CFG.replace(vocab_size=264, num_attention_heads=6, n_routed_experts=8), comm=LocalCommunicator(0, 3))
    # row-parallel INT4 is cut on group boundaries: o_proj's 64 inputs over 4 ranks are 16, half a group
    with pytest.raises(LoadError, match=r"'layers.0.self_attn.o_proj.weight_packed'.*INT4 groups of 32"):
        Target(QCFG, quant=parse_quantization_config(QUANT), comm=LocalCommunicator(0, 4))
    # before any process starts: one line, exit 2
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--tp", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kdtree: error: tensor 'embed_tokens.weight': vocab_size 256"), err


def test_one_rank_of_n_builds_alone() -> None:
    """A benchmark builds one rank's shard in one process (a local communicator): rank 1 of 2 holds experts 4..7,
    two heads and half the vocabulary, and runs a step."""
    t = Target.random(CFG, seed=1, comm=LocalCommunicator(1, 2))
    assert t.owned_experts() == range(4, 8) and t.layers[0].self_attn.n_heads == 2
    assert t.vocab_shard.start == 128 and t.embed_tokens.weight.shape[0] == 128
    out = t(torch.tensor(PROMPT), t.new_cache(8))
    assert out.logits.shape == (len(PROMPT), 128) and torch.isfinite(out.logits).all()
