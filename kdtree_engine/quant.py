"""W4A16 format: symmetric group-wise INT4 in the compressed-tensors ``pack-quantized`` layout.

Layout (as the K2-Thinking / K2.5 / K2.6 checkpoints ship it), for a linear of shape [N, K]:
  weight_packed  int32 [N, K/8]   8 values per int32 along K, element j in bits [4j, 4j+3]
                                  (same bytes as uint8 [N, K/2], even k in the low nibble)
  weight_scale   bf16  [N, K/g]   one scale per g consecutive inputs of a row
  weight_shape   int   [2]        the original [N, K]; not needed at inference
  stored nibble u = q + 8, q in [-8, 7];  w[n, k] = (u - 8) * scale[n, k // g]

Which linears are quantized comes from the checkpoint's ``quantization_config``; see
:func:`parse_quantization_config` and :meth:`QuantScheme.is_quantized`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from .errors import QuantError
from .fp8 import Fp8Block

PACK = 8  # int4 values per int32
QMIN, QMAX = -8, 7  # signed int4 range; stored as u = q + 8
GROUP_SIZES = (32, 64, 128)

# Module-name prefixes of the K2 (``model.``) and K2.5/K2.6 (``language_model.model.``) layouts.
MODEL_PREFIXES = ("language_model.model.", "model.")
LM_HEAD_PREFIXES = ("language_model.", "")

# The ignore list of the K2-Thinking / K2.5 / K2.6 INT4 releases: only routed experts are INT4.
EXPERT_ONLY_IGNORE: tuple[str, ...] = (
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)



# ---- pack / unpack / quantize ------------------------------------------------------------------

def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int8 [..., K] with values q in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., K/8, 8]
    return (nibbles - 8).to(torch.int8).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., K] with q in [-8, 7] -> int32 [..., K/8] (compressed-tensors bit layout)."""
    if q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
        raise TypeError(f"pack_int4 needs integer values, got {q.dtype}")
    k = q.shape[-1]
    if k % PACK:
        raise ValueError(f"pack_int4: last dim K={k} must be a multiple of {PACK}")
    if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
        raise ValueError(f"pack_int4: values must lie in [{QMIN}, {QMAX}], got [{int(q.min())}, {int(q.max())}]")
    u = (q.to(torch.int64) + 8).unflatten(-1, (k // PACK, PACK))  # [..., K/8, 8] in [0, 15]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)  # [8]
    word = (u << shifts).sum(-1)  # [..., K/8] in [0, 2^32)
    # Reinterpret as two's-complement int32 (explicitly: int64 -> int32 casts are not wrap-defined).
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """packed int32 [..., N, K/8], scale [..., N, K/g] -> dense [..., N, K] (dtype defaults to scale's)."""
    q = unpack_int4(packed)  # [..., N, K]
    k = q.shape[-1]
    if scale.shape[-1] * group_size != k:
        raise ValueError(f"scale has {scale.shape[-1]} groups of {group_size} but the weight has K={k}")
    if scale.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"scale leading shape {tuple(scale.shape[:-1])} != packed {tuple(q.shape[:-1])}")
    w = q.float() * scale.float().repeat_interleave(group_size, dim=-1)
    return w.to(dtype or scale.dtype)


def quantize(w: torch.Tensor, group_size: int,
             dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric group INT4: w [..., N, K] -> (packed int32 [..., N, K/8], scale [..., N, K/g]).

    Rule: scale = absmax(group) / 7, rounded to ``dtype``; q = round_half_even(w / scale) clamped
    to [-8, 7], computed in float32 against the *stored* (rounded) scale, so that
    |w - q * scale| <= scale / 2 for every element. Dividing by 7 (not compressed-tensors' 7.5)
    keeps the grid symmetric ([-7, 7], 15 levels, as the K2-Thinking QAT weights use) and never
    clips the group maximum. A group of zeros gets scale 0 and q 0.
    """
    if not w.dtype.is_floating_point:
        raise TypeError(f"quantize needs a floating-point weight, got {w.dtype}")
    if group_size <= 0 or group_size % PACK:
        raise ValueError(f"group_size must be a positive multiple of {PACK}, got {group_size}")
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"quantize: K={k} is not a multiple of group_size={group_size}")
    wg = w.float().unflatten(-1, (k // group_size, group_size))  # [..., N, K/g, g]
    scale = (wg.abs().amax(-1) / 7.0).to(dtype)  # [..., N, K/g]
    s = scale.float().unsqueeze(-1)  # [..., N, K/g, 1]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(wg / safe), torch.zeros_like(wg))
    q = q.clamp(QMIN, QMAX).to(torch.int8).flatten(-2)  # [..., N, K]
    return pack_int4(q), scale


# ---- quantization_config -----------------------------------------------------------------------

@dataclass(frozen=True)
class QuantScheme:
    """A supported W4A16 scheme: symmetric INT4, group strategy, compressed-tensors pack-quantized.

    ``targets``: names/regexes/class names of quantized modules (``"Linear"`` = every linear);
    ``ignore``: exceptions (``re:`` regexes use :func:`re.match`, plain strings compare exactly).
    """

    group_size: int
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    num_bits: int = 4

    def is_quantized(self, module_name: str) -> bool:
        """Whether the linear ``module_name`` is stored as INT4.

        ``module_name`` names an ``nn.Linear`` of the HF model (e.g. ``layers.1.mlp.experts.0.up_proj``,
        ``model.layers.0.self_attn.o_proj``, ``lm_head``); with or without the ``model.`` /
        ``language_model.model.`` prefix. Checkpoint configs write patterns against whichever naming
        their exporter saw, so a pattern matches when it matches the name in any of the layouts
        (bare, ``model.``-, ``language_model.model.``-prefixed; ``lm_head`` / ``language_model.lm_head``).
        """
        names = module_name_variants(module_name)
        if not any(_matches(n, t, linear=True) for n in names for t in self.targets):
            return False
        return not any(_matches(n, t, linear=True) for n in names for t in self.ignore)


def strip_module_prefix(name: str) -> str:
    """``model.x`` / ``language_model.model.x`` -> ``x``; ``language_model.lm_head`` -> ``lm_head``."""
    for p in MODEL_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    if name.startswith("language_model.lm_head"):
        return name[len("language_model."):]
    return name


def module_name_variants(name: str) -> tuple[str, ...]:
    """The name as given plus its spellings in every checkpoint layout (bare and prefixed)."""
    bare = strip_module_prefix(name)
    if bare == "lm_head" or bare.startswith("lm_head."):
        spellings = [p + bare for p in LM_HEAD_PREFIXES]
    else:
        spellings = [bare] + [p + bare for p in MODEL_PREFIXES]
    return tuple(dict.fromkeys([name, *spellings]))


def _matches(name: str, target: str, *, linear: bool) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == "Linear":  # a class-name target (compressed-tensors matches class names too)
        return linear
    return target == name


def _refuse(field: str, value: Any, why: str = "") -> QuantError:
    tail = f" ({why})" if why else ""
    return QuantError(f"quantization_config field '{field}' = {value!r} is not supported{tail}")


def _check_weights(path: str, w: Any) -> int:
    """Validates one group's ``weights`` args; returns the group size."""
    if not isinstance(w, Mapping):
        raise _refuse(path, w, "a W4A16 scheme needs weight quantization args")
    if w.get("num_bits") != 4:
        raise _refuse(f"{path}.num_bits", w.get("num_bits"), "only 4-bit weights")
    if w.get("type", "int") != "int":
        raise _refuse(f"{path}.type", w.get("type"), "only integer weights")
    if w.get("symmetric", True) is not True:
        raise _refuse(f"{path}.symmetric", w.get("symmetric"), "only symmetric (no zero point)")
    if w.get("strategy") != "group":
        raise _refuse(f"{path}.strategy", w.get("strategy"), "only 'group'")
    g = w.get("group_size")
    if isinstance(g, bool) or g not in GROUP_SIZES:
        raise _refuse(f"{path}.group_size", g, f"one of {GROUP_SIZES}")
    if w.get("actorder") not in (None, False):
        raise _refuse(f"{path}.actorder", w.get("actorder"), "activation reordering (g_idx) is not served")
    if w.get("dynamic", False) not in (False, None):
        raise _refuse(f"{path}.dynamic", w.get("dynamic"), "weights must be static")
    if w.get("block_structure") is not None:
        raise _refuse(f"{path}.block_structure", w.get("block_structure"))
    return int(g)


def parse_quantization_config(d: Mapping[str, Any] | None) -> QuantScheme | Fp8Scheme | None:
    """A checkpoint's ``quantization_config`` -> :class:`QuantScheme` / :class:`Fp8Scheme` (None for an
    unquantized model).

    Accepts compressed-tensors ``pack-quantized`` W4A16 (symmetric int4, group 32/64/128, no
    act-order, no activation quantization) and the FP8 block format (:func:`parse_fp8_config`); anything
    else raises :class:`QuantError` naming the field.
    """
    if d is None:
        return None
    if not isinstance(d, Mapping):
        raise QuantError(f"quantization_config must be an object, got {type(d).__name__}")
    method = d.get("quant_method")
    if method == "fp8":
        return parse_fp8_config(d)
    if method != "compressed-tensors":
        raise _refuse("quant_method", method, "only 'compressed-tensors' or 'fp8'")
    fmt = d.get("format")
    if fmt != "pack-quantized":
        raise _refuse("format", fmt, "only 'pack-quantized'")
    status = d.get("quantization_status", "compressed")
    if status not in ("compressed", None):
        raise _refuse("quantization_status", status, "weights must be stored compressed")
    for name in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if d.get(name):
            raise _refuse(name, d.get(name))
    groups = d.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "need at least one group")
    group_size: int | None = None
    targets: list[str] = []
    for gname, group in groups.items():
        path = f"config_groups.{gname}"
        if not isinstance(group, Mapping):
            raise _refuse(path, group)
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                raise _refuse(f"{path}.{act}", group.get(act), "weight-only (W4A16) schemes only")
        gfmt = group.get("format")
        if gfmt not in (None, "pack-quantized"):
            raise _refuse(f"{path}.format", gfmt, "only 'pack-quantized'")
        g = _check_weights(f"{path}.weights", group.get("weights"))
        if group_size is not None and g != group_size:
            raise _refuse(f"{path}.weights.group_size", g, f"groups disagree ({group_size} elsewhere)")
        group_size = g
        t = group.get("targets")
        if not isinstance(t, (list, tuple)) or not t or not all(isinstance(x, str) for x in t):
            raise _refuse(f"{path}.targets", t, "need a list of module names / class names")
        bad = [x for x in t if not x.startswith("re:") and x[:1].isupper() and x != "Linear"]
        if bad:
            raise _refuse(f"{path}.targets", bad[0], "the only class target understood is 'Linear'")
        targets.extend(t)
    ignore = d.get("ignore") or []
    if not isinstance(ignore, (list, tuple)) or not all(isinstance(x, str) for x in ignore):
        raise _refuse("ignore", ignore, "need a list of strings")
    for pat in ignore:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as e:
                raise _refuse("ignore", pat, f"bad regex: {e}") from None
    assert group_size is not None
    return QuantScheme(group_size=group_size, targets=tuple(dict.fromkeys(targets)), ignore=tuple(ignore))


# ---- FP8 block format (fp8.py) ---------------------------------------------------------------------

FP8_FIELDS = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers",
                        "modules_to_not_convert", "dequantize"})


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 block-quantized linears (fp8.py): every linear but ``lm_head`` and the ``ignore`` list.

    ``group_size`` is the :class:`Fp8Block` the model's Linear / Experts take in place of an INT4 group
    (model/target.py ``group_of``); ``ignore`` entries match a module name exactly, as a ``re:`` regex, or
    as a prefix of it (``model.layers.3`` keeps that whole layer in BF16, as transformers' list does).
    """

    block: Fp8Block
    ignore: tuple[str, ...] = ()

    @property
    def group_size(self) -> Fp8Block:
        return self.block

    def keeping_dense(self, modules: tuple[str, ...]) -> "Fp8Scheme":
        """This scheme with ``modules`` (names matched exactly) unquantized too: the linears a checkpoint stores
        without a scale (weights.unscaled_linears)."""
        return Fp8Scheme(block=self.block, ignore=tuple(dict.fromkeys(self.ignore + modules)))

    def is_quantized(self, module_name: str) -> bool:
        names = module_name_variants(module_name)
        if any(strip_module_prefix(n) == "lm_head" for n in names):
            return False
        for pat in self.ignore:
            for n in names:
                if _matches(n, pat, linear=True) or (not pat.startswith("re:") and n.startswith(pat + ".")):
                    return False
        return True


def parse_fp8_config(d: Mapping[str, Any]) -> Fp8Scheme:
    """``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}``
    (plus an optional ``ignored_layers`` / ``modules_to_not_convert`` list) -> :class:`Fp8Scheme`; every other
    value or field raises :class:`QuantError` naming it."""
    unknown = sorted(set(d) - FP8_FIELDS)
    if unknown:
        raise _refuse(unknown[0], d[unknown[0]], "not a field of the fp8 block format that quant_method 'fp8' names")
    if d.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", d.get("fmt"), "only 'e4m3' (float8_e4m3fn weights)")
    if d.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", d.get("activation_scheme"),
                      "only 'dynamic' (static activation scales are not read)")
    if d.get("dequantize", False) not in (False, None):
        raise _refuse("dequantize", d.get("dequantize"), "the checkpoint must hold the FP8 weights")
    blk = d.get("weight_block_size")
    if (not isinstance(blk, (list, tuple)) or len(blk) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in blk)):
        raise _refuse("weight_block_size", blk, "need two positive integers [rows, columns]")
    if any(v % 16 for v in blk):
        raise _refuse("weight_block_size", list(blk), "each side must be a multiple of 16 (the kernels' tiles)")
    ignore: list[str] = []
    for field in ("ignored_layers", "modules_to_not_convert"):
        lst = d.get(field) or []
        if not isinstance(lst, (list, tuple)) or not all(isinstance(x, str) for x in lst):
            raise _refuse(field, lst, "need a list of module names")
        for pat in lst:
            if pat.startswith("re:"):
                try:
                    re.compile(pat[3:])
                except re.error as e:
                    raise _refuse(field, pat, f"bad regex: {e}") from None
        ignore.extend(lst)
    return Fp8Scheme(block=Fp8Block(int(blk[0]), int(blk[1])), ignore=tuple(dict.fromkeys(ignore)))


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """The ``quantization_config`` of the DeepSeek-V3 / Kimi-K2-Instruct FP8 releases."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block)}


def k2_quantization_config(group_size: int = 32) -> dict[str, Any]:
    """The K2-Thinking-style ``quantization_config``: routed experts INT4 (symmetric, group g)."""
    if group_size not in GROUP_SIZES:
        raise QuantError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": group_size, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            },
        },
        "kv_cache_scheme": None,
        "ignore": list(EXPERT_ONLY_IGNORE),
    }
