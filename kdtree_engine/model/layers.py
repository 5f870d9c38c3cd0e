"""Building blocks: RMSNorm, YaRN rope (interleaved pairs), Linear and the one ``linear()`` dispatch.

Every matrix product of a weight in the model goes through :func:`linear`; the kernel is chosen
there from the weight's format (dense / W4A16) and the device, never in model code.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import nn

from ..config import ModelConfig, yarn_mscale
from ..fp8 import FP8_DTYPE, SCALE_DTYPE, Fp8Block, dequantize_fp8
from ..kernels.common import take_rows
from ..kernels.dispatch import add_rms_norm, dense_matmul, int4_prepare, rms_norm, silu_mul, w4a16_matmul, w8a16_matmul
from ..kernels.policy import KernelPolicy, policy_or_env
from ..kernels.layouts import frag_unsupported
from ..logs import log_once
from ..quant import dequantize
from .int4_order import checkpoint_int4

Parallel = Literal["column", "row", "replicated"]
# leaf module name -> INT4 group size, the FP8 block (fp8.py), or None for dense
GroupOf = Callable[[str], "int | Fp8Block | None"]


def dense_only(_: str) -> None:
    return None


class RMSNorm(nn.Module):
    """``policy``: the model's kernel policy (None: the environment's, kernels/policy.py policy_or_env)."""

    def __init__(self, dim: int, eps: float, *, policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.policy = policy_or_env(policy)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.policy, x, self.weight, self.eps)

    def residual(self, h: torch.Tensor, d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = h + d, the residual add and this norm in one dispatch (one launch on
        CUDA); d None: (h, norm(h))."""
        if d is None:
            return h, self(h)
        return add_rms_norm(self.policy, h, d, self.weight, self.eps)


class Linear(nn.Module):
    """A weight of shape [out, in]: dense ``weight``, INT4 ``weight_packed`` + ``weight_scale``, or FP8
    ``weight`` (float8_e4m3fn) + ``weight_scale_inv`` (float32 per block; ``group_size`` an :class:`Fp8Block`).

    ``parallel`` records how the weight is split under tensor parallelism (column: by output, row: by input);
    a tensor-parallel model builds each rank's Linear at its local size (parallel/shard.py cuts the checkpoint
    to it). ``policy``: the model's kernel policy (None: the environment's).
    """

    def __init__(self, in_features: int, out_features: int, *, parallel: Parallel = "replicated",
                 group_size: int | Fp8Block | None = None, dtype: torch.dtype = torch.float32,
                 policy: KernelPolicy | None = None) -> None:
        super().__init__()
        self.policy = policy_or_env(policy)
        self.in_features = in_features
        self.out_features = out_features
        self.parallel = parallel
        self.fp8_block = group_size if isinstance(group_size, Fp8Block) else None
        self.group_size = None if self.fp8_block is not None else group_size
        if self.fp8_block is not None:
            self.dense_dtype = dtype   # of the dequantized weight (dense_weight)
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
            self.register_buffer("weight_scale_inv", torch.ones(
                self.fp8_block.scale_shape(out_features, in_features), dtype=SCALE_DTYPE))
        elif group_size is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        else:
            if in_features % group_size or in_features % 8:
                raise ValueError(f"in_features {in_features} is not a multiple of group size {group_size}")
            self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 8, dtype=torch.int32))
            self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group_size, dtype=dtype))

    @property
    def quantized(self) -> bool:
        return self.group_size is not None or self.fp8_block is not None

    @property
    def device(self) -> torch.device:
        """Where the weight lives (without dequantizing it)."""
        return (self.weight if self.group_size is None else self.weight_packed).device

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (dequantized if INT4 or FP8; FP8 to the model dtype)."""
        if self.fp8_block is not None:
            return dequantize_fp8(self.weight, self.weight_scale_inv, self.fp8_block, self.dense_dtype)
        if self.group_size is None:
            return self.weight
        return dequantize(*checkpoint_int4(self, "weight_packed"), self.group_size)

    def int4_prepare(self, dtype: torch.dtype) -> str:
        """The INT4 kernel family for activations of `dtype`, the words in its order (model/int4_order.py)."""
        return int4_prepare(self.policy, self, dtype, f"linear [{self.out_features} x {self.in_features}]",
                       frag_unsupported(self.out_features, self.in_features, self.group_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)

    def extra_repr(self) -> str:
        fmt = (str(self.fp8_block) if self.fp8_block is not None else "dense" if self.group_size is None
               else f"w4a16 g{self.group_size}")
        return f"{self.in_features} -> {self.out_features}, {fmt}, {self.parallel}"


def linear(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """The single dispatch point for weight matmuls. x: [..., in] -> [..., out]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if layer.fp8_block is not None:
        out = w8a16_matmul(layer.policy, x2, layer.weight, layer.weight_scale_inv, layer.fp8_block)
    elif layer.group_size is None:
        out = dense_matmul(layer.policy, x2, layer.weight)
    else:
        out = w4a16_matmul(layer.policy, x2, layer)
    return out.reshape(*shape[:-1], layer.out_features)


def stacked_weights(owner: nn.Module) -> list[torch.Tensor]:
    """The weights of the stacked linears cached on ``owner`` (by :func:`stacked_linear`): tensors a captured
    graph reads that a reload may replace."""
    return [lin.weight for lin in owner.__dict__.values() if isinstance(lin, Linear)]


