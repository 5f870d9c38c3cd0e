"""The K2 target: embed -> decoder layers (MLA + dense MLP / MoE) -> final norm -> lm_head.

Parameter names follow the Hugging Face checkpoint without its ``model.`` prefix, except routed
experts, which are stacked per layer (see moe.py). Aux hidden states: id L is the output of decoder
layer L (HF ``hidden_states[L + 1]``; index 0 there is the embedding output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable, Protocol, Sequence

import torch
from torch import nn

from ..errors import LoadError
from ..fp8 import Fp8Block
from ..cache import BLOCK, CachePool, LatentCache
from ..config import ModelConfig
from ..kernels.common import take_rows
from ..kernels.paged import page_rows
from ..kernels.dispatch import attention_gather_index, prefill_kernel_on
from .context import BatchContext, StepContext, static_visibility
from ..kernels.policy import KernelPolicy, policy_or_env
from ..parallel.comm import SINGLE, Communicator, tp_sum
from ..parallel.shard import (WHOLE, check_divisible, expert_of, expert_range, index_for, owned_slices,
                              split_widths)
from ..parallel.vocab import VocabShard, vocab_embed
from ..quant import quantize
from ..reference import random_weights
from .int4_order import CHECKPOINT, set_order
from .layers import MLP, GroupOf, Linear, RMSNorm, Rope
from .mla import MLA
from .moe import MoE
from .prompt_graph import PromptGraphs
from .prefill import (KEY_BLOCK, ChunkStep, PrefillOutput, choose_form, plan_chunks, resolve_chunk,
                      transient_bytes)

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_packed|weight_scale|weight_scale_inv)$")


class QuantPolicy(Protocol):
    """Which linears are INT4 (by canonical module name, e.g. ``layers.1.mlp.experts.0.gate_proj``)."""

    group_size: int

    def is_quantized(self, module_name: str) -> bool: ...



def split_groups(cfg: ModelConfig, quant: QuantPolicy | None) -> dict[str, int | Fp8Block | None]:
    """The quantization (INT4 group size, FP8 block, None: dense) of every linear split over tensor-parallel ranks,
    by canonical module name (parallel/shard.py ``split_widths``)."""
    return {m: quant.group_size if quant is not None and quant.is_quantized(m) else None for m in split_widths(cfg)}


@dataclass(frozen=True)
class BatchPart:
    """One request's rows in a batched forward (:meth:`Target.forward_batch`): ``ids`` [T] after its cache's committed
    length, at ``positions`` (None: the slots), causal (``tree_mask`` None: committed by the forward) or a tree
    (pending until ``cache.commit``); ``chunk``: how a chunk of a long prompt attends (model/prefill.py);
    ``logits``: the rows whose logits are computed ("all", "last" or "none"); ``start``: a device-resident step's
    committed length ([] long on the device; positions and tree_mask required, as for :meth:`Target.forward`)."""

    ids: torch.Tensor
    cache: LatentCache
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    chunk: ChunkStep | None = None
    logits: str = "all"
    start: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.logits not in ("all", "last", "none"):
            raise ValueError(f"BatchPart.logits must be 'all', 'last' or 'none', got {self.logits!r}")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T, V] float32
    aux: torch.Tensor | None  # [T, len(aux_layers) * H]


def group_of(quant: QuantPolicy | None, prefix: str) -> GroupOf:
    """Leaf name -> INT4 group size (or None) for the linears under module ``prefix``."""
    def g(leaf: str) -> int | None:
        name = f"{prefix}.{leaf}" if prefix else leaf
        return quant.group_size if quant is not None and quant.is_quantized(name) else None
    return g


class DecoderLayer(nn.Module):
    """``comm``: the tensor-parallel group (world size 1: the whole layer on one device, no collective)."""

    def __init__(self, cfg: ModelConfig, idx: int, *, dtype: torch.dtype, quant: QuantPolicy | None,
                 policy: KernelPolicy | None = None, comm: Communicator = SINGLE) -> None:
        super().__init__()
        self.policy = policy = policy_or_env(policy)
        self.comm = comm
        N = comm.world_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy=policy)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy=policy)
        self.self_attn = MLA(cfg, dtype=dtype, group_of=group_of(quant, f"layers.{idx}.self_attn"), policy=policy,
                             parts=N)
        if cfg.is_moe_layer(idx):
            experts = group_of(quant, f"layers.{idx}.mlp.experts.0")
            sizes = {experts(p) for p in ("gate_proj", "up_proj", "down_proj")}
            if len(sizes) != 1:
                raise LoadError(f"layer {idx}: routed experts must be all INT4 or all dense (gate/up/down differ)")
            self.routed = True
            self.mlp: nn.Module = MoE(cfg, dtype=dtype, group_size=sizes.pop(),
                                      shared_group_of=group_of(quant, f"layers.{idx}.mlp.shared_experts"),
                                      policy=policy, parts=N,
                                      owned=None if N == 1 else expert_range(cfg.n_routed_experts, comm.rank, N))
        else:
            self.routed = False
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                           group_of=group_of(quant, f"layers.{idx}.mlp"), policy=policy, parts=N)

    # The residual stream is carried as (h, pending): the MLP output of a layer is added by the next
    # layer's input norm (or the final norm), so every "add then norm" is one dispatch (one launch on CUDA).
    # Tensor parallel: attention and the MLP / MoE (routed + shared) each give a partial sum over the ranks, summed
    # before the norm that follows it (two sums a layer: a norm needs the whole stream, so they cannot merge).
    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, ctx: StepContext, kv: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] + pending [T, H] (None: nothing pending) -> (h_in, h, mlp_out): h_in = h + pending is the
        stream entering this layer (the previous layer's output), h = h_in + attention, mlp_out pending.
        kv: this layer's latent cache [S_cap, C+R]."""
        h_in, x = self.input_layernorm.residual(h, pending)
        h, x = self.post_attention_layernorm.residual(h_in, tp_sum(self.policy, self.comm, self.self_attn(x, ctx, kv)))
        out = self.mlp(x, host_reads=not ctx.device_resident) if self.routed else self.mlp(x)
        return h_in, h, tp_sum(self.policy, self.comm, out)


