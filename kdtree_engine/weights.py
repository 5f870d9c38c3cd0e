"""Checkpoint I/O for Hugging Face safetensors checkpoints of the K2 family.

Names. A *canonical* name is the HF tensor name without the model prefix: ``embed_tokens.weight``,
``layers.3.mlp.experts.7.up_proj.weight_packed``, ``lm_head.weight``. Files use the K2 layout
(``model.`` prefix, ``lm_head.weight``) or the K2.5/K2.6 layout (``language_model.model.`` prefix,
``language_model.lm_head.weight``, plus ``vision_tower.*`` / ``mm_projector.*`` that a text engine
skips).

Strictness. :func:`iter_checkpoint` first reads every shard's header and checks the whole file set
against :func:`expected_tensors` (names, shapes, dtypes, the values of ``weight_shape``), so a bad
checkpoint fails before any weight is read; each problem raises :class:`WeightsError` naming the
file, the tensor as spelled in the file, the expected and the found value.

Yield. (canonical name, CPU tensor in the file's dtype), in file order (shards sorted by name,
tensors in header order), so consumers must not assume any order. Dense tensors end in ``.weight``
(router bias: ``.e_score_correction_bias``); INT4 linears yield ``.weight_packed`` int32 [N, K/8]
and ``.weight_scale`` [N, K/g] (g = ``quant_scheme(cfg).group_size``), never ``.weight_shape``
(checked, then dropped); FP8 block-quantized linears (quant.py ``Fp8Scheme``) yield ``.weight`` float8_e4m3fn
[N, K] and ``.weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)]. A tied model may omit ``lm_head.weight``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .errors import WeightsError
from .logs import log_once
from .config import ModelConfig
from .fp8 import FP8_DTYPE, SCALE_DTYPE
from .parallel.shard import WHOLE, IndexFn, sliced_shape
from .quant import Fp8Scheme, QuantScheme, parse_quantization_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

FLOAT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})
PACKED_DTYPES = frozenset({torch.int32})
SHAPE_DTYPES = frozenset({torch.int32, torch.int64})
FP8_DTYPES = frozenset({FP8_DTYPE})
FP8_SCALE_DTYPES = frozenset({SCALE_DTYPE})

# Prefixes of the text model in each layout; lm_head sits outside ``model.``.
LAYOUTS: dict[str, tuple[str, str]] = {
    "k2": ("model.", ""),  # (model prefix, lm_head prefix)
    "k25": ("language_model.model.", "language_model."),
}
SKIP_PREFIXES = ("vision_tower.", "mm_projector.")

# safetensors header dtype strings -> torch dtypes.
_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")



@dataclass(frozen=True)
class TensorSpec:
    """What the engine accepts for one canonical tensor name."""

    shape: tuple[int, ...]
    dtypes: frozenset[torch.dtype]
    optional: bool = False  # may be absent (lm_head.weight of a tied model)
    value: tuple[int, ...] | None = None  # required contents (``weight_shape`` = [N, K])


# ---- names -------------------------------------------------------------------------------------

def canonical_name(raw: str, cfg: ModelConfig | None = None) -> str | None:
    """File tensor name -> canonical name, or None for tensors a text engine skips.

    Skipped: ``vision_tower.*``, ``mm_projector.*``, ``*rotary_emb.*`` and, given ``cfg``, MTP
    layers (``layers.{i}`` with i >= num_hidden_layers).
    """
    if raw.startswith(SKIP_PREFIXES) or "rotary_emb." in raw:
        return None
    if raw in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    name = raw
    for prefix in ("language_model.model.", "model."):
        if raw.startswith(prefix):
            name = raw[len(prefix):]
            break
    m = _LAYER_RE.match(name)
    if m and cfg is not None and int(m.group(1)) >= cfg.num_hidden_layers:
        return None
    return name


def raw_name(canonical: str, layout: str = "k2") -> str:
    """Canonical name -> the name a file of ``layout`` ('k2' or 'k25') stores."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    model_prefix, head_prefix = LAYOUTS[layout]
    if canonical.startswith("lm_head."):
        return head_prefix + canonical
    return model_prefix + canonical


