"""Golden bundles: one ``.safetensors`` file holding a random model, a prompt and its golden tokens.

Tensors: the model weights under their canonical names (float32, or the W4A16 pair
``weight_packed`` int32 / ``weight_scale`` float32 for routed experts, or for ``fp8`` every linear but
lm_head as ``weight`` uint8 (the float8_e4m3fn bytes: numpy has no FP8 type) with ``weight_scale_inv``
float32, fp8.py), plus ``__prompt_ids__`` (int64 [P]) and ``__golden_tokens__`` (int64 [N]). Metadata
(strings): ``format`` = ``kdtree-golden/1``, ``config`` (JSON of ``ModelConfig.to_dict()``, with the
quantization_config), ``dtype_reference`` (``float64``), ``quant`` (``none`` | ``w4a16`` | ``fp8``),
``group_size``, ``seed``, and informational ``min_margin`` (smallest top-1 minus top-2 reference logit over the
golden steps).

Golden tokens are the greedy continuation computed by the numpy reference in float64 (FP8 weights:
on their dequantized values).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from kdtree_engine import reference
from kdtree_engine.config import ConfigError, ModelConfig, preset
from .errors import BundleError
from .fp8 import FP8_DTYPE, Fp8Block, dequantize_fp8, quantize_fp8
from .quant import Fp8Scheme, fp8_quantization_config, k2_quantization_config, parse_quantization_config

FORMAT = "kdtree-golden/1"
PROMPT_KEY = "__prompt_ids__"
GOLDEN_KEY = "__golden_tokens__"
QUANT_MODES = ("none", "w4a16", "fp8")
FP8_BLOCK = (32, 32)   # the tiny models' FP8 block: several blocks per matrix, partial ones on 48-wide ones
SCALE_INV = ".weight_scale_inv"

# A bundle's prompt is redrawn (deterministically from the seed) until the golden tokens are robust:
# every step's top-1 / top-2 gap in the float64 reference is at least MIN_MARGIN, and models with every
# weight perturbed by a relative PERTURB (a few times bfloat16's rounding) pick the same tokens.
MIN_MARGIN = 0.5
PERTURB = (0.01, 0.01)
PROMPT_ATTEMPTS = 16



@dataclass
class Bundle:
    cfg: ModelConfig
    weights: dict[str, np.ndarray]
    prompt_ids: np.ndarray  # int64 [P]
    golden_tokens: np.ndarray  # int64 [N]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def quant(self) -> str:
        return self.meta.get("quant", "none")


def greedy_with_margin(cfg: ModelConfig, weights: dict[str, np.ndarray], prompt: np.ndarray,
                       n_tokens: int) -> tuple[list[int], float]:
    """Reference float64 greedy tokens and the smallest top-1 minus top-2 logit gap over the steps."""
    w = reference.prepare_weights(cfg, weights, np.float64)
    tokens = reference.greedy(cfg, w, prompt, n_tokens, dtype=np.float64)
    return tokens, teacher_forced_margin(cfg, w, prompt, tokens)


def teacher_forced_margin(cfg: ModelConfig, weights: dict[str, np.ndarray], prompt: np.ndarray,
                          tokens: list[int]) -> float:
    """Smallest (logit of the given token - best other logit) over the steps, in one causal pass.

    Positive means greedy decoding of ``weights`` reproduces ``tokens`` exactly (by induction over steps).
    """
    seq = np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(tokens, dtype=np.int64)])
    logits = reference.forward(cfg, weights, seq[:-1], dtype=np.float64)[len(prompt) - 1:]  # [N, V]
    tok = np.asarray(tokens, dtype=np.int64)
    chosen = logits[np.arange(len(tok)), tok]  # [N]
    logits[np.arange(len(tok)), tok] = -np.inf
    return float(np.min(chosen - logits.max(axis=-1)))


def _perturbed(cfg: ModelConfig, weights: dict[str, np.ndarray], rel: float, seed: int) -> dict[str, np.ndarray]:
    """float64 weights times (1 + rel * N(0, 1)) elementwise (W4A16 experts: dequantized, then perturbed)."""
    rng = np.random.default_rng(seed)
    w = reference.prepare_weights(cfg, weights, np.float64)
    return {k: (v * (1.0 + rel * rng.standard_normal(v.shape)) if not k.startswith("__") else v)
            for k, v in w.items()}


def robustness(cfg: ModelConfig, weights: dict[str, np.ndarray], prompt: np.ndarray,
               tokens: list[int], margin: float) -> float:
    """min(margin / MIN_MARGIN - 1, perturbed teacher-forced margins...): >= 0 when the golden is robust.

    A golden stuck on a few ids (an attractor of the random model) scores -1: it would test little.
    """
    if len(set(tokens)) < min(16, (len(tokens) + 1) // 2):
        return -1.0
    score = margin / MIN_MARGIN - 1.0
    for i, rel in enumerate(PERTURB):
        score = min(score, teacher_forced_margin(cfg, _perturbed(cfg, weights, rel, 1000 + i), prompt, tokens))
        if score < 0:
            break
    return score


def make_bundle(cfg: ModelConfig | str, seed: int, n_tokens: int, prompt_len: int,
                quant: str | None = None, group_size: int = 32) -> Bundle:
    """Random weights from ``seed``, a prompt drawn from ``seed`` and the float64 reference's greedy tokens.

    The prompt is redrawn until the golden tokens are robust (see :func:`robustness`; the most robust of
    PROMPT_ATTEMPTS otherwise, flagged ``robust: no``); the same arguments always give the same bundle.
    """
    if isinstance(cfg, str):
        cfg = preset(cfg)
    quant = "none" if quant in (None, "none") else quant
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if n_tokens < 1 or prompt_len < 1:
        raise ValueError("n_tokens and prompt_len must be >= 1")
    if prompt_len + n_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt_len + n_tokens exceeds max_position_embeddings ({cfg.max_position_embeddings})")
    if quant == "w4a16":
        # The engine learns which linears are INT4 from the config, as from a real checkpoint.
        cfg = cfg.replace(quantization=k2_quantization_config(group_size))
    weights = reference.random_weights(
        cfg, seed, quantize_experts_group=group_size if quant == "w4a16" else None)
    if quant == "fp8":
        cfg = cfg.replace(quantization=fp8_quantization_config(FP8_BLOCK))
        weights = fp8_weights(weights, Fp8Block(*FP8_BLOCK))
    ref_weights = dequantized(weights, Fp8Block(*FP8_BLOCK) if quant == "fp8" else None)
    rng = np.random.default_rng([seed, 0x60])
    # Special ids (bos/eos) are kept out of the prompt; eos may still appear among the golden tokens.
    special = set(cfg.eos_token_ids) | ({cfg.bos_token_id} if cfg.bos_token_id is not None else set())
    allowed = np.array([t for t in range(cfg.vocab_size) if t not in special], dtype=np.int64)
    best: tuple[float, float, np.ndarray, list[int], int] | None = None
    for attempt in range(PROMPT_ATTEMPTS):
        prompt = rng.choice(allowed, size=prompt_len)
        tokens, margin = greedy_with_margin(cfg, ref_weights, prompt, n_tokens)
        score = robustness(cfg, ref_weights, prompt, tokens, margin)
        if best is None or score > best[0]:
            best = (score, margin, prompt, tokens, attempt)
        if score >= 0:
            break
    assert best is not None
    score, margin, prompt, tokens, attempt = best
    meta = {
        "format": FORMAT,
        "config": json.dumps(cfg.to_dict(), sort_keys=True),
        "dtype_reference": "float64",
        "quant": quant,
        "group_size": str(group_size if quant == "w4a16" else 0),
        **({"fp8_block": f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]}"} if quant == "fp8" else {}),
        "seed": str(seed),
        "min_margin": f"{margin:.6g}",
        "robust": "yes" if score >= 0 else "no",
        "prompt_attempt": str(attempt),
    }
    return Bundle(cfg=cfg, weights=weights, prompt_ids=np.asarray(prompt, dtype=np.int64),
                  golden_tokens=np.asarray(tokens, dtype=np.int64), meta=meta)


def fp8_weights(weights: dict[str, np.ndarray], block: Fp8Block) -> dict[str, np.ndarray]:
    """Float weights -> the FP8 release's form: every linear weight but lm_head as float8_e4m3fn bytes (uint8) with
    its ``weight_scale_inv``; norms, the embedding, the router and lm_head as given."""
    out: dict[str, np.ndarray] = {}
    for name, v in weights.items():
        linear = name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")
        if not linear:
            out[name] = v
            continue
        q, s = quantize_fp8(torch.from_numpy(np.ascontiguousarray(v)), block)
        out[name] = q.view(torch.uint8).numpy()
        out[name[: -len(".weight")] + SCALE_INV] = s.numpy()
    return out


def dequantized(weights: dict[str, np.ndarray], block: Fp8Block | None) -> dict[str, np.ndarray]:
    """The float32 values of a bundle's FP8 linears of ``block`` (``weight`` bytes times their block scales,
    fp8.py); other tensors as stored (all of them when block is None). What the numpy reference runs on."""
    if block is None:
        return weights
    out: dict[str, np.ndarray] = {}
    for name, v in weights.items():
        if name.endswith(SCALE_INV):
            continue
        scale = weights.get(name[: -len(".weight")] + SCALE_INV) if name.endswith(".weight") else None
        out[name] = v if scale is None else dequantize_fp8(
            torch.from_numpy(v).view(FP8_DTYPE), torch.from_numpy(scale), block).numpy()
    return out


def reference_weights(bundle: Bundle) -> dict[str, np.ndarray]:
    """The weights the numpy reference runs a bundle on (FP8 linears dequantized)."""
    scheme = parse_quantization_config(bundle.cfg.quantization)
    return dequantized(bundle.weights, scheme.block if isinstance(scheme, Fp8Scheme) else None)


def engine_tensors(bundle: Bundle) -> dict[str, torch.Tensor]:
    """The bundle's weights as the engine loads them: FP8 bytes viewed as float8_e4m3fn."""
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in bundle.weights.items()}
    for name in list(out):
        if name.endswith(SCALE_INV):
            w = name[: -len(SCALE_INV)] + ".weight"
            out[w] = out[w].view(FP8_DTYPE)
    return out