def stacked_linear(owner: nn.Module, key: str, parts: tuple[Linear, ...]) -> Linear | None:
    """Dense linears over the same input as one Linear (one GEMM): its weight is the parts' weights
    stacked by rows, and the parts' own weights become views of its row blocks (no second copy; a load
    into a part lands in the stack). Built on first use and kept on ``owner`` under ``key``; rebuilt when
    a part's weight no longer aliases it (moved or replaced). None when a part is INT4 or the parts
    differ in dtype, device or input width, or when autograd wants the parts' own weights (training):
    the caller then runs them one by one."""
    if any(p.quantized for p in parts):
        return None
    if torch.is_grad_enabled() and any(p.weight.requires_grad for p in parts):
        return None
    w0 = parts[0].weight
    if any(p.weight.dtype != w0.dtype or p.weight.device != w0.device or p.in_features != parts[0].in_features
           for p in parts):
        return None
    lin = owner.__dict__.get(key)
    if lin is None or not _aliases(lin, parts):
        with torch.no_grad():
            w = torch.cat([p.weight for p in parts])  # [sum out, in]
            with torch.device("meta"):
                lin = Linear(parts[0].in_features, w.shape[0], parallel=parts[0].parallel, dtype=w.dtype,
                             policy=parts[0].policy)
            lin.weight = nn.Parameter(w, requires_grad=False)
            row = 0
            for p in parts:
                p.weight.data = w[row:row + p.out_features]
                row += p.out_features
        owner.__dict__[key] = lin
        log_once(f"stacked:{key}", f"dense linears stacked into one GEMM ({key}: "
                 f"{' + '.join(str(p.out_features) for p in parts)} rows)")
    return lin


def _aliases(lin: Linear, parts: tuple[Linear, ...]) -> bool:
    w = lin.weight
    row = 0
    for p in parts:
        pw = p.weight
        if pw.device != w.device or pw.data_ptr() != w[row:row + p.out_features].data_ptr() or pw.stride() != w.stride():
            return False
        row += p.out_features
    return row == w.shape[0]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Used by dense layers and the shared expert; dense gate and up
    run as one GEMM (:func:`stacked_linear`). ``parts`` > 1: this rank's share of a tensor-parallel MLP (inter /
    parts of the intermediate width; the output is a partial sum over the ranks)."""

    def __init__(self, hidden: int, inter: int, *, dtype: torch.dtype, group_of: GroupOf = dense_only,
                 policy: KernelPolicy | None = None, parts: int = 1) -> None:
        super().__init__()
        self.policy = policy = policy_or_env(policy)
        inter //= parts
        self.gate_proj = Linear(hidden, inter, parallel="column", group_size=group_of("gate_proj"), dtype=dtype,
                                policy=policy)
        self.up_proj = Linear(hidden, inter, parallel="column", group_size=group_of("up_proj"), dtype=dtype,
                              policy=policy)
        self.down_proj = Linear(inter, hidden, parallel="row", group_size=group_of("down_proj"), dtype=dtype,
                                policy=policy)

    def derived_weights(self) -> list[torch.Tensor]:
        """Tensors derived from the weights and cached (see :func:`stacked_weights`)."""
        return stacked_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = stacked_linear(self, "_gate_up", (self.gate_proj, self.up_proj))
        if gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = gate_up(x).chunk(2, dim=-1)
        return self.down_proj(silu_mul(self.policy, gate, up))


# ---- rope ------------------------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [R/2] (float64, on the CPU) for the rope dims, with YaRN when configured."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))  # [R/2]
    y = cfg.rope_scaling
    if y is None:
        return inv

    def corr(rot: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr(y.beta_fast)), 0)
    hi = min(math.ceil(corr(y.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - lo) / (hi - lo)).clamp(0, 1)  # [R/2]
    # ramp 0 -> keep the original frequency (extrapolation), 1 -> divide by factor (interpolation)
    return inv * (1 - ramp) + (inv / y.factor) * ramp


def rope_multiplier(cfg: ModelConfig) -> float:
    y = cfg.rope_scaling
    if y is None:
        return 1.0
    return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim or 0.0)


class Rope(nn.Module):
    """cos/sin tables [P, R/2] (float32) for positions 0..P-1; grown on demand.

    Always computed in float64 on the CPU, then moved: a position's cos/sin are the same bits whether
    the table was built at load or regrown later (a verify step may reach a position first), and on
    every device."""

    def __init__(self, cfg: ModelConfig, max_positions: int = 4096) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg)
        self.mult = rope_multiplier(cfg)
        self.limit = cfg.max_position_embeddings
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(min(max_positions, self.limit))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float64, device="cpu")
        freqs = torch.outer(t, self.inv_freq)  # [P, R/2]
        dev = self.cos.device
        self.cos = (freqs.cos() * self.mult).float().to(dev)
        self.sin = (freqs.sin() * self.mult).float().to(dev)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Grows the table only when a longer position is asked for (host read is for growth only).
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions], self.sin[positions]  # [T, R/2] each

    def ensure(self, n: int) -> None:
        """Grow the tables to cover positions 0..n-1 now (before a step that must not read the host)."""
        if n > self.cos.shape[0]:
            self._build(max(n, 2 * self.cos.shape[0]))

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, R/2] at device positions, no host read: the caller has called :meth:`ensure`."""
        return take_rows(self.cos, positions), take_rows(self.sin, positions)