def quant_scheme(cfg: ModelConfig) -> QuantScheme | Fp8Scheme | None:
    """The config's W4A16 or FP8 scheme (None when the checkpoint is not quantized); QuantError if unsupported."""
    return parse_quantization_config(cfg.quantization)


def linear_modules(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """Every linear of the text model as (canonical module name, N = out, K = in)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    out: list[tuple[str, int, int]] = []
    for i in range(cfg.num_hidden_layers):
        a = f"layers.{i}.self_attn."
        if cfg.q_lora_rank is None:
            out.append((a + "q_proj", nh * cfg.qk_head_dim, h))
        else:
            out.append((a + "q_a_proj", cfg.q_lora_rank, h))
            out.append((a + "q_b_proj", nh * cfg.qk_head_dim, cfg.q_lora_rank))
        out.append((a + "kv_a_proj_with_mqa", cfg.kv_cache_dim, h))
        out.append((a + "kv_b_proj", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
        out.append((a + "o_proj", h, nh * cfg.v_head_dim))
        m = f"layers.{i}.mlp."
        if not cfg.is_moe_layer(i):
            out += _swiglu(m, cfg.intermediate_size, h)
            continue
        if cfg.n_shared_experts:
            out += _swiglu(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, h)
        for e in range(cfg.n_routed_experts):
            out += _swiglu(f"{m}experts.{e}.", cfg.moe_intermediate_size, h)
    out.append(("lm_head", cfg.vocab_size, h))
    return out


def _swiglu(prefix: str, width: int, h: int) -> list[tuple[str, int, int]]:
    return [(prefix + "gate_proj", width, h), (prefix + "up_proj", width, h), (prefix + "down_proj", h, width)]


_NO_SCHEME: Any = object()


def expected_tensors(cfg: ModelConfig, scheme: QuantScheme | Fp8Scheme | None = _NO_SCHEME
                     ) -> dict[str, TensorSpec]:
    """Canonical name -> :class:`TensorSpec` for every tensor of the text model.

    ``scheme`` defaults to the config's quantization_config; linears it marks INT4 expect
    ``weight_packed`` int32 [N, K/8], ``weight_scale`` float [N, K/g], ``weight_shape`` int [2] = [N, K];
    linears it marks FP8 expect ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32
    [ceil(N/bn), ceil(K/bk)] (fp8.py).
    """
    if scheme is _NO_SCHEME:
        scheme = quant_scheme(cfg)
    h = cfg.hidden_size
    specs: dict[str, TensorSpec] = {
        "embed_tokens.weight": TensorSpec((cfg.vocab_size, h), FLOAT_DTYPES),
        "norm.weight": TensorSpec((h,), FLOAT_DTYPES),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        specs[p + "input_layernorm.weight"] = TensorSpec((h,), FLOAT_DTYPES)
        specs[p + "post_attention_layernorm.weight"] = TensorSpec((h,), FLOAT_DTYPES)
        if cfg.q_lora_rank is not None:
            specs[p + "self_attn.q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), FLOAT_DTYPES)
        specs[p + "self_attn.kv_a_layernorm.weight"] = TensorSpec((cfg.kv_lora_rank,), FLOAT_DTYPES)
        if cfg.is_moe_layer(i):
            specs[p + "mlp.gate.weight"] = TensorSpec((cfg.n_routed_experts, h), FLOAT_DTYPES)
            specs[p + "mlp.gate.e_score_correction_bias"] = TensorSpec((cfg.n_routed_experts,), FLOAT_DTYPES)
    for module, n, k in linear_modules(cfg):
        optional = module == "lm_head" and cfg.tie_word_embeddings
        if isinstance(scheme, Fp8Scheme) and scheme.is_quantized(module):
            specs[module + ".weight"] = TensorSpec((n, k), FP8_DTYPES, optional)
            specs[module + ".weight_scale_inv"] = TensorSpec(scheme.block.scale_shape(n, k), FP8_SCALE_DTYPES, optional)
        elif scheme is not None and scheme.is_quantized(module):
            g = scheme.group_size
            if k % g:
                raise WeightsError(
                    f"linear '{module}' has K={k} inputs, not a multiple of the quantization group_size {g}")
            specs[module + ".weight_packed"] = TensorSpec((n, k // 8), PACKED_DTYPES, optional)
            specs[module + ".weight_scale"] = TensorSpec((n, k // g), FLOAT_DTYPES, optional)
            specs[module + ".weight_shape"] = TensorSpec((2,), SHAPE_DTYPES, optional, value=(n, k))
        else:
            specs[module + ".weight"] = TensorSpec((n, k), FLOAT_DTYPES, optional)
    return specs


# ---- validation --------------------------------------------------------------------------------

def _dtype_str(d: torch.dtype | str) -> str:
    return str(d).removeprefix("torch.")


class _Checker:
    """Checks a stream of (raw name, shape, dtype) against the expected set; reports missing at the end."""

    def __init__(self, cfg: ModelConfig, scheme: QuantScheme | Fp8Scheme | None | Any = _NO_SCHEME) -> None:
        self.cfg = cfg
        self.specs = expected_tensors(cfg, scheme)
        self.seen: dict[str, tuple[str, str]] = {}  # canonical -> (raw name, file)
        self.layout = "k2"

    def see(self, raw: str, shape: tuple[int, ...], dtype: torch.dtype | str, where: str) -> str | None:
        """Validates one tensor; returns its canonical name, or None when it is skipped."""
        canon = canonical_name(raw, self.cfg)
        if canon is None:
            return None
        if raw.startswith("language_model."):
            self.layout = "k25"
        if canon in self.seen:
            first, file = self.seen[canon]
            raise WeightsError(f"{where}: tensor '{raw}' duplicates '{first}' (in {file})")
        spec = self.specs.get(canon)
        if spec is None:
            raise WeightsError(f"{where}: unexpected tensor '{raw}' (shape {list(shape)}, "
                               f"{_dtype_str(dtype)}){self._hint(canon)}")
        self.seen[canon] = (raw, where)
        if tuple(shape) != spec.shape:
            raise WeightsError(f"{where}: tensor '{raw}' has shape {list(shape)}, expected "
                               f"{list(spec.shape)} from the config")
        if dtype not in spec.dtypes:
            allowed = ", ".join(sorted(_dtype_str(d) for d in spec.dtypes))
            hint = ""
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1:
                hint = (" (an FP8 weight where the quantization_config wants none: FP8 checkpoints need "
                        "quantization_config.quant_method 'fp8' and this linear outside its ignore list)")
            elif spec.dtypes == FP8_DTYPES:
                hint = (" (the fp8 quantization_config makes this linear FP8; list it in ignored_layers to "
                        "keep it unquantized)")
            raise WeightsError(f"{where}: tensor '{raw}' has dtype {_dtype_str(dtype)}, expected one of "
                               f"{allowed}{hint}")
        return canon

    def check_value(self, raw: str, canon: str, value: torch.Tensor, where: str) -> None:
        expected = self.specs[canon].value
        if expected is not None and tuple(int(v) for v in value.tolist()) != expected:
            raise WeightsError(f"{where}: tensor '{raw}' holds {value.tolist()}, expected {list(expected)} "
                               f"(the linear's [N, K] from the config)")

    def finish(self, where: str) -> None:
        missing = [n for n, s in self.specs.items() if n not in self.seen and not s.optional]
        if missing:
            shown = ", ".join(raw_name(n, self.layout) for n in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            raise WeightsError(f"{where}: {len(missing)} tensor(s) missing: {shown}{more}")
        # A tied lm_head may be absent, but if any of its tensors is present all must be.
        head = [n for n in self.specs if n.startswith("lm_head.")]
        if any(n in self.seen for n in head):
            for n in head:
                if n not in self.seen:
                    raise WeightsError(f"{where}: tensor '{raw_name(n, self.layout)}' missing")

    def _hint(self, canon: str) -> str:
        module, _, suffix = canon.rpartition(".")
        if suffix == "weight_scale_inv":
            return "; an FP8 block scale of a linear the quantization_config does not make FP8"
        if suffix == "weight" and module + ".weight_packed" in self.specs:
            return ("; the quantization_config makes this linear INT4 (expected weight_packed, "
                    "weight_scale, weight_shape)")
        if suffix.startswith("weight_") and module + ".weight" in self.specs:
            return "; the quantization_config does not make this linear INT4 (expected a dense weight)"
        return ""


# ---- reading -----------------------------------------------------------------------------------

def checkpoint_files(path: str | Path) -> list[tuple[Path, set[str] | None]]:
    """The safetensors files of a checkpoint: [(file, names the index lists for it, or None)].

    ``path`` is a directory (``model.safetensors`` is preferred, as HF does, else the index), a
    ``.safetensors`` file or an index ``.json`` file.
    """
    path = Path(path)
    if path.is_dir():
        if (path / SINGLE_FILE).is_file():
            return [(path / SINGLE_FILE, None)]
        if (path / INDEX_FILE).is_file():
            return _index_files(path / INDEX_FILE)
        if not path.exists():
            raise WeightsError(f"checkpoint directory {path} does not exist")
        raise WeightsError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are read)")
    if not path.exists():
        raise WeightsError(f"checkpoint {path} does not exist")
    if path.name.endswith(".json"):
        return _index_files(path)
    return [(path, None)]


def _index_files(index: Path) -> list[tuple[Path, set[str] | None]]:
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{index}: not a readable index ({e})") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise WeightsError(f"{index}: 'weight_map' must map tensor names to file names")
    by_file: dict[str, set[str]] = {}
    for name, file in wmap.items():
        by_file.setdefault(file, set()).add(name)
    out = []
    for file in sorted(by_file):
        shard = index.parent / file
        if not shard.is_file():
            raise WeightsError(f"{index}: shard file {shard} listed in weight_map does not exist")
        out.append((shard, by_file[file]))
    return out


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # SafetensorError (bad header), OSError
        raise WeightsError(f"{file}: not a readable safetensors file ({e})") from None


def _scan(files: list[tuple[Path, set[str] | None]], checker: _Checker,
          select: IndexFn | None = None) -> tuple[int, int]:
    """Header pass over every file; returns (tensors to yield, their bytes); ``select``: see iter_checkpoint."""
    count = nbytes = 0
    for file, listed in files:
        with _open(file) as f:
            keys = list(f.keys())
            if listed is not None and set(keys) != listed:
                extra, absent = sorted(set(keys) - listed), sorted(listed - set(keys))
                what = (f"holds '{extra[0]}' that the index does not list" if extra
                        else f"lacks '{absent[0]}' that the index lists")
                raise WeightsError(f"{file}: shard {what}")
            for raw in keys:
                sl = f.get_slice(raw)
                dtype = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                shape = tuple(sl.get_shape())
                canon = checker.see(raw, shape, dtype, str(file))
                if canon is None:
                    continue
                if canon.endswith(".weight_shape"):
                    checker.check_value(raw, canon, _get(f, raw, file), str(file))
                    continue
                if select is not None:
                    idx = select(canon, shape)
                    if idx is None:
                        continue
                    shape = sliced_shape(shape, idx)
                count += 1
                n = 1
                for s in shape:
                    n *= s
                nbytes += n * dtype.itemsize
    return count, nbytes


def _get(f: Any, raw: str, file: Path) -> torch.Tensor:
    try:
        return f.get_tensor(raw)
    except Exception as e:
        raise WeightsError(f"{file}: cannot read tensor '{raw}' ({e})") from None


def iter_checkpoint(path: str | Path, cfg: ModelConfig, *, progress: bool = True,
                    scheme: QuantScheme | Fp8Scheme | None | Any = _NO_SCHEME,
                    select: IndexFn | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams (canonical name, tensor) one tensor at a time, shard by shard, after a full strict check.

    Tensors come in the file's dtype, on the CPU. INT4 linears yield ``<module>.weight_packed``
    (int32 [N, K/8]) and ``<module>.weight_scale`` ([N, K/g]); their ``weight_shape`` is validated
    and not yielded. Skipped tensors (vision, rotary caches, MTP layers) are not yielded.
    ``scheme`` overrides the config's quantization_config (default: the config's). ``select`` (a tensor-parallel
    rank, parallel/shard.py): (canonical name, full shape) -> the index of the part to read, read alone from the
    file (``get_slice``), or None to skip the tensor; the strict check still covers every tensor.
    """
    files = checkpoint_files(path)
    checker = _Checker(cfg, scheme)
    count, nbytes = _scan(files, checker, select)
    checker.finish(str(path))
    bar = tqdm(total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=not progress, desc="loading weights", dynamic_ncols=True)
    yielded = 0
    try:
        for file, _ in files:
            with _open(file) as f:
                for raw in f.keys():
                    canon = canonical_name(raw, cfg)
                    if canon is None or canon.endswith(".weight_shape"):
                        continue
                    if select is None:
                        t = _get(f, raw, file)
                    else:
                        idx = select(canon, tuple(f.get_slice(raw).get_shape()))
                        if idx is None:
                            continue
                        t = _get(f, raw, file) if idx == WHOLE else read_slice(f, raw, idx, file)
                    bar.update(t.nbytes)
                    yielded += 1
                    yield canon, t
    finally:
        bar.close()
    if yielded != count:  # the files changed under us
        raise WeightsError(f"{path}: read {yielded} tensors, the header pass found {count}")


def read_slice(f: Any, raw: str, idx: tuple[slice, ...], file: Path) -> torch.Tensor:
    """The part ``idx`` of a tensor, read from the file alone (not the whole tensor)."""
    try:
        return f.get_slice(raw)[idx]
    except Exception as e:
        raise WeightsError(f"{file}: cannot read tensor '{raw}' ({e})") from None


def unscaled_linears(path: str | Path, cfg: ModelConfig) -> tuple[str, ...]:
    """Linears (canonical module names) whose ``weight`` a checkpoint stores in a float dtype without a
    ``weight_scale_inv``: an FP8 release keeps these unquantized (fp8.py). Reads the headers only."""
    dense: set[str] = set()
    scaled: set[str] = set()
    for file, _ in checkpoint_files(path):
        with _open(file) as f:
            for raw in f.keys():
                canon = canonical_name(raw, cfg)
                if canon is None:
                    continue
                if canon.endswith(".weight_scale_inv"):
                    scaled.add(canon[: -len(".weight_scale_inv")])
                elif canon.endswith(".weight") and _ST_DTYPES.get(f.get_slice(raw).get_dtype()) in FLOAT_DTYPES:
                    dense.add(canon[: -len(".weight")])
    return tuple(m for m, _, _ in linear_modules(cfg) if m in dense and m not in scaled)


def checkpoint_scheme(path: str | Path, cfg: ModelConfig) -> QuantScheme | Fp8Scheme | None:
    """The quantization scheme a checkpoint is read with: its config's; for FP8, with the linears it stores
    without a scale kept unquantized (logged once)."""
    scheme = quant_scheme(cfg)
    if not isinstance(scheme, Fp8Scheme):
        return scheme
    dense = unscaled_linears(path, cfg)
    if dense:
        shown = ", ".join(dense[:4]) + (f" and {len(dense) - 4} more" if len(dense) > 4 else "")
        log_once(f"fp8-dense:{path}", f"FP8 checkpoint {path}: {len(dense)} linear(s) stored without "
                 f"weight_scale_inv stay unquantized: {shown}")
    return scheme.keeping_dense(dense)


def load_checkpoint(path: str | Path, cfg: ModelConfig, *, progress: bool = False,
                    scheme: QuantScheme | Fp8Scheme | None | Any = _NO_SCHEME) -> dict[str, torch.Tensor]:
    """All of :func:`iter_checkpoint` in one dict (small models and tests)."""
    return dict(iter_checkpoint(path, cfg, progress=progress, scheme=scheme))


# ---- writing -----------------------------------------------------------------------------------

def config_dict(cfg: ModelConfig, layout: str = "k2") -> dict[str, Any]:
    """The config.json a checkpoint of ``layout`` carries."""
    d = cfg.to_dict()
    if layout == "k2":
        return d
    if layout != "k25":
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    quant = d.pop("quantization_config", None)
    d.pop("architectures", None)
    d["model_type"] = "kimi_k2"
    out: dict[str, Any] = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                           "text_config": d}
    if quant is not None:
        out["quantization_config"] = quant
    return out