def save_bundle(bundle: Bundle, path: str | os.PathLike) -> Path:
    """Write atomically: a temporary file in the target directory, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in bundle.weights.items()}
    tensors[PROMPT_KEY] = np.asarray(bundle.prompt_ids, dtype=np.int64)
    tensors[GOLDEN_KEY] = np.asarray(bundle.golden_tokens, dtype=np.int64)
    meta = {str(k): str(v) for k, v in bundle.meta.items()}
    meta["format"] = FORMAT
    meta["config"] = json.dumps(bundle.cfg.to_dict(), sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read_header(path: Path) -> dict[str, Any]:
    """Validate the safetensors framing ourselves so truncation gives a clear message."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BundleError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or 8 + n > size:
            raise BundleError(f"{path}: truncated or corrupt safetensors header "
                              f"(header claims {n} bytes, file has {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise BundleError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            raise BundleError(f"{path}: corrupt safetensors header entry {name!r}") from None
    if 8 + n + end > size:
        raise BundleError(f"{path}: truncated: tensor data needs {8 + n + end} bytes, file has {size}")
    return header


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read and validate a golden bundle; any problem raises :class:`BundleError`."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"golden bundle not found: {path}")
    header = _read_header(path)
    meta = header.get("__metadata__") or {}
    fmt = meta.get("format")
    if fmt != FORMAT:
        raise BundleError(f"{path}: not a golden bundle (format tag {fmt!r}, expected {FORMAT!r})")
    if "config" not in meta:
        raise BundleError(f"{path}: metadata has no 'config'")
    try:
        cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: metadata 'config' is not valid JSON ({e})") from None
    except ConfigError as e:
        raise BundleError(f"{path}: invalid config: {e}") from None
    for key in (PROMPT_KEY, GOLDEN_KEY):
        if key not in header:
            raise BundleError(f"{path}: missing tensor {key}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"{path}: corrupt safetensors file ({e})") from None
    prompt = tensors.pop(PROMPT_KEY).astype(np.int64).reshape(-1)
    golden = tensors.pop(GOLDEN_KEY).astype(np.int64).reshape(-1)
    if prompt.size == 0:
        raise BundleError(f"{path}: tensor {PROMPT_KEY} is empty")
    for key, arr in ((PROMPT_KEY, prompt), (GOLDEN_KEY, golden)):
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
            raise BundleError(f"{path}: tensor {key} holds ids outside the vocabulary ({cfg.vocab_size})")
    missing = missing_weights(cfg, tensors)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise BundleError(f"{path}: missing weight tensors: {', '.join(missing[:5])}{more}")
    return Bundle(cfg=cfg, weights=tensors, prompt_ids=prompt, golden_tokens=golden, meta=dict(meta))


def missing_weights(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> list[str]:
    """Names absent from ``tensors``; an expert linear may be ``.weight`` or ``.weight_packed`` + ``.weight_scale``."""
    missing = []
    for name in reference.weight_names(cfg):
        if name in tensors:
            continue
        if ".experts." in name:
            base = name[: -len(".weight")]
            if base + ".weight_packed" in tensors and base + ".weight_scale" in tensors:
                continue
        missing.append(name)
    return missing
