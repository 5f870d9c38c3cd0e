"""The whole Kimi K2 model at the size one rank of TP8 / EP8 holds, timed by whole decoding rounds on one GPU.

    python bench/k2_model.py --out bench/results                   # one H200: about 80 GB of weights
    python bench/k2_model.py --out DIR --contexts 4096 --nodes 1,16
    python bench/k2_model.py --out DIR --tiny --device cpu          # k2-tiny dims, CPU smoke run
    python bench/k2_model.py --out DIR --ranks all --contexts 4096 --nodes 1,8,16   # 8 GPUs: one real rank each

What is built (random weights drawn on the device, no checkpoint): all 61 layers of ``preset('k2')`` as rank 0
of ``--world`` ranks holds them, i.e. the engine's own Target over a ``LocalCommunicator(0, W)``
(kdtree_engine/parallel/comm.py): 8 of the 64 attention heads (q_a / kv_a replicated, the full latent cache),
experts 0..47 of 384 in every MoE layer (the router scores all 384 experts and picks 8 per token, so this rank
sees its true share of the routes: by default each token's 8 experts are drawn uniformly, see --routing), the shared expert and layer 0's dense MLP split W ways, a vocabulary shard of
the embedding and the lm_head; INT4 W4A16 routed experts, group 32; bf16 elsewhere. The drafter: a DFlash
drafter of the published Kimi-K2.5-DFlash shape (6 layers, hidden 7168, 64 query / 8 KV heads of 128,
intermediate 18432, block 8, target layers 1, 12, 24, 35, 47, 58), whole on every rank, as every rank runs it.
Caches: ``--contexts`` tokens of random latents (and the drafter's context K/V), written on the device.

What is timed: the engine's device-resident round (speculative/device_round.py ``DeviceRound.step``: draft ->
tree -> verify over all 61 layers -> accept -> commit), captured in ONE CUDA graph per (context, tree size) and
replayed back to back (median of ``--reps`` batches of ``--replays`` replays; the context grows by the accepted
tokens, at most a block per round, which is noise against 4K+). Plain decoding = method none (1 node, no
drafter); DDTree = a tree of T nodes (budget T - 1) built from the drafter's block.

With ``--ranks N`` (``all``: every visible GPU) N processes run, one a device (NCCL; gloo on the CPU), each
building and timing its own shard of an N-rank layout, every collective crossing between them inside the graphs:
no link model, rank 0's times recorded (``k2_model-<gpu>-xN``). ``--layers L`` builds L layers only, for fewer
ranks than K2's shards need (the drafter's target layers spread over them).

Links (one process): the LocalCommunicator does this rank's share of every collective (the all-gather's copy, the rank-order
sum) inside the measured time, but nothing crosses a link. What the links add is a model: every collective of a
round (counted in one eager round: kind and bytes) costs ``--link-latency-us`` + bytes on the wire /
``--link-GBps`` (an all-gather of n bytes a rank puts (W-1) n bytes on each rank's link). The defaults are
published figures, not measurements: 7.8 us, the upper end of the 5.7-7.8 us custom small all-reduce on 8 x H100
NVLink, and 350 GB/s of bus bandwidth (NVLink 4: 450 GB/s a direction).

Roofline: the bytes this rank must read in a round / the copy bandwidth measured in the same run. Bytes: the
attention weights as the absorbed path reads them (q_a, q_b, kv_a, W_UK/W_UV, o, norms), the router (float32),
the shared expert and dense MLP shares, the INT4 bytes of the local experts the router chose in that round
(counted per layer in the eager round), the lm_head shard (twice with a drafter: the drafter's logits go
through it too), the latent cache (context + T) x 576 x 2 bytes x 61, and with a drafter all its weights and its
context K/V.

Tokens/s at batch 1: plain = 1 / (round(1) + links(1)); DDTree at tau (accepted tokens per round, bonus included)
= tau / (round(T) + links(T)). The tau values (4, 5.3 = the published Kimi-K2.5-DFlash acceptance at block 8 on
GSM8K / HumanEval, 7) are assumptions: random weights accept nothing; nor is a tau assumed to grow with T.

Writes ``<out>/k2_model-<gpu>.json`` and ``.md``; prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.k2_step import attention_weight_bytes, expert_bytes, nbytes, randomize_  # noqa: E402
from kdtree_engine.bench_spec import device_tag  # noqa: E402
from kdtree_engine.config import ModelConfig, preset  # noqa: E402
from kdtree_engine.draft_config import DraftConfig  # noqa: E402
from kdtree_engine.kernels.dispatch import prepare_int4, route, router_matmul  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.model.dflash import DFlashDrafter  # noqa: E402
from kdtree_engine.model.layers import RMSNorm  # noqa: E402
from kdtree_engine.model.moe import MoE  # noqa: E402
from kdtree_engine.model.target import Target  # noqa: E402
from kdtree_engine.parallel.comm import Communicator, DistCommunicator, LocalCommunicator  # noqa: E402
from kdtree_engine.quant import k2_quantization_config, parse_quantization_config  # noqa: E402
from kdtree_engine.speculative.config import SpecConfig  # noqa: E402
from kdtree_engine.speculative.device_round import DeviceRound  # noqa: E402

DEFAULT_NODES = (1, 4, 8, 16, 32, 64, 128)
DEFAULT_CONTEXTS = (4096, 65536)
TAUS = (4.0, 5.3, 7.0)
# Kimi-K2.5-DFlash (z-lab) as published: its shape; the target layers it reads
K2_DRAFT = dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6, num_attention_heads=64,
                num_key_value_heads=8, head_dim=128, block_size=8, target_layer_ids=(1, 12, 24, 35, 47, 58),
                rope_theta=50000.0)


class UniformRoutes(torch.nn.Module):
    """The model's router (its matmul still runs and costs what it costs), with the chosen experts replaced by 8
    distinct experts drawn uniformly per token: random weights make every token's hidden state alike, so their own
    router sends all tokens to the same few experts, far fewer than a trained, load-balanced router touches. The
    draw: the engine's router tail (no group limit) on uniform noise, so an expert-parallel rank's routes are made
    its own in that launch as the engine's are. Drawn on the device (capturable: each replay draws afresh)."""

    def __init__(self, router: torch.nn.Module) -> None:
        super().__init__()
        self.router = router
        self.ungrouped = dataclasses.replace(router.cfg, n_group=1, topk_group=1)
        self.register_buffer("no_bias", torch.zeros_like(router.e_score_correction_bias), persistent=False)

    def forward(self, x: torch.Tensor, owned: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.router
        router_matmul(r.policy, x, r.weight, partials=True, bf16x3=r.bf16x3_parts)
        noise = torch.rand(x.shape[0], r.weight.shape[0], device=x.device)
        return route(r.policy, noise, self.no_bias, self.ungrouped, owned)


class CountingCommunicator(Communicator):
    """A rank's collectives (``inner``: a process group's; None: rank ``rank`` of a pretended group of ``world_size``,
    a LocalCommunicator) that also lists the collectives it is asked for (kind, bytes a rank puts in)."""

    def __init__(self, rank: int, world_size: int, inner: Communicator | None = None) -> None:
        self.inner = LocalCommunicator(rank, world_size) if inner is None else inner
        self.rank, self.world_size = self.inner.rank, self.inner.world_size
        self.calls: list[tuple[str, int]] = []

    @property
    def real(self) -> bool:
        """Whether the collectives cross to other processes (their cost is then in the measured time)."""
        return isinstance(self.inner, DistCommunicator)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather", x.numel() * x.element_size()))
        return self.inner.all_gather(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_reduce", x.numel() * x.element_size()))
        return self.inner.all_reduce(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_to_all", x.numel() * x.element_size()))
        return self.inner.all_to_all(x)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.calls.append(("broadcast", x.numel() * x.element_size()))
        return self.inner.broadcast(x, src)

    def describe(self) -> str:
        return self.inner.describe()


@dataclasses.dataclass(frozen=True)
class Links:
    """The cost model of what crosses the links (see the module docstring)."""

    world: int
    latency_us: float
    GBps: float
    measured: bool = False   # the ranks are real processes: what crosses the links is in the measured time

    def us(self, kind: str, nbytes_: int) -> float:
        if self.measured:
            return 0.0
        W = self.world
        wire = {"all_gather": (W - 1) * nbytes_, "all_reduce": 2 * (W - 1) / W * nbytes_,
                "all_to_all": (W - 1) / W * nbytes_, "broadcast": nbytes_}[kind]
        return self.latency_us + wire / (self.GBps * 1e9) * 1e6

    def round_us(self, calls: Sequence[tuple[str, int]]) -> float:
        return sum(self.us(k, b) for k, b in calls)


# ---- configuration ---------------------------------------------------------------------------

def k2_config() -> ModelConfig:
    return preset("k2")


def tiny_config() -> ModelConfig:
    """k2-tiny widened to split 8 ways (8 heads, 16 experts, no group routing), 4 layers, a dense first layer."""
    return dataclasses.replace(preset("k2-tiny"), num_hidden_layers=4, first_k_dense_replace=1,
                               num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1)


def draft_config(cfg: ModelConfig, tiny: bool) -> DraftConfig:
    if tiny:
        shape = dict(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                     target_layer_ids=(1, cfg.num_hidden_layers - 2), rope_theta=10000.0)
    else:
        shape = dict(K2_DRAFT)
    ids, L = shape["target_layer_ids"], cfg.num_hidden_layers
    if max(ids) >= L or len(set(ids)) < len(ids):   # fewer layers built (--layers): as many target layers, spread
        n = len(ids)
        spread = tuple(sorted({1 + round(i * (L - 2) / max(n - 1, 1)) for i in range(n)} - {L}))
        if len(spread) < n:
            raise SystemExit(f"--layers {L}: too few for the drafter's {n} target layers")
        shape = {**shape, "target_layer_ids": spread}
    return DraftConfig(**shape, mask_token_id=cfg.vocab_size - 2, num_target_layers=cfg.num_hidden_layers,
                       vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings)


# ---- building --------------------------------------------------------------------------------

def build(cfg: ModelConfig, dcfg: DraftConfig, comm: CountingCommunicator, policy: KernelPolicy,
          dev: torch.device, dtype: torch.dtype, gen: torch.Generator, uniform: bool
          ) -> tuple[Target, DFlashDrafter]:
    quant = parse_quantization_config(k2_quantization_config(32))
    target = Target(cfg, dtype=dtype, device=dev, quant=quant, policy=policy, comm=comm)
    for m in target.modules():
        if isinstance(m, RMSNorm):
            m.weight.data = m.weight.data.to(dtype)
    pieces = [target.embed_tokens, target.norm, target.lm_head_proj, *target.layers]
    for p in pieces:
        randomize_(p, gen)
    for m in target.modules():
        for reset in ("reset_absorbed", "reset_parts", "reset_dense"):
            if hasattr(m, reset):
                getattr(m, reset)()
    if uniform:
        for layer in target.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate = UniformRoutes(layer.mlp.gate)
    target.eval()
    prepare_int4(target, dtype)
    drafter = DFlashDrafter(dcfg, dtype=dtype, device=dev, policy=policy)
    randomize_(drafter, gen)
    drafter.eval()
    return target, drafter


def fill_caches(rnd: DeviceRound, S: int, gen: torch.Generator) -> None:
    """Random committed state at length S: latents, the drafter's context K/V, one context row, a bonus token."""
    with torch.no_grad():
        cache = rnd.cache   # paged: slots [0, S) written through its block table
        cache.load_slots(torch.randn(cache.cfg.num_hidden_layers, S, cache.cfg.kv_cache_dim, generator=gen,
                                     device=gen.device))
        if rnd.dcache is not None:
            for t in (rnd.dcache.k, rnd.dcache.v):
                for layer in range(t.shape[0]):
                    t[layer, :, :S].normal_(generator=gen)
            rnd.ctx.normal_(generator=gen)
            rnd.n_ctx.fill_(1)
        rnd.start.fill_(S)
        shard = rnd.target.vocab_shard
        lo = 0 if shard is None else shard.start
        rnd.bonus.fill_(lo + 7)
    rnd.cache.length = S
    if rnd.dcache is not None:
        rnd.dcache.length = S


# ---- bytes -----------------------------------------------------------------------------------

def static_bytes(target: Target, drafter: DFlashDrafter) -> dict[str, int]:
    attn = sum(attention_weight_bytes(layer.self_attn) + nbytes(layer.input_layernorm.weight,
                                                                layer.post_attention_layernorm.weight)
               for layer in target.layers)
    router = shared = dense = 0
    for layer in target.layers:
        if isinstance(layer.mlp, MoE):
            router += nbytes(*layer.mlp.gate.parameters())   # UniformRoutes holds the router
            if layer.mlp.shared_experts is not None:
                shared += nbytes(*layer.mlp.shared_experts.parameters())
        else:
            dense += nbytes(*layer.mlp.parameters())
    return {"attention": attn, "router": router, "shared_experts": shared, "dense_mlp": dense,
            "lm_head": nbytes(target.lm_head_proj.weight), "final_norm": nbytes(target.norm.weight),
            "drafter": nbytes(*drafter.parameters())}


def touched_local_experts(target: Target, run: Callable[[], None]) -> tuple[int, list[int]]:
    """Run once, counting per MoE layer the distinct local experts the router chose; (expert bytes, counts)."""
    counts: list[int] = []
    hooks = []
    exp_b = 0
    for layer in target.layers:
        if not isinstance(layer.mlp, MoE):
            continue
        exp_b = expert_bytes(layer.mlp.experts)

        def hook(_m: Any, _inp: Any, out: Any) -> None:
            ids = out[0].reshape(-1)   # the rank's routes: local ids, -1 for another rank's experts
            counts.append(int(torch.unique(ids[ids >= 0]).numel()))
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return exp_b, counts


# ---- timing ----------------------------------------------------------------------------------

def time_round(rnd: DeviceRound, cuda: bool, reps: int, replays: int) -> dict[str, Any]:
    """Median ms per round: CUDA: one graph of the round, replays back to back; CPU: eager rounds."""
    if cuda:
        g = common.capture_graph(rnd.step)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(replays):
                g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / replays)
        del g
        return {"ms": statistics.median(times), "graph": True, "spread_ms": [min(times), max(times)]}
    rnd.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(replays):
            rnd.step()
        times.append((time.perf_counter() - t0) * 1e3 / replays)
    return {"ms": statistics.median(times), "graph": False, "spread_ms": [min(times), max(times)]}


def bench_one(target: Target, drafter: DFlashDrafter, comm: CountingCommunicator, T: int, S: int,
              args: argparse.Namespace, static: dict[str, int], copy_bw: float, links: Links,
              gen: torch.Generator, cuda: bool) -> dict[str, Any]:
    rnd = make_round(target, drafter, T, S, args.reps * args.replays)
    shape, method = rnd.shape, rnd.method
    fill_caches(rnd, S, gen)
    saved = rnd.snapshot()
    comm.calls.clear()
    exp_b, counts = touched_local_experts(target, rnd.step)
    calls = list(comm.calls)
    rnd.restore(saved)
    timing = time_round(rnd, cuda, args.reps, args.replays)
    cfg = target.cfg
    esz = rnd.cache.pool.kv.element_size()
    cache_b = cfg.num_hidden_layers * (S + shape.full_nodes) * cfg.kv_cache_dim * esz
    parts = {k: static[k] for k in ("attention", "router", "shared_experts", "dense_mlp", "lm_head", "final_norm")}
    parts["routed_experts"] = sum(counts) * exp_b
    parts["latent_cache"] = cache_b
    if T > 1:
        d = drafter.cfg
        parts["drafter"] = static["drafter"]
        parts["drafter_cache"] = 2 * d.num_hidden_layers * d.num_key_value_heads * S * d.head_dim * esz
        parts["lm_head_draft"] = static["lm_head"]
    total = sum(parts.values())
    roof_ms = total / copy_bw * 1e3
    link_us = links.round_us(calls)
    row = {"T": T, "context": S, "method": method, "budget": shape.budget, "max_tau": shape.block_size, **timing,
           "bytes": parts, "bytes_total": total, "roofline_ms": roof_ms, "x_roofline": timing["ms"] / roof_ms,
           "touched_experts_per_layer": statistics.mean(counts) if counts else 0.0,
           "collectives": {"count": len(calls), "bytes": sum(b for _, b in calls),
                           "kinds": sorted({k for k, _ in calls})},
           "links_ms": link_us / 1e3, "round_8gpu_ms": timing["ms"] + link_us / 1e3}
    del rnd
    if cuda:
        torch.cuda.empty_cache()
    return row


def make_round(target: Target, drafter: DFlashDrafter, T: int, S: int, slack_rounds: int) -> DeviceRound:
    shape = SpecConfig("none" if T == 1 else "ddtree", None if T == 1 else T - 1).resolve(
        drafter.block_size if T > 1 else 1, target.cfg.vocab_size)
    capacity = S + (slack_rounds + 8) * max(shape.block_size, 1) + shape.full_nodes + 64
    return DeviceRound(target, drafter if T > 1 else None, shape, capacity)


def profile_round(target: Target, drafter: DFlashDrafter, T: int, S: int, gen: torch.Generator) -> dict:
    """Device time per kernel of one eager round (torch.profiler), the top kernels and the launch count."""
    rnd = make_round(target, drafter, T, S, 16)
    fill_caches(rnd, S, gen)
    prof = common.kernel_profile(rnd.step, reps=3, top=25)
    del rnd
    torch.cuda.empty_cache()
    return {"context": S, "kernels": prof["kernels"],
            "launches": sum(k["calls"] for k in prof["kernels"]),
            "kernel_us": sum(k["us"] for k in prof["kernels"])}


def tokens_per_s(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if "round_8gpu_ms" not in r:
            continue
        if r["T"] == 1:
            out.append({"context": r["context"], "T": 1, "what": "plain", "tau": 1.0,
                        "tokens_per_s": 1e3 / r["round_8gpu_ms"]})
        else:
            for tau in TAUS:
                if tau > min(r["T"], r["max_tau"]):   # a round emits at most a node per depth level, bonus included
                    continue
                out.append({"context": r["context"], "T": r["T"], "what": "ddtree", "tau": tau,
                            "tokens_per_s": tau * 1e3 / r["round_8gpu_ms"]})
    return out


def run(args: argparse.Namespace, log: Callable[[str], None], comm: CountingCommunicator | None = None,
        dev: torch.device | None = None) -> dict:
    """The benchmark on this process: rank 0 of a pretended group of ``--world`` (``comm`` None), or one rank of a
    real group (``--ranks``: every rank runs the same rounds, their collectives inside the timed graphs)."""
    clock = common.Clock()
    dev = dev or torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    policy = KernelPolicy.from_env(batch_invariant=True)
    cfg = tiny_config() if args.tiny else k2_config()
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    dcfg = draft_config(cfg, args.tiny)
    comm = comm or CountingCommunicator(0, args.world)
    links = Links(comm.world_size, args.link_latency_us, args.link_GBps, measured=comm.real)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    torch.manual_seed(args.seed)
    copy_bw = common.copy_bandwidth() if cuda else common.cpu_copy_bandwidth()
    log(f"copy {copy_bw / 1e12:.3f} TB/s ({clock():.1f} s)")
    target, drafter = build(cfg, dcfg, comm, policy, dev, dtype, gen, args.routing == "uniform")
    static = static_bytes(target, drafter)
    weights = sum(nbytes(t) for t in list(target.parameters()) + list(target.buffers()))
    mem = {"target_weight_bytes": weights, "drafter_weight_bytes": static["drafter"]}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        mem.update(free_after_load=free, device_total=total)
    log(f"built {comm.describe()}: {weights / 1e9:.1f} GB target + {static['drafter'] / 1e9:.1f} GB drafter "
        f"({clock():.1f} s)")
    rows = []
    profiles = {}
    if args.profile and cuda:
        mid = args.nodes[len(args.nodes) // 2]
        for T in sorted({1, mid}):
            profiles[str(T)] = profile_round(target, drafter, T, min(args.contexts), gen)
            log(f"profiled T={T} ({clock():.0f} s)")
    for S in args.contexts:
        for T in args.nodes:
            try:
                row = bench_one(target, drafter, comm, T, S, args, static, copy_bw, links, gen, cuda)
            except torch.cuda.OutOfMemoryError as exc:
                row = {"T": T, "context": S, "error": f"out of memory: {str(exc)[:160]}"}
                torch.cuda.empty_cache()
            rows.append(row)
            if "ms" in row:
                log(f"context {S}, T={T}: {row['ms']:.3f} ms per round (x roofline {row['x_roofline']:.2f}), "
                    f"{row['collectives']['count']} collectives -> +{row['links_ms']:.2f} ms links ({clock():.0f} s)")
            else:
                log(f"context {S}, T={T}: {row['error']}")
    return {
        "tiny": bool(args.tiny), "world": comm.world_size, "ranks_run": comm.world_size if comm.real else 1,
        "layers": cfg.num_hidden_layers, "dtype": str(dtype).replace("torch.", ""),
        "copy_Bps": copy_bw, "links": dataclasses.asdict(links),
        "config": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                 "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "intermediate_size", "vocab_size")},
        "rank_shard": {"heads": cfg.num_attention_heads // comm.world_size,
                       "experts": cfg.n_routed_experts // comm.world_size, "vocab": cfg.vocab_size // comm.world_size},
        "drafter": {k: getattr(dcfg, k) for k in K2_DRAFT},
        "routing": args.routing, "memory": mem, "static_bytes": static, "profiles": profiles, "rounds": rows, "tokens_per_s": tokens_per_s(rows),
        "elapsed_s": clock(),
    }


# ---- output ----------------------------------------------------------------------------------

def markdown(rep: dict, label: str) -> list[str]:
    L, W = rep["links"], rep["world"]
    real = rep.get("ranks_run", 1) > 1
    layers = rep["config"]["num_hidden_layers"]
    title = (f"# Kimi K2, {layers} layers, {W} ranks on {W} devices ({label})" if real else
             f"# Kimi K2, all {layers} layers, one rank of {W} ({label})")
    out = [title, "",
           f"Rank shard: {rep['rank_shard']['heads']} heads, {rep['rank_shard']['experts']} of "
           f"{rep['config']['n_routed_experts']} experts a layer, {rep['rank_shard']['vocab']} vocabulary rows; "
           f"INT4 experts; routing {rep['routing']}; {rep['memory']['target_weight_bytes'] / 1e9:.1f} GB of target weights + "
           f"{rep['memory']['drafter_weight_bytes'] / 1e9:.1f} GB of drafter on this rank. Copy bandwidth "
           f"{rep['copy_Bps'] / 1e12:.2f} TB/s (measured).", "",
           "Whole rounds (draft + tree + verify of all layers + accept + commit), one CUDA graph each:", ""]
    rows = [[r["context"], r["T"], r.get("ms"), r.get("roofline_ms"), r.get("x_roofline"),
             r.get("touched_experts_per_layer"), r.get("links_ms"), r.get("round_8gpu_ms"), r.get("error", "")]
            for r in rep["rounds"]]
    out += common.md_table(["context", "nodes", "ms/round", "roofline ms", "x roofline", "local experts/layer",
                            "+links ms (model)" if not real else "+links ms (in ms/round)", f"{W}-GPU ms", "note"],
                           rows)
    for T, p in rep.get("profiles", {}).items():
        out += ["", f"Kernels of one eager round, {T} node(s), context {p['context']}: {p['launches']:.0f} launches, "
                    f"{p['kernel_us'] / 1e3:.2f} ms of kernel time:", ""]
        out += common.kernel_lines(p["kernels"])
    if real:
        out += ["", "Links: measured. Every rank ran the same rounds in its own graph, the NCCL collectives inside "
                    "it; ms/round is rank 0's.", "",
                f"Tokens/s at batch 1 on {W} GPUs (measured rounds; tau assumed):", ""]
    else:
        out += ["", f"Links (a model, not measured): {L['latency_us']:g} us + wire bytes / {L['GBps']:g} GB/s per "
                    "collective (published small all-reduce latency on 8 x H100 NVLink; NVLink 4 bus bandwidth).", "",
                f"Tokens/s at batch 1 on {W} GPUs (projection: measured rank-0 round + link model; tau assumed):", ""]
    out += common.md_table(["context", "nodes", "what", "tau", "tok/s"],
                           [[t["context"], t["T"], t["what"], t["tau"], t["tokens_per_s"]]
                            for t in rep["tokens_per_s"]])
    return out


def short_table(rep: dict) -> str:
    lines = [f"context  nodes  ms/round  x roofline  {rep['world']}-GPU ms"]
    for r in rep["rounds"]:
        if "ms" in r:
            lines.append(f"{r['context']:>7}  {r['T']:>5}  {r['ms']:8.3f}  {r['x_roofline']:10.2f}  "
                         f"{r['round_8gpu_ms']:8.3f}")
        else:
            lines.append(f"{r['context']:>7}  {r['T']:>5}  {r['error']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--nodes", type=ints, default=None, help="tree sizes (1 = plain decoding; default "
                    + ",".join(map(str, DEFAULT_NODES)) + "; --tiny 1,4)")
    ap.add_argument("--contexts", type=ints, default=None, help="context lengths (default 4096,65536; --tiny 64)")
    ap.add_argument("--tiny", action="store_true", help="k2-tiny dims (CPU smoke run)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--world", type=int, default=8, help="ranks of the layout this rank is one of")
    ap.add_argument("--reps", type=int, default=None, help="timed batches (default 5; --tiny 2)")
    ap.add_argument("--replays", type=int, default=None, help="rounds per timed batch (default 4; --tiny 1)")
    ap.add_argument("--link-latency-us", type=float, default=7.8, help="per collective (published, see above)")
    ap.add_argument("--link-GBps", type=float, default=350.0, help="bus bandwidth of the links (GB/s)")
    ap.add_argument("--routing", choices=("uniform", "model"), default="uniform",
                    help="uniform: 8 distinct experts drawn per token (a balanced router's load; the default); "
                         "model: the random-weight router's own picks (few experts: unlike a trained model)")
    ap.add_argument("--profile", action="store_true", help="also list the kernels of one round (CUDA; 4K context, "
                    "plain and the middle tree size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", default="0", help="N: run N real ranks, one process per device (NCCL, rank r on "
                    "cuda:r; gloo on the CPU), the collectives measured inside the graphs; 'all': every visible GPU; "
                    "0 (default): this process is rank 0 of --world and the links are a model")
    ap.add_argument("--layers", type=int, default=None, help="build only this many layers (a model whose shards "
                    "would not fit fewer ranks' devices; default: all)")
    a = ap.parse_args(argv)
    if a.ranks == "all":
        a.ranks = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif not a.ranks.isdigit():
        ap.error(f"--ranks {a.ranks!r}: a number of ranks or 'all'")
    a.ranks = int(a.ranks)
    if a.ranks:
        a.world = a.ranks
    if a.layers is not None and a.layers < 2:
        ap.error("--layers must be at least 2 (the dense first layer and a MoE layer)")
    a.nodes = a.nodes or ([1, 4] if a.tiny else list(DEFAULT_NODES))
    a.contexts = a.contexts or ([64] if a.tiny else list(DEFAULT_CONTEXTS))
    a.reps = a.reps or (2 if a.tiny else 5)
    a.replays = a.replays or (1 if a.tiny else 4)
    if min(a.nodes + a.contexts) < 1 or a.world < 1 or a.reps < 1 or a.replays < 1:
        ap.error("--nodes, --contexts, --world, --reps and --replays must be positive")
    return a


def rank_body(comm: Any, dev: torch.device, args: argparse.Namespace) -> dict:
    """One rank of ``--ranks``: every rank runs the same rounds (its collectives counted); rank 0 logs."""
    counted = CountingCommunicator(comm.rank, comm.world_size, inner=comm)

    def log(msg: str) -> None:
        if comm.rank == 0:
            print(msg, file=sys.stderr, flush=True)
    return run(args, log, counted, dev)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    command = common.command_line(argv, "python3 bench/k2_model.py")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rep = common.run_ranks(args.ranks, rank_body, (args,), dev.type) if args.ranks else run(args, log)
    tag = device_tag(dev) + (f"-x{args.ranks}" if args.ranks else "")
    jp, mp = common.write_results(args.out, f"k2_model-{tag}", rep, markdown(rep, tag), command=command, device=dev)
    print(f"wrote {jp} and {mp}")
    print(short_table(rep))
    return rep


if __name__ == "__main__":
    main()