def with_weight_shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adds the ``weight_shape`` ([N, K] int32, as the released files store it) of every INT4 linear
    that lacks one."""
    out = dict(tensors)
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            shape_name = name[: -len("packed")] + "shape"
            out.setdefault(shape_name, torch.tensor([t.shape[-2], t.shape[-1] * 8], dtype=torch.int32))
    return out


def save_checkpoint(directory: str | Path, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], *,
                    layout: Literal["k2", "k25"] = "k2", shard_bytes: int | None = None,
                    extra: Mapping[str, torch.Tensor] | None = None, check: bool = False) -> None:
    """Writes config.json + safetensors (single file, or shards of ~shard_bytes with an index).

    ``tensors`` use canonical names and get the layout's prefix; ``extra`` is written under its
    names as given (e.g. ``vision_tower.*``). ``check`` validates ``tensors`` against the config
    first (off by default so tests can write broken checkpoints). Files are written under temporary
    names and renamed at the end; stale ``model*.safetensors*`` files of an earlier checkpoint in
    ``directory`` are removed after the rename.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    tensors = with_weight_shapes(tensors)
    if check:
        checker = _Checker(cfg)
        for name, t in tensors.items():
            checker.see(raw_name(name, layout), tuple(t.shape), t.dtype, "tensors")
        checker.finish("tensors")
    named = {raw_name(n, layout): t for n, t in tensors.items()}
    for n, t in (extra or {}).items():
        if n in named:
            raise ValueError(f"extra tensor '{n}' collides with a model tensor")
        named[n] = t
    shards = _split(named, shard_bytes)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}  # final name -> payload (dict of tensors or JSON text)
    if len(shards) == 1 and shard_bytes is None:
        files[SINGLE_FILE] = shards[0]
    else:
        wmap: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            files[fname] = shard
            wmap.update({n: fname for n in shard})
        total = sum(t.nbytes for t in named.values())
        files[INDEX_FILE] = json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2)
    files["config.json"] = json.dumps(config_dict(cfg, layout), indent=2)
    _write_all(directory, files)


def _split(named: dict[str, torch.Tensor], shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, t in named.items():
        if shard_bytes is not None and shards[-1] and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += t.nbytes
    return shards


def storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two tensors sharing storage (safetensors refuses views and aliases)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for n, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset() or (ptr in seen and t.nbytes):
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[n] = t
    return out


def _write_all(directory: Path, files: Mapping[str, Any]) -> None:
    temps: dict[str, Path] = {}
    try:
        for name, payload in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            os.close(fd)
            temps[name] = Path(tmp)
            if isinstance(payload, str):
                Path(tmp).write_text(payload)
            else:
                save_file(storable(payload), tmp, metadata={"format": "pt"})
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    # config.json last, so that a config beside weights means the weights are complete.
    for name in sorted(temps, key=lambda n: n == "config.json"):
        os.replace(temps[name], directory / name)
    for old in directory.iterdir():
        stale = old.name == SINGLE_FILE or old.name == INDEX_FILE or re.fullmatch(
            r"model-\d+-of-\d+\.safetensors", old.name)
        if stale and old.name not in files:
            old.unlink()
