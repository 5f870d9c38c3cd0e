"""Which part of each weight a rank holds, and refusing a model whose sizes do not divide by the rank count.

Layout over N ranks (rank r): attention heads split (q_proj / q_b_proj and kv_b_proj by output rows, o_proj by
input columns); routed experts split whole (rank r owns experts [r*E/N, (r+1)*E/N)); the dense MLPs and the shared
experts like an MLP (gate / up by rows, down by columns); the embedding and lm_head by vocabulary rows; everything
else (q_a, kv_a, norms, router) on every rank. A rank's module is built at its local size (model code), so the
slice of a checkpoint tensor follows from the local and the full shape: the one dimension that differs is cut
at ``rank * local``. INT4 ``weight_packed`` [N, K/8] and ``weight_scale`` [N, K/g] follow the same rule, each at
its own granularity, which is consistent because the local input width is a whole number of groups
(:func:`check_divisible`).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch

from ..config import ModelConfig
from ..errors import LoadError
from ..fp8 import Fp8Block

EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.")
WHOLE: tuple[slice, ...] = ()
# (canonical name, full shape) -> the index of this rank's part, or None when the rank does not hold it
IndexFn = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


def part(n: int, world: int, what: str, tensor: str) -> int:
    """n / world, or a LoadError naming the tensor and the size that does not divide."""
    if n % world:
        raise LoadError(f"tensor '{tensor}': {what} {n} does not divide by tp={world}")
    return n // world


def check_divisible(cfg: ModelConfig, world: int, group_size_of: "dict[str, int | Fp8Block | None] | None" = None
                    ) -> None:
    """Refuse, before anything is read, a model whose split sizes do not divide by ``world``; the message names
    the first tensor that cannot be cut. ``group_size_of``: the quantization of the split linears by canonical module
    name (:func:`split_widths`): an INT4 group size (a row-parallel slice must be a whole number of groups and of
    8-value words), an FP8 block (a slice must be a whole number of blocks in the dimension cut, so each rank's
    block scales are whole rows or columns of the checkpoint's) or None (dense)."""
    if world == 1:
        return
    part(cfg.vocab_size, world, "vocab_size", "embed_tokens.weight")
    q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    part(cfg.num_attention_heads, world, "num_attention_heads", f"layers.0.self_attn.{q}.weight")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if moe:
        part(cfg.n_routed_experts, world, "n_routed_experts", f"layers.{moe[0]}.mlp.experts")
        if cfg.n_shared_experts:
            part(cfg.moe_intermediate_size * cfg.n_shared_experts, world,
                 "moe_intermediate_size * n_shared_experts", f"layers.{moe[0]}.mlp.shared_experts.gate_proj.weight")
    if dense:
        part(cfg.intermediate_size, world, "intermediate_size", f"layers.{dense[0]}.mlp.gate_proj.weight")
    widths = split_widths(cfg)
    for name, g in (group_size_of or {}).items():
        if g is None:
            continue
        kind, width = widths[name]
        if isinstance(g, Fp8Block):
            local, block = width // world, g.k if kind == "row" else g.n
            if local % block:
                cut = "input width" if kind == "row" else "output rows"
                raise LoadError(f"tensor '{name}.weight_scale_inv': its {local}-wide slice per rank ({cut} {width} / "
                                f"tp={world}) is not a whole number of FP8 blocks of {block}")
        elif kind == "row":
            local = part(width, world, "input width", name + ".weight_packed")
            if local % g or local % 8:
                raise LoadError(f"tensor '{name}.weight_packed': its {local}-wide slice per rank (input width {width} "
                                f"/ tp={world}) is not a whole number of INT4 groups of {g} (row-parallel INT4 is cut "
                                "on group boundaries)")


def split_widths(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Every linear split over the ranks (the routed experts aside: they are divided whole), by canonical module
    name: ("row", its full input width) or ("column", its full output rows)."""
    heads = cfg.num_attention_heads
    out: dict[str, tuple[str, int]] = {}
    for i in range(cfg.num_hidden_layers):
        a = f"layers.{i}.self_attn"
        q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
        out[f"{a}.{q}"] = ("column", heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
        out[f"{a}.kv_b_proj"] = ("column", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        out[f"{a}.o_proj"] = ("row", heads * cfg.v_head_dim)
        if cfg.is_moe_layer(i):
            if not cfg.n_shared_experts:
                continue
            mlp, inter = f"layers.{i}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts
        else:
            mlp, inter = f"layers.{i}.mlp", cfg.intermediate_size
        out[f"{mlp}.gate_proj"] = out[f"{mlp}.up_proj"] = ("column", inter)
        out[f"{mlp}.down_proj"] = ("row", inter)
    return out


def expert_range(n_experts: int, rank: int, world: int) -> range:
    """The global ids of the routed experts rank ``rank`` owns."""
    per = n_experts // world
    return range(rank * per, (rank + 1) * per)


def expert_of(name: str) -> int | None:
    """The global expert id of a routed-expert tensor name, None for any other tensor."""
    m = EXPERT.match(name)
    return None if m is None else int(m.group(2))


def index_for(name: str, local: tuple[int, ...], full: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """The index of this rank's part of a tensor of shape ``full`` whose local shape is ``local``."""
    if len(local) != len(full):
        raise LoadError(f"tensor '{name}': expected {len(local)} dimensions, found shape {tuple(full)}")
    cut = [d for d, (a, b) in enumerate(zip(local, full)) if a != b]
    if not cut:
        return WHOLE
    d = cut[0]
    if len(cut) > 1 or full[d] % local[d]:
        raise LoadError(f"tensor '{name}': shape {tuple(full)} is not a whole number of this rank's "
                        f"{tuple(local)}")
    return (slice(None),) * d + (slice(rank * local[d], (rank + 1) * local[d]),)


def sliced_shape(shape: tuple[int, ...], idx: tuple[slice, ...]) -> tuple[int, ...]:
    """The shape of ``tensor[idx]`` for a tensor of ``shape`` (idx: slices with unit steps)."""
    return tuple(len(range(*idx[d].indices(n))) if d < len(idx) else n for d, n in enumerate(shape))


def owned_slices(items: Iterable[tuple[str, torch.Tensor]], index: IndexFn) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) of full tensors; tensors this rank does not hold are not yielded."""
    for name, t in items:
        idx = index(name, tuple(t.shape))
        if idx is not None:
            yield name, t[idx]

