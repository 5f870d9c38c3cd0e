"""W4A16 format: packing against compressed-tensors, quantize bounds, quantization_config parsing."""

from __future__ import annotations

import copy

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

from kdtree_engine.config import preset
from kdtree_engine.quant import (
    EXPERT_ONLY_IGNORE, QuantError, QuantScheme, dequantize, k2_quantization_config, module_name_variants,
    pack_int4, parse_quantization_config, quantize, unpack_int4,
)
from kdtree_engine.weights import linear_modules

SHAPES = [(1, 32), (3, 64), (7, 96), (5, 384), (13, 128)]  # odd N; K a multiple of 32
GROUPS = [32, 64, 128]


def _ct_args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


def _cases() -> list[tuple[int, tuple[int, int], int]]:
    return [(seed, s, g) for seed in (0, 1) for s in SHAPES for g in GROUPS if s[1] % g == 0]


# ---- bit layout against compressed-tensors -----------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 8), (3, 40), (7, 264), (2, 5, 16)])
def test_pack_matches_compressed_tensors(seed: int, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = pack_int4(q)
    theirs = pack_to_int32(q, 4)
    assert ours.dtype == torch.int32 and ours.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int4(theirs), q)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size(shape)), q)


@pytest.mark.parametrize("seed,shape,group_size", _cases())
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_matches_compressed_tensors(seed: int, shape: tuple[int, int], group_size: int,
                                               scale_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)  # [N, K]
    scale = (0.001 + torch.rand(n, k // group_size, generator=g)).to(scale_dtype)  # [N, K/g]
    packed = pack_to_int32(q, 4)  # [N, K/8]
    ref = ct_dequantize(q, scale, args=_ct_args(group_size))
    assert torch.equal(dequantize(packed, scale, group_size), ref)
    # The compressor's own decompress path (unpack + dequantize) agrees too.
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(group_size))
    sd = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    assert torch.equal(dequantize(packed, scale, group_size), PackedQuantizationCompressor.decompress(sd, scheme)["weight"])


@pytest.mark.parametrize("seed,shape,group_size", _cases())
def test_quantize_matches_compressed_tensors_compress(seed: int, shape: tuple[int, int], group_size: int) -> None:
    """Given our scales, compressed-tensors' compressor produces the same packed bytes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    packed, scale = quantize(w, group_size, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(group_size))
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(out["weight_packed"], packed)
    assert out["weight_shape"].tolist() == list(shape)


# ---- quantize ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,shape,group_size", _cases())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_round_trip_bound(seed: int, shape: tuple[int, int], group_size: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    w = torch.randn(shape, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different magnitude
    packed, scale = quantize(w, group_size, dtype=dtype)
    assert packed.shape == (n, k // 8) and packed.dtype == torch.int32
    assert scale.shape == (n, k // group_size) and scale.dtype == dtype
    deq = dequantize(packed, scale, group_size, dtype=torch.float32)  # [N, K]
    s = scale.float().repeat_interleave(group_size, dim=-1)
    err = (w - deq).abs()
    assert bool((err <= s / 2 * (1 + 1e-6) + 1e-12).all()), float((err / s).max())
    q = unpack_int4(packed)
    assert int(q.min()) >= -7 and int(q.max()) <= 7  # scale = absmax / 7 never needs -8


def test_quantize_zero_group_and_leading_dims() -> None:
    w = torch.zeros(2, 3, 64)
    w[0, 1, 32:] = torch.linspace(-1, 1, 32)
    packed, scale = quantize(w, 32)
    assert packed.shape == (2, 3, 8) and scale.shape == (2, 3, 2)
    assert float(scale[1].abs().max()) == 0.0
    deq = dequantize(packed, scale, 32, dtype=torch.float32)
    assert float(deq[1].abs().max()) == 0.0
    assert torch.allclose(deq[0, 1, 32:], w[0, 1, 32:], atol=float(scale[0, 1, 1]) / 2 + 1e-6)


def test_pack_int4_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="range|lie in"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(1, 12, dtype=torch.int8))
    with pytest.raises(TypeError):
        pack_int4(torch.zeros(1, 8))
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.zeros(2, 40), 12)
    with pytest.raises(ValueError, match="K=40"):
        quantize(torch.zeros(2, 40), 32)


# ---- quantization_config -----------------------------------------------------------------------

def test_parse_k2_thinking_config() -> None:
    s = parse_quantization_config(k2_quantization_config())
    assert isinstance(s, QuantScheme)
    assert s.group_size == 32 and s.num_bits == 4
    assert s.ignore == EXPERT_ONLY_IGNORE
    assert parse_quantization_config(None) is None
    for g in (64, 128):
        assert parse_quantization_config(k2_quantization_config(g)).group_size == g
    with pytest.raises(QuantError, match="group_size"):
        k2_quantization_config(16)


def _variant(path: str, value: object) -> dict:
    d = copy.deepcopy(k2_quantization_config())
    node = d
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return d


W = "config_groups.group_0.weights"
G = "config_groups.group_0"
REFUSED = [
    ("quant_method", "fp8"),
    ("quant_method", "gptq"),
    ("format", "int-quantized"),
    ("format", "naive-quantized"),
    ("quantization_status", "frozen"),
    (f"{W}.num_bits", 8),
    (f"{W}.type", "float"),
    (f"{W}.symmetric", False),
    (f"{W}.strategy", "channel"),
    (f"{W}.strategy", "tensor"),
    (f"{W}.group_size", 16),
    (f"{W}.group_size", 256),
    (f"{W}.actorder", "static"),
    (f"{W}.actorder", "group"),
    (f"{W}.actorder", True),
    (f"{W}.dynamic", True),
    (f"{G}.input_activations", {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    (f"{G}.output_activations", {"num_bits": 8, "type": "int"}),
    (f"{G}.targets", ["Embedding"]),
    (f"{G}.targets", []),
    (f"{G}.weights", None),
    ("config_groups", {}),
    ("kv_cache_scheme", {"num_bits": 8, "type": "float"}),
    ("ignore", ["re:(unclosed"]),
]


@pytest.mark.parametrize("path,value", REFUSED)
def test_parse_refuses_unsupported(path: str, value: object) -> None:
    field = path.rsplit(".", 1)[-1] if path.startswith("config_groups.") else path
    with pytest.raises(QuantError, match=field) as e:
        parse_quantization_config(_variant(path, value))
    assert path.split(".")[0] in str(e.value)


def test_parse_multiple_groups() -> None:
    d = k2_quantization_config()
    d["config_groups"]["group_1"] = copy.deepcopy(d["config_groups"]["group_0"])
    d["config_groups"]["group_1"]["targets"] = ["re:.*experts.*"]
    assert parse_quantization_config(d).targets == ("Linear", "re:.*experts.*")
    d["config_groups"]["group_1"]["weights"]["group_size"] = 64
    with pytest.raises(QuantError, match="group_1.weights.group_size"):
        parse_quantization_config(d)


# ---- which modules are INT4 --------------------------------------------------------------------

@pytest.mark.parametrize("first_dense", [0, 1, 2])
def test_expert_only_ignore_quantizes_routed_experts_only(first_dense: int) -> None:
    cfg = preset("k2-tiny").replace(first_k_dense_replace=first_dense)
    s = parse_quantization_config(k2_quantization_config())
    for module, _, _ in linear_modules(cfg):
        for spelled in module_name_variants(module):
            assert s.is_quantized(spelled) == (".experts." in module), spelled


def test_ignore_matches_with_and_without_prefix() -> None:
    d = k2_quantization_config()
    d["ignore"] = ["language_model.lm_head", "model.layers.1.mlp.experts.0.up_proj",
                   "layers.2.mlp.experts.1.down_proj", r"re:language_model\.model\.layers\.3\..*"]
    s = parse_quantization_config(d)
    assert not s.is_quantized("lm_head")
    assert not s.is_quantized("layers.1.mlp.experts.0.up_proj")
    assert not s.is_quantized("language_model.model.layers.1.mlp.experts.0.up_proj")
    assert not s.is_quantized("model.layers.2.mlp.experts.1.down_proj")
    assert not s.is_quantized("layers.3.self_attn.o_proj")
    assert s.is_quantized("layers.1.mlp.experts.0.gate_proj")
    assert s.is_quantized("model.layers.2.self_attn.o_proj")
    d["config_groups"]["group_0"]["targets"] = [r"re:.*experts\.0\..*"]
    s = parse_quantization_config(d)
    assert s.is_quantized("layers.2.mlp.experts.0.gate_proj")
    assert not s.is_quantized("layers.2.mlp.experts.1.gate_proj")
