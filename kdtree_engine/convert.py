"""``kdtree quantize``: a BF16 / FP16 or FP8 block-quantized checkpoint -> a compressed-tensors INT4 one.

The output is the K2-Thinking release layout: the routed experts W4A16 (symmetric round-to-nearest, group g,
quant.py ``quantize``: ``weight_packed`` int32, ``weight_scale`` bf16, ``weight_shape``), everything else
dense as the source has it (FP8 linears dequantized to bfloat16, fp8.py), the config's
``quantization_config`` replaced by :func:`quant.k2_quantization_config`. The engine loads it, and so does
transformers with compressed-tensors.

Streaming: tensors are read one at a time (after the loader's strict header check) and written in shards of
about ``shard_bytes``; shards are written under temporary names and renamed, config.json last, so a config
beside the weights means they are complete.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .config import ModelConfig
from .errors import BadInput, QuantError
from .fp8 import dequantized_stream
from .quant import Fp8Scheme, QuantScheme, k2_quantization_config, parse_quantization_config, quantize
from .weights import (INDEX_FILE, checkpoint_scheme, config_dict, expected_tensors, iter_checkpoint, linear_modules,
                      raw_name)

SHARD_BYTES = 4 << 30
SCALE_DTYPE = torch.bfloat16   # the INT4 releases' scale dtype


def int4_stream(src: Path, cfg: ModelConfig, group_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The output tensors (canonical names) of the INT4 checkpoint made from ``src``, one at a time."""
    scheme = checkpoint_scheme(src, cfg)
    if isinstance(scheme, QuantScheme):
        raise QuantError(f"{src}: the checkpoint is already INT4 (compressed-tensors); nothing to quantize")
    stream = iter_checkpoint(src, cfg, progress=False, scheme=scheme)
    if isinstance(scheme, Fp8Scheme):
        stream = dequantized_stream(stream, scheme.block, torch.bfloat16)
    int4 = parse_quantization_config(k2_quantization_config(group_size))
    linears = {m for m, _, _ in linear_modules(cfg)}
    for name, t in stream:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module not in linears or not int4.is_quantized(module):
            yield name, t
            continue
        packed, scale = quantize(t.float(), group_size, dtype=SCALE_DTYPE)
        yield module + ".weight_packed", packed
        yield module + ".weight_scale", scale
        yield module + ".weight_shape", torch.tensor(list(t.shape), dtype=torch.int32)


def output_bytes(cfg: ModelConfig, group_size: int) -> int:
    """About the bytes the INT4 checkpoint holds (dense tensors counted as bf16), for the progress bar."""
    scheme = parse_quantization_config(k2_quantization_config(group_size))
    total = 0
    for name, spec in expected_tensors(cfg, scheme).items():
        n = 1
        for s in spec.shape:
            n *= s
        total += n * (4 if name.endswith((".weight_packed", ".weight_shape")) else 2)
    return total


def quantize_checkpoint(src: str | Path, out: str | Path, *, group_size: int = 32, progress: bool = True,
                        shard_bytes: int = SHARD_BYTES) -> Path:
    """Writes the INT4 checkpoint of ``src`` to ``out`` (a new or empty directory); returns ``out``."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"model directory {str(src)!r} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--out {out} exists and is not an empty directory")
    if src.resolve() == out.resolve():
        raise BadInput("--out must differ from --model")
    cfg = ModelConfig.from_pretrained(src)
    out_cfg = cfg.replace(quantization=k2_quantization_config(group_size))
    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=output_bytes(cfg, group_size), unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=not progress, desc="writing INT4 checkpoint", dynamic_ncols=True)
    temps: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        fd, tmp = tempfile.mkstemp(prefix=".shard.", suffix=".tmp", dir=out)
        os.close(fd)
        save_file(shard, tmp, metadata={"format": "pt"})
        temps.append((Path(tmp), list(shard)))
        shard, size = {}, 0

    try:
        for name, t in int4_stream(src, cfg, group_size):
            t = t.contiguous()
            if shard and size + t.nbytes > shard_bytes:
                flush()
            shard[raw_name(name)] = t
            size += t.nbytes
            bar.update(t.nbytes)
        if shard:
            flush()
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    wmap: dict[str, str] = {}
    for i, (tmp, names) in enumerate(temps):
        fname = f"model-{i + 1:05d}-of-{len(temps):05d}.safetensors"
        os.replace(tmp, out / fname)
        wmap.update({n: fname for n in names})
    total = sum((out / f).stat().st_size for f in set(wmap.values()))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))
    (out / "config.json").write_text(json.dumps(config_dict(out_cfg), indent=2))
    return out
