"""Lossless in bfloat16 on the GPU, bit for bit (batch invariance on, the default):

1. a token's logits computed alone (T = 1 at its position) equal its row inside causal blocks and
   tree-masked verify blocks of T = 1..129 rows, and stay equal after the accepted path is committed
   (K2-tiny, bf16, dense (BF16), INT4 and FP8 block-quantized targets; prompts that keep the keys in one attention chunk and
   that cross a chunk boundary);
2. greedy ``dflash`` and ``ddtree`` (budgets 4, 16, 64, 128) emit exactly the tokens of ``none``:
   random K2-tiny targets (BF16, INT4, FP8) with a drafter that ranks the true continuation first or
   second (deep acceptance every round: verify rows and KV compaction are exercised), a random K2-tiny
   target with a random DFlash drafter (the real drafter path), and the embedded demo pair.

    python3 -m pytest -m gpu tests/gpu/test_bitwise_gpu.py -v -s

``KDTREE_BITWISE_PROMPTS`` (default 20: the demo pair, and 10 each for the two random oracle pairs)
and ``KDTREE_BITWISE_TOKENS`` (default 256) scale part 2. A failure names the pair, mode, prompt and the
first index where the tokens differ.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import load_drafter, load_target, load_tokenizer, target_from_weights
from kdtree_engine.kernels import dispatch
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.quant import k2_quantization_config
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate

from bitwise_checks import check_target
from helpers_ckpt import fp8_checkpoint, fp8_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEMO_DIR = Path(importlib.import_module("kdtree_engine").__file__).parent / "assets" / "demo"
TS = [1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 100, 128, 129]
MODES: list[tuple[str, int | None]] = [("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64),
                                       ("ddtree", 128)]
N_PROMPTS = int(os.environ.get("KDTREE_BITWISE_PROMPTS", "20"))
N_TOKENS = int(os.environ.get("KDTREE_BITWISE_TOKENS", "256"))
DTYPE = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def batch_invariance_on():
    """The models here take the environment's policy (batch invariance on): no variable may force a torch path."""
    policy = KernelPolicy.from_env()
    dev = torch.device("cuda")
    used = {"dense": dispatch.dense_backend(policy, dev), "attention": dispatch.attn_backend(policy, dev),
            "int4": dispatch.int4_backend(policy, dev)}
    assert policy.batch_invariant and set(used.values()) == {"triton"}, \
        f"a KDTREE_*_BACKEND variable forces a torch path: {used}"


def fp8_target(seed: int):
    """K2-tiny with every linear but lm_head FP8 (32 x 32 blocks, partial ones on the 48-wide projections)."""
    cfg = preset("k2-tiny")
    tensors, _ = fp8_checkpoint(cfg, reference.random_weights(cfg, seed), (32, 32))
    return target_from_weights(fp8_config(cfg, (32, 32)), tensors, device="cuda", dtype=DTYPE)


def tiny_target(quant: bool, seed: int):
    cfg = preset("k2-tiny")
    if quant:
        cfg = cfg.replace(quantization=k2_quantization_config(32))
    w = reference.random_weights(cfg, seed, quantize_experts_group=32 if quant else None)
    weights = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}
    return target_from_weights(cfg, weights, device="cuda", dtype=DTYPE)


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(np.random.default_rng().integers(1 << 30))
    print(f"\nbitwise GPU tests: seed {s}")
    return s


@pytest.fixture(scope="module")
def tiny_targets(seed):
    return {"dense": tiny_target(False, seed), "w4a16": tiny_target(True, seed + 1), "fp8": fp8_target(seed + 2)}


# ------------------------------------------------------------------------------- 1. logits


@pytest.mark.parametrize("prompt_len", [19, 500])
@pytest.mark.parametrize("quant", ["dense", "w4a16", "fp8"])
def test_logits_alone_equal_rows_in_verify_blocks(tiny_targets, seed, quant, prompt_len):
    """500 + up to 129 new keys cross the attention kernel's 512-key chunk boundary."""
    target = tiny_targets[quant]
    g = torch.Generator().manual_seed(seed + prompt_len)
    prompt = torch.randint(0, target.cfg.vocab_size, (prompt_len,), generator=g).tolist()
    t0 = time.perf_counter()
    bad = check_target(target, prompt, TS, seed + prompt_len)
    print(f"{quant} prompt {prompt_len}: {len(TS)} block sizes in {time.perf_counter() - t0:.1f}s")
    assert not bad, f"seed {seed}:\n" + "\n".join(bad[:20])


# ------------------------------------------------------------------------------- 2. generation


