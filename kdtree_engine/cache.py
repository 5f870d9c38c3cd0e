"""Target latent KV cache: one 576-wide entry (kv_lora_rank latent + rope key) per token per layer, paged.

:class:`CachePool` is one tensor [layers, num_blocks, BLOCK, D] allocated once per target, with a host-side free
list. A request's :class:`LatentCache` holds the blocks of its capacity and a block table (a device tensor of
block ids, fixed width, so a captured graph reads it in place): slot s lives at (table[s // BLOCK], s % BLOCK).

Slots [0, length) hold committed tokens. A multi-token step writes its entries after them; a causal step commits
them at once, a tree step leaves them *pending* until :meth:`LatentCache.commit` keeps the accepted nodes
(compacted into the next slots, within the request's blocks) and drops the rest.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .config import ModelConfig
from .errors import BadInput, CacheFullError, PoolFullError
from .kernels.common import take_rows
from .kernels.paged import gather_slots, page_rows
from .logs import log

BLOCK = 64  # tokens per block: one warpgroup key tile of the decode / verify kernels
DEFAULT_MEMORY_FRACTION = 0.9  # of the free device memory after the weights, when neither size is given
ADDRESSABLE = 2 ** 31  # elements of one layer's pool: the attention kernels address keys with 32-bit offsets
CONTEXTS = 2  # CPU default (and a target's pool made on first use): this many max_position_embeddings contexts


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.num_hidden_layers * cfg.kv_cache_dim * dtype.itemsize


def free_device_bytes(device: torch.device) -> int:
    # memory the caching allocator holds but no tensor uses is free for the pool too
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def pool_tokens(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tokens: int | None,
                fraction: float | None, first_use: bool = False) -> tuple[int, str]:
    """The pool's size in tokens (a whole number of blocks) and how it was chosen: ``tokens`` when given, else
    ``fraction`` (default :data:`DEFAULT_MEMORY_FRACTION` on CUDA) of the free device memory; on the CPU
    :data:`CONTEXTS` x max_position_embeddings (host memory is not accounted). ``first_use``: a pool made by a
    target's first new_cache without a size (tests, benchmarks): the CPU rule on every device, on CUDA at most
    the default fraction of the free memory (several targets in one process each get a pool)."""
    if tokens is not None and fraction is not None:
        raise BadInput(f"give cache_tokens={tokens} or memory_fraction={fraction}, not both")
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < BLOCK:
            raise BadInput(f"cache_tokens={tokens!r}: the cache pool needs an integer of at least {BLOCK} tokens")
        return blocks_for(tokens) * BLOCK, f"{tokens} tokens asked"
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise BadInput(f"memory_fraction={fraction!r}: a fraction of the free device memory in (0, 1]")
    contexts = CONTEXTS * blocks_for(cfg.max_position_embeddings)  # blocks
    if device.type != "cuda":
        if fraction is not None:
            raise BadInput(f"memory_fraction={fraction}: sizes the cache from free CUDA memory; on the CPU give "
                           f"cache_tokens")
        return contexts * BLOCK, f"CPU default: {CONTEXTS} x max_position_embeddings"
    frac = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
    free = free_device_bytes(device)
    n = int(free * frac) // (bytes_per_token(cfg, dtype) * BLOCK)
    if first_use and 0 < contexts <= n:
        return contexts * BLOCK, f"made on first use: {CONTEXTS} x max_position_embeddings"
    if n < 1:
        raise PoolFullError(f"{frac:g} of the free device memory ({free / 2**20:.0f} MiB) holds no cache block")
    default = " (default)" if fraction is None else ""
    return n * BLOCK, f"{frac:g} of {free / 2**30:.2f} GiB free after the weights{default}"


class CachePool:
    """The latent cache of every request of one target: kv [layers, num_blocks, BLOCK, D] and the free blocks."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.cfg = cfg
        self.num_blocks = num_blocks
        # one block past the requests' (never free): where the padded rows of a step replayed from a CUDA graph
        # write the latents that fall outside their request's blocks (nothing reads them as keys of a real row)
        self.trash = num_blocks
        # zero-initialised: a kernel reading a whole block past a request's length weighs those keys 0, so they
        # must be finite, and the pool only ever holds written keys or zeros
        self.kv = torch.zeros(cfg.num_hidden_layers, num_blocks + 1, BLOCK, cfg.kv_cache_dim, dtype=dtype,
                              device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self.sizing = f"{num_blocks} blocks asked"  # how the size was chosen (the log line's reason)

    @classmethod
    def sized(cls, cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, tokens: int | None = None,
              fraction: float | None = None, first_use: bool = False,
              agree: Callable[[int], int] | None = None) -> "CachePool":
        """A pool sized by :func:`pool_tokens`, logged with the resulting maximum context. ``agree``: the size
        every rank of a tensor-parallel group takes, from this rank's (their least: one admission rule)."""
        n, why = pool_tokens(cfg, dtype, device, tokens, fraction, first_use)
        if agree is not None:
            n, why = agree(n), f"{why}, the least over the ranks"
        most = (ADDRESSABLE - 1) // cfg.kv_cache_dim // BLOCK * BLOCK - BLOCK   # and the trash block
        if n > most:
            n, why = most, f"{why}, cut to the {most} tokens a layer's 32-bit key offsets address"
        pool = cls(cfg, n // BLOCK, dtype=dtype, device=device)
        pool.sizing = why
        log.debug("latent cache pool: %d blocks of %d tokens = %d tokens, %.1f MiB (%s); maximum context %d tokens",
                  pool.num_blocks, BLOCK, n, n * bytes_per_token(cfg, dtype) / 2**20, why, pool.max_context)
        return pool

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * BLOCK

    @property
    def max_context(self) -> int:
        """The longest request the pool admits: its tokens, at most the model's max_position_embeddings."""
        return min(self.total_tokens, self.cfg.max_position_embeddings)

    def free_ids(self) -> list[int]:
        """The free block ids (a copy; the next taken last)."""
        return list(self._free)

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * BLOCK

    def take(self, tokens: int) -> list[int]:
        """The blocks of ``tokens`` slots, or a PoolFullError naming the tokens asked and free."""
        n = blocks_for(tokens)
        if n > len(self._free):
            raise PoolFullError(f"latent cache pool: {tokens} tokens asked, {self.free_tokens} free "
                                f"(of {self.total_tokens})")
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def give(self, blocks: list[int]) -> None:
        """Return blocks taken by :meth:`take`."""
        self._free.extend(reversed(blocks))

    def layer(self, i: int) -> torch.Tensor:
        return self.kv[i]  # [num_blocks, BLOCK, D]


def give_back(pool: CachePool, blocks: list[int]) -> None:
    """Return a request's blocks (if it still holds them) and mark them returned."""
    pool.give(blocks)
    blocks.clear()


class LatentCache:
    """One request's slots in the pool: the blocks of ``max_tokens`` slots (taken now, refused with a PoolFullError
    when the pool has too few free), the block table [ceil(max_tokens / BLOCK)] int32 on the device, the
    committed length and the pending count. :meth:`release` returns the blocks (also when the cache is
    collected); :meth:`acquire` takes blocks again into the same table tensor (a captured graph stays valid)."""

    def __init__(self, pool: CachePool, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.pool = pool
        self.cfg = pool.cfg
        self.capacity = max_tokens
        self.table = torch.zeros(blocks_for(max_tokens), dtype=torch.int32, device=pool.kv.device)
        self.blocks: list[int] = []
        self.length = 0
        self.pending = 0
        self.generation = 0  # counts the times blocks were taken: a copy of the table is current while it holds
        self._finalizer = weakref.finalize(self, give_back, pool, self.blocks)
        self.acquire()

    @property
    def held(self) -> bool:
        return bool(self.blocks)

    def acquire(self) -> None:
        """Take the blocks of the capacity (a no-op when held); the cache starts empty."""
        if not self.blocks:
            self.blocks.extend(self.pool.take(self.capacity))
            self.table.copy_(torch.tensor(self.blocks, dtype=torch.int32))
            self.generation += 1
        self.length = self.pending = 0

    def release(self) -> None:
        """Return the blocks to the pool (a no-op when already returned)."""
        give_back(self.pool, self.blocks)
        self.length = self.pending = 0

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool rows (of a layer viewed as [num_blocks * BLOCK, D]) of this request's ``slots``."""
        return page_rows(self.table, slots, BLOCK)

    def reserve(self, n: int) -> int:
        """Start a step of n new tokens; returns the first slot they go to."""
        if self.length + n > self.capacity:
            raise CacheFullError(f"cache holds {self.capacity} tokens; {self.length} used, {n} more asked")
        if not self.blocks:
            raise CacheFullError("the cache's blocks were returned to the pool")
        self.pending = n
        return self.length

    def layer(self, i: int) -> torch.Tensor:
        return self.pool.layer(i)  # [num_blocks, BLOCK, D], read through self.table

    @property
    def kv(self) -> torch.Tensor:
        """The request's slots [layers, capacity, D] gathered through the table (a copy, for inspection)."""
        return torch.stack([gather_slots(self.layer(i), self.table, self.capacity)
                            for i in range(self.cfg.num_hidden_layers)])

    def load_slots(self, values: torch.Tensor) -> None:
        """Write values [layers, n, D] to slots [0, n) (tests and tools)."""
        rows = self.rows(torch.arange(values.shape[1], device=self.table.device))
        self._flat().index_copy_(1, rows, values.to(self.pool.kv.dtype))

    def _flat(self) -> torch.Tensor:
        kv = self.pool.kv
        return kv.view(kv.shape[0], -1, kv.shape[-1])  # [layers, num_blocks * BLOCK, D]

    def commit_all(self) -> None:
        self.length += self.pending
        self.pending = 0

    def commit(self, keep: torch.Tensor) -> None:
        """Keep pending entries ``keep`` (indices into the pending block, ascending) as the next slots."""
        commit_many([self], keep.to(self.table.device).reshape(1, -1), [keep.numel()])

    def host_rows(self, first: int, n: int) -> list[int]:
        """Pool rows of slots first .. first + n - 1, from the host's block list (no device read)."""
        return [self.blocks[s // BLOCK] * BLOCK + s % BLOCK for s in range(first, first + n)]

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside [0, {self.length}]")
        self.length = n
        self.pending = 0

    def compact_static(self, start: torch.Tensor, keep: torch.Tensor) -> None:
        """Device-side commit of a tree step written at slots start.. (``start`` a [] long tensor):
        slot start + j gets the entry of slot start + keep[j], for every j < len(keep).

        No host read and fixed shapes: ``keep`` [M] lists the accepted nodes first (ascending); the
        entries after the accepted ones land past the new length, where the next step overwrites them.
        The host-side ``length`` is not changed (the caller keeps the length on the device).
        """
        M = keep.shape[0]
        flat = self._flat()
        src = take_rows(flat, self.rows(start + keep), dim=1)  # [layers, M, D]
        flat.index_copy_(1, self.rows(start + torch.arange(M, device=flat.device)), src)


def commit_many(caches: list[LatentCache], keep: torch.Tensor, counts: list[int]) -> None:
    """Commit the tree steps of several requests' caches (of one pool) in one copy: cache r keeps its pending entries
    ``keep[r, :counts[r]]`` (a device tensor [R, M], each row ascending) as its next slots. Where each kept entry
    goes is known on the host (the block lists); which pending entry it is lies on the device, so one gather picks
    the source rows and nothing is read back."""
    pool = caches[0].pool
    M = keep.shape[1]
    pending_rows: list[int] = []
    picked: list[int] = []   # flat positions in keep of the entries kept
    offset: list[int] = []   # ...and where their cache's pending rows start in pending_rows
    dst: list[int] = []
    for r, (cache, n) in enumerate(zip(caches, counts)):
        if cache.pool is not pool:
            raise ValueError("commit_many takes caches of one pool")
        if n > cache.pending:
            raise ValueError(f"commit keeps {n} of {cache.pending} pending entries")
        picked += range(r * M, r * M + n)
        offset += [len(pending_rows)] * n
        pending_rows += cache.host_rows(cache.length, cache.pending)
        dst += cache.host_rows(cache.length, n)
    P, S = len(pending_rows), len(picked)
    host = torch.tensor(pending_rows + picked + offset + dst, dtype=torch.long).to(keep.device)   # one copy
    src = host[:P].index_select(0, keep.reshape(-1).index_select(0, host[P:P + S]) + host[P + S:P + 2 * S])
    flat = caches[0]._flat()
    flat.index_copy_(1, host[P + 2 * S:], flat.index_select(1, src))  # [L, n, D]: a copy first, so overlaps are safe
    for cache, n in zip(caches, counts):
        cache.length += n
        cache.pending = 0