class Target(nn.Module):
    """``policy``: the kernel policy every layer runs with (None: the environment's, KernelPolicy.from_env).
    ``comm``: the tensor-parallel group this model is one rank of (parallel/; world size 1: the whole model, and
    ``vocab_shard`` None); at world size N the logits are this rank's vocabulary slice (``vocab_shard``)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quant: QuantPolicy | None = None, quantize_on_load: bool = False,
                 policy: KernelPolicy | None = None, comm: Communicator = SINGLE) -> None:
        super().__init__()
        N = comm.world_size
        if N > 1:
            check_divisible(cfg, N, split_groups(cfg, quant))
        self.comm = comm
        V = cfg.vocab_size // N
        self.vocab_shard = None if N == 1 else VocabShard(comm, comm.rank * V, V, cfg.vocab_size)
        self.cfg = cfg
        self.policy = policy = policy_or_env(policy)
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant = quant
        self.quantize_on_load = quantize_on_load
        with self.device:
            self.embed_tokens = nn.Embedding(V, cfg.hidden_size, dtype=dtype)
            self.embed_tokens.weight.requires_grad_(False)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype, quant=quant, policy=policy, comm=comm)
                                        for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy=policy)
            self.lm_head_proj = Linear(cfg.hidden_size, V, parallel="column", dtype=dtype,
                                       group_size=group_of(quant, "")("lm_head"), policy=policy)
            self.rope = Rope(cfg)
        # Norm weights follow the model dtype (HF multiplies in the activation dtype).
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(dtype)
                m.weight.requires_grad_(False)
        self._loaded: set[str] = set()
        self.cache_pool: CachePool | None = None  # made by init_cache_pool, or on the first new_cache
        # short prompts' forwards replayed per length bucket (model/prompt_graph.py; the engine sets it on CUDA)
        self.prompt_graphs: PromptGraphs | None = None

    # ---- weights ---------------------------------------------------------------------------
    def _slot(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight":
            return self.lm_head_proj.weight
        try:
            return self.get_parameter(name)
        except AttributeError:
            pass
        try:
            return self.get_buffer(name)
        except AttributeError:
            raise LoadError(f"tensor '{name}' does not belong to this model") from None

    def expected_names(self) -> set[str]:
        """Canonical checkpoint names this model needs (experts listed per expert)."""
        names: set[str] = set()
        skip = ("rope.", "w13", "w2")
        for n, _ in list(self.named_parameters()) + list(self.named_buffers()):
            if n.startswith("lm_head_proj.") and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding serves as lm_head
            if n.startswith("lm_head_proj."):
                names.add("lm_head." + n.split(".", 1)[1])
            elif not any(n.startswith(s) or f".experts.{s}" in n for s in skip):
                names.add(n)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoE):
                ex = layer.mlp.experts
                suffixes = (("weight", "weight_scale_inv") if ex.fp8_block is not None else
                            ("weight",) if ex.group_size is None else ("weight_packed", "weight_scale"))
                for e in self.owned_experts():
                    for p in ("gate", "up", "down"):
                        for s in suffixes:
                            names.add(f"layers.{i}.mlp.experts.{e}.{p}_proj.{s}")
        return names

    def owned_experts(self) -> range:
        """The global ids of the routed experts this rank holds (all of them at world size 1)."""
        return expert_range(self.cfg.n_routed_experts, self.comm.rank, self.comm.world_size)

    def shard_index(self, name: str, full: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The index of this rank's part of the checkpoint tensor ``name`` of shape ``full`` (parallel/shard.py),
        None when another rank holds it (a routed expert)."""
        if self.comm.world_size == 1:
            return WHOLE
        e = expert_of(name)
        if e is not None:
            return WHOLE if e in self.owned_experts() else None
        if name.endswith(".weight_shape"):
            return WHOLE
        return index_for(name, tuple(self._slot(name).shape), full, self.comm.rank)

    @torch.no_grad()
    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (canonical name) into place; shapes are checked."""
        m = _EXPERT.match(name)
        if m:
            self._load_expert(name, int(m.group(1)), int(m.group(2)), m.group(3), m.group(4), tensor)
        else:
            dst = self._slot(name)
            if name.endswith((".weight_packed", ".weight_scale")):   # words land in checkpoint order
                set_order(self.get_submodule(name.rsplit(".", 1)[0]), CHECKPOINT)
            self._copy(name, dst, tensor)
        self._loaded.add(name)

    def _load_expert(self, name: str, layer: int, e: int, proj: str, kind: str, tensor: torch.Tensor) -> None:
        if layer >= len(self.layers) or not isinstance(self.layers[layer].mlp, MoE):
            raise LoadError(f"tensor '{name}': layer {layer} has no routed experts")
        ex = self.layers[layer].mlp.experts
        if e >= self.cfg.n_routed_experts:
            raise LoadError(f"tensor '{name}': expert {e} >= n_routed_experts {self.cfg.n_routed_experts}")
        if ex.owned is not None:
            if e not in ex.owned:
                raise LoadError(f"tensor '{name}': expert {e} belongs to another rank ({self.comm.describe()} "
                                f"holds experts {ex.owned.start}..{ex.owned.stop - 1})")
            e -= ex.owned.start
        if ex.group_size is not None:
            set_order(ex, CHECKPOINT)   # words land in checkpoint order
        I = ex.inter
        rows = slice(0, I) if proj == "gate" else slice(I, 2 * I) if proj == "up" else slice(None)
        base = "w2" if proj == "down" else "w13"
        if kind == "weight_scale_inv":   # FP8 block scales: gate's row blocks, then up's (moe.py)
            if ex.fp8_block is None:
                raise LoadError(f"tensor '{name}': experts of layer {layer} are not FP8, found a block scale")
            half = ex.w13_scale_inv.shape[1] // 2
            blocks = slice(0, half) if proj == "gate" else slice(half, 2 * half) if proj == "up" else slice(None)
            self._copy(name, getattr(ex, f"{base}_scale_inv")[e, blocks], tensor)
            return
        if ex.group_size is None:
            if kind != "weight":
                raise LoadError(f"tensor '{name}': experts of layer {layer} are dense, found an INT4 tensor")
            self._copy(name, getattr(ex, base)[e, rows], tensor)
            return
        if kind == "weight":
            if not self.quantize_on_load:
                raise LoadError(f"tensor '{name}': experts of layer {layer} are INT4 (weight_packed/weight_scale), "
                                f"found a dense weight")
            packed, scale = quantize(tensor.to(self.device, torch.float32), ex.group_size, dtype=self.dtype)
            self._copy(name + "(packed)", getattr(ex, f"{base}_packed")[e, rows], packed)
            self._copy(name + "(scale)", getattr(ex, f"{base}_scale")[e, rows], scale)
            self._loaded.add(name.replace(".weight", ".weight_packed"))
            self._loaded.add(name.replace(".weight", ".weight_scale"))
            return
        suffix = "packed" if kind == "weight_packed" else "scale"
        self._copy(name, getattr(ex, f"{base}_{suffix}")[e, rows], tensor)

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise LoadError(f"tensor '{name}': expected shape {tuple(dst.shape)}, found {tuple(src.shape)}")
        if dst.dtype in (torch.int32, torch.float8_e4m3fn) and src.dtype != dst.dtype:
            raise LoadError(f"tensor '{name}': expected dtype {dst.dtype}, found {src.dtype}")
        dst.copy_(src)

    def finish_loading(self) -> None:
        """Check that every tensor arrived; prepare derived weights."""
        missing = sorted(self.expected_names() - self._loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise LoadError(f"missing tensors: {', '.join(missing[:5])}{more}")
        if self.cfg.tie_word_embeddings:
            if self.lm_head_proj.quantized:
                raise LoadError("tie_word_embeddings with an INT4 lm_head is not supported")
            self.lm_head_proj.weight = self.embed_tokens.weight
        for layer in self.layers:
            layer.self_attn.reset_absorbed()
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts.reset_dense()  # derived from the old weights
                layer.mlp.gate.reset_parts()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> "Target":
        """Full (unsharded) tensors; a tensor-parallel rank keeps its parts (:meth:`shard_index`)."""
        if self.comm.world_size > 1:
            tensors = owned_slices(tensors, self.shard_index)
        for name, t in tensors:
            self.load_tensor(name, t)
        self.finish_loading()
        return self

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", policy: KernelPolicy | None = None,
               comm: Communicator = SINGLE) -> "Target":
        """A target with the well-conditioned random weights of the numpy reference generator (``comm``: this
        rank's part of them)."""
        model = cls(cfg, dtype=dtype, device=device, policy=policy, comm=comm)
        return model.load_weights((k, torch.from_numpy(v)) for k, v in random_weights(cfg, seed).items())

    # ---- compute -----------------------------------------------------------------------------
    def init_cache_pool(self, tokens: int | None = None, fraction: float | None = None,
                        first_use: bool = False) -> CachePool:
        """The latent cache pool of every request on this target, made once after the weights: ``tokens`` slots,
        or ``fraction`` of the free device memory (see cache.pool_tokens); logged with the maximum context."""
        if self.cache_pool is not None:
            raise ValueError("this target's latent cache pool is already made")
        agree = None if self.comm.world_size == 1 else self._least_over_ranks
        self.cache_pool = CachePool.sized(self.cfg, dtype=self.dtype, device=self.device, tokens=tokens,
                                          fraction=fraction, first_use=first_use, agree=agree)
        return self.cache_pool

    def _least_over_ranks(self, n: int) -> int:
        return int(self.comm.all_gather(torch.tensor([n], device=self.device)).min())

    def pool(self) -> CachePool:
        """The cache pool (made on first use with the defaults for a target used without an LLM)."""
        return self.cache_pool if self.cache_pool is not None else self.init_cache_pool(first_use=True)

    def new_cache(self, max_tokens: int) -> LatentCache:
        """A request's cache of ``max_tokens`` slots from the pool (made with the defaults on first use); a
        PoolFullError when the pool has too few free blocks."""
        return LatentCache(self.pool(), max_tokens)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_shard is not None:  # each rank looks up its vocabulary slice, summed over the ranks
            return vocab_embed(self.policy, self.vocab_shard, self.embed_tokens.weight, ids)  # [T, H]
        # take_rows, not the module's index_select: a drafter block is up to 16 ids (kernels/common.py)
        return take_rows(self.embed_tokens.weight, ids)  # [T, H]

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head_proj(h).float()  # [T, V] (tensor parallel: [T, V / N], this rank's vocab slice)

    def context(self, cache: LatentCache, T: int, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, start: torch.Tensor | None = None) -> StepContext:
        """The step context of T new tokens (see :class:`StepContext`).

        start None: an eager step; the T entries are reserved after the cache's committed length, positions
        default to the slots. start [] long: a device-resident step (no host read, shapes fixed by T and the
        capacity); the cache's host-side length is not used, positions and tree_mask are required and the
        rope tables must cover the positions (``self.rope.ensure``).
        """
        if tree_mask is not None and tuple(tree_mask.shape) != (T, T):
            raise ValueError(f"tree_mask must be [{T}, {T}], got {tuple(tree_mask.shape)}")
        dev = self.device
        if start is None:
            first = cache.reserve(T)
            slots = torch.arange(first, first + T, device=dev)  # [T]
            positions = slots if positions is None else positions
            cos, sin = self.rope.tables(positions)
            return StepContext(positions, cos, sin, slots, first, tree_mask, cache.table, cache.rows(slots))
        if positions is None or tree_mask is None:
            raise ValueError("a device-resident step needs its positions and tree mask")
        return self.static_context(cache.table, cache.capacity, positions, tree_mask, start)

    def static_context(self, table: torch.Tensor, capacity: int, positions: torch.Tensor, tree_mask: torch.Tensor,
                       start: torch.Tensor) -> StepContext:
        """A device-resident step of T = len(positions) rows over the ``capacity`` slots of block table ``table``
        (a request's, or a static slot table that requests are copied into: kdtree_engine/batch/graph_step.py)."""
        T = positions.shape[0]
        cos, sin = self.rope.gather(positions)
        # what attention derives from (start, tree_mask) is the same in every layer: built once here
        gather_index = attention_gather_index(self.policy, tree_mask)
        visible = static_visibility(start, tree_mask, capacity) if gather_index is None else None
        slots = start + torch.arange(T, device=self.device)
        return StepContext(positions, cos, sin, slots, start, tree_mask, table, page_rows(table, slots, BLOCK),
                           visible, gather_index, capacity=capacity)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: LatentCache, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                start: torch.Tensor | None = None) -> TargetOutput:
        """ids [T] -> logits [T, V] (float32) and the requested aux hidden states.

        One forward for every kind of step; what differs is its context (:meth:`context`). With start None
        the step's bookkeeping is on the host: positions default to cache.length + arange(T); with tree_mask
        None the step is causal and committed, with a tree mask [T, T] (ancestor-or-self) the entries stay
        pending until ``cache.commit(keep)``. With start a [] long device tensor (the committed length) the
        step reads nothing back to the host and can be captured in a CUDA graph: the new entries go to slots
        start..start+T-1, the cache's host-side length is neither read nor changed (the caller compacts with
        :meth:`LatentCache.compact_static`).
        """
        self._check_aux(aux_layers)
        ctx = self.context(cache, ids.shape[0], positions, tree_mask, start)
        out = self._layers_and_head(self.embed(ids.to(self.device)), ctx, cache, aux_layers)
        if start is None and tree_mask is None:
            cache.commit_all()
        return out

    @torch.no_grad()
    def forward_batch(self, parts: Sequence[BatchPart], aux_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
        """Several requests' steps as one forward (continuous batching): row-wise work over all their rows at once,
        attention per request (:class:`BatchContext`). Each part's logits (the rows it asks for) and aux rows are
        what its own :meth:`forward` (or prefill chunk) would give, bit for bit where the kernels are batch-invariant."""
        if not parts:
            raise ValueError("forward_batch needs at least one part")
        self._check_aux(aux_layers)
        ctxs = []
        for p in parts:
            c = self.context(p.cache, p.ids.shape[0], None if p.positions is None else p.positions.to(self.device),
                             p.tree_mask, p.start)
            ctxs.append(c if p.chunk is None else replace(c, chunk=p.chunk))
        ctx = BatchContext.of(tuple(ctxs))
        ids = torch.cat([p.ids.to(self.device) for p in parts])
        x, aux = self._layers(self.embed(ids), ctx, self.pool(), aux_layers)
        dev = self.device   # the row index made on the device: no host-to-device copy (a captured batch stays valid)
        wanted = [torch.arange(a, b, device=dev) if p.logits == "all" else torch.arange(b - 1, b, device=dev)
                  if p.logits == "last" else torch.arange(0, device=dev) for p, (_, a, b) in zip(parts, ctx.spans())]
        index = torch.cat(wanted)
        logits = self.lm_head(take_rows(x, index)) if index.numel() else None
        outs, row = [], 0
        for p, w, (_, a, b) in zip(parts, wanted, ctx.spans()):
            n = w.numel()
            part_logits = logits[row:row + n] if logits is not None else x.new_empty(0, 0, dtype=torch.float32)
            outs.append(TargetOutput(logits=part_logits, aux=None if aux is None else aux[a:b]))
            row += n
            if p.tree_mask is None and p.start is None:
                p.cache.commit_all()
        return outs

    def _check_aux(self, aux_layers: tuple[int, ...]) -> None:
        wanted = set(aux_layers)
        if len(wanted) != len(aux_layers) or any(not 0 <= l < len(self.layers) for l in wanted):
            raise ValueError(f"aux_layers {aux_layers} must be distinct layer ids < {len(self.layers)}")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache: LatentCache, aux_layers: tuple[int, ...] = (),
                chunk: int | None = None, form: str = "auto", all_logits: bool = False,
                positions: torch.Tensor | None = None) -> PrefillOutput:
        """The prompt's forward: ids [T] into ``cache`` -> the last token's logits [1, V] (all [T, V] with
        ``all_logits``) and the aux features of every prompt token (see :mod:`.prefill`).

        A prompt of at most ``chunk`` tokens (None: DEFAULT_PREFILL_CHUNK) is one ordinary causal forward;
        a longer one runs in chunks, each attending over the committed prefix and itself in key blocks, in the
        form ``form`` ("auto": chosen per chunk by cost). ``positions`` [T]: the rope positions (None: the cache
        slots, as in :meth:`forward`). Peak memory: on CUDA the allocator's peak above what
        was allocated before, on the CPU the estimated largest attention transient."""
        size = resolve_chunk(chunk)
        self._check_aux(aux_layers)
        T = ids.shape[0]
        dev, cfg = self.device, self.cfg
        N, db = self.layers[0].self_attn.n_heads, self.dtype.itemsize
        ids = ids.to(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        if T <= size:
            graphs = self.prompt_graphs
            if graphs is not None and positions is None and not all_logits and graphs.takes(T, cache):
                logits, aux = graphs.run(ids, cache, aux_layers)
            else:
                out = self(ids, cache, positions, aux_layers=aux_layers)
                logits, aux = (out.logits if all_logits else out.logits[-1:]), out.aux
            chunks = 1
            estimate = transient_bytes(cfg, N, T, T, "naive", db)
        else:
            parts, auxes, estimate = [], [], 0
            plan = plan_chunks(T, size)
            for a, b in plan:
                chosen = choose_form(cfg, N, b - a, cache.length, db, dev, form, prefill_kernel_on(self.policy, dev))
                at = None if positions is None else positions[a:b].to(dev)
                ctx = replace(self.context(cache, b - a, at), chunk=ChunkStep(chosen))
                x, part_aux = self._layers(self.embed(ids[a:b]), ctx, cache, aux_layers)
                cache.commit_all()
                estimate = max(estimate, transient_bytes(cfg, N, b - a, min(KEY_BLOCK, b), chosen, db))
                auxes.append(part_aux)
                if all_logits or b == T:
                    parts.append(self.lm_head(x if all_logits else x[-1:]))
            logits, chunks = torch.cat(parts), len(plan)
            aux = torch.cat(auxes) if aux_layers else None
        peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else estimate
        return PrefillOutput(logits=logits, aux=aux, chunks=chunks, chunk=size, peak_bytes=int(peak))

    def _layers_and_head(self, h: torch.Tensor, ctx: StepContext, cache: LatentCache,
                         aux_layers: tuple[int, ...]) -> TargetOutput:
        x, aux = self._layers(h, ctx, cache, aux_layers)
        return TargetOutput(logits=self.lm_head(x), aux=aux)

    def _layers(self, h: torch.Tensor, ctx: StepContext | BatchContext, cache: LatentCache | CachePool, aux_layers: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers and the final norm (which adds the last MLP output) -> (normed x [T, H],
        aux = the requested layers' outputs, concatenated)."""
        wanted = set(aux_layers)
        saved: dict[int, torch.Tensor] = {}
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            h_in, h, pending = layer(h, pending, ctx, cache.layer(i))
            if i - 1 in wanted:
                saved[i - 1] = h_in  # layer i-1's output
        h, x = self.norm.residual(h, pending)
        if len(self.layers) - 1 in wanted:
            saved[len(self.layers) - 1] = h
        return x, (torch.cat([saved[l] for l in aux_layers], dim=-1) if aux_layers else None)