def _mix(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 2


class _DraftCache:
    def __init__(self) -> None:
        self.length = 0

    def crop(self, n: int) -> None:
        self.length = n


class OracleDrafter:
    """The drafter protocol (block_size, target_layer_ids, new_cache, propose) with block logits that
    rank the true continuation (``future``: prompt + plain-decoding tokens) first, or second with
    probability ``miss``: rounds accept paths of varied depth, so verify rows at depth > 0 and the KV
    compaction decide the output. The proposals are a function of (start, bonus) only."""

    def __init__(self, future: list[int], vocab: int, block_size: int = 16, miss: float = 0.3, seed: int = 0):
        self.future, self.vocab, self.block_size, self.miss, self.seed = future, vocab, block_size, miss, seed
        self.target_layer_ids = (0,)

    def new_cache(self, max_tokens: int) -> _DraftCache:
        return _DraftCache()

    def propose(self, target, ctx, bonus, cache, start: int) -> torch.Tensor:
        cache.length = start
        g = torch.Generator().manual_seed(_mix(self.seed, start, int(bonus)))
        B = self.block_size
        logits = torch.randn(B - 1, self.vocab, generator=g)
        for k in range(1, B):
            if start + k >= len(self.future):
                break
            t = self.future[start + k]
            if float(torch.rand((), generator=g)) < self.miss:
                other = (t + 1 + int(torch.randint(0, self.vocab - 1, (), generator=g))) % self.vocab
                logits[k - 1, other], logits[k - 1, t] = 12.0, 11.0
            else:
                logits[k - 1, t] = 12.0
        return logits.to(target.device)


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _compare(name: str, target, prompts: list[list[int]], drafter_for, n_tokens: int) -> tuple[list[str], dict]:
    """Plain decoding of each prompt, then every mode; returns failures and mean tau per mode."""
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    bad: list[str] = []
    taus: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        ref = generate(target, prompt, params).token_ids
        drafter = drafter_for(prompt, ref)
        for spec, budget in MODES:
            r = generate(target, prompt, params, spec=spec, drafter=drafter, budget=budget)
            mode = spec if budget is None else f"{spec} budget {budget}"
            taus.setdefault(mode, []).append(r.stats["tau"])
            if r.token_ids != ref:
                j = _first_diff(r.token_ids, ref)
                bad.append(f"{name}, {mode}, prompt {i} ({len(prompt)} tokens: {prompt[:8]}...): first divergence at "
                           f"token {j}: spec {r.token_ids[j:j + 4]} vs plain {ref[j:j + 4]}")
    return bad, {m: round(sum(v) / len(v), 2) for m, v in taus.items()}


def _random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(3, 41, ())),), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("quant", ["dense", "w4a16", "fp8"])
def test_greedy_spec_equals_plain_random_targets(tiny_targets, seed, quant):
    target = tiny_targets[quant]
    vocab = target.cfg.vocab_size
    prompts = _random_prompts(max(1, N_PROMPTS // 2), vocab, seed + 7)
    t0 = time.perf_counter()
    bad, taus = _compare(f"random K2-tiny {quant} + oracle drafter", target, prompts,
                         lambda p, ref: OracleDrafter(p + ref, vocab, seed=seed), N_TOKENS)
    print(f"random {quant}: {len(prompts)} prompts x {N_TOKENS} tokens, tau {taus}, {time.perf_counter() - t0:.1f}s")
    assert not bad, f"seed {seed}:\n" + "\n".join(bad[:20])
    assert min(taus.values()) > 1.5, f"the oracle drafter should be accepted deeply: {taus}"


def test_greedy_spec_equals_plain_random_dflash_drafter(tiny_targets, seed):
    """The real DFlash drafter code path (aux features, drafter cache) with random weights."""
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.model.dflash import DFlashDrafter

    target = tiny_targets["w4a16"]
    cfg = target.cfg
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=8, mask_token_id=cfg.vocab_size - 1,
                       target_layer_ids=(0, 3), num_target_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size)
    drafter = DFlashDrafter.random(dcfg, seed=seed, dtype=DTYPE, device="cuda")
    prompts = _random_prompts(1, cfg.vocab_size, seed + 11)  # tau ~ 1 here: every round is a full verify
    t0 = time.perf_counter()
    bad, taus = _compare("random K2-tiny w4a16 + random DFlash drafter", target, prompts, lambda p, ref: drafter,
                         N_TOKENS)
    print(f"random DFlash drafter: {len(prompts)} prompts, tau {taus}, {time.perf_counter() - t0:.1f}s")
    assert not bad, f"seed {seed}:\n" + "\n".join(bad[:20])


STDLIB = ["textwrap", "heapq", "bisect", "fnmatch", "shlex", "glob", "colorsys", "queue", "sched", "string",
          "calendar", "difflib", "pprint", "reprlib", "statistics", "tokenize", "gettext", "netrc", "dataclasses",
          "functools", "argparse", "base64", "csv", "ftplib", "ipaddress", "json.decoder", "locale", "mimetypes"]


def demo_prompts(tokenizer, n: int) -> list[list[int]]:
    """Snippets of standard-library modules (the demo's training domain), each from a ``def`` line."""
    out = []
    for name in STDLIB:
        if len(out) == n:
            break
        try:
            src = Path(importlib.import_module(name).__file__).read_text().splitlines()
        except (ImportError, OSError, TypeError):
            continue
        starts = [i for i, line in enumerate(src) if line.lstrip().startswith("def ")]
        if not starts:
            continue
        i = starts[len(starts) // 2]
        out.append(tokenizer.encode("\n".join(src[i:i + 8])[:400], special=True, add_special_tokens=True))
    assert len(out) == n, f"only {len(out)} standard-library snippets found"
    return out


@pytest.fixture(scope="module")
def demo_pair():
    dev = torch.device("cuda")
    target = load_target(DEMO_DIR, device=dev, dtype=DTYPE, progress=False)
    drafter = load_drafter(DEMO_DIR / "draft", target)
    tok = load_tokenizer(DEMO_DIR)
    assert tok is not None
    return target, drafter, tok


def test_greedy_spec_equals_plain_demo(demo_pair):
    target, drafter, tok = demo_pair
    prompts = demo_prompts(tok, N_PROMPTS)
    t0 = time.perf_counter()
    bad, taus = _compare("demo pair", target, prompts, lambda p, ref: drafter, N_TOKENS)
    print(f"demo: {len(prompts)} prompts x {N_TOKENS} tokens, tau {taus}, {time.perf_counter() - t0:.1f}s")
    assert not bad, "\n".join(bad[:20])


def test_demo_logits_alone_equal_rows_in_verify_blocks(demo_pair):
    target, _, tok = demo_pair
    prompt = demo_prompts(tok, 1)[0]
    bad = check_target(target, prompt, [1, 2, 5, 16, 17, 64, 129], seed=3)
    assert not bad, "\n".join(bad[:20])
