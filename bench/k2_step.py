"""One Kimi K2 decoder step at real dimensions, per layer, against its byte roofline; projected to the
full 61-layer model on 8 GPUs.

    python bench/k2_step.py --out bench/results                         # ~2-3 min on an H200
    python bench/k2_step.py --out DIR --layers 4 --nodes 1,4,8,16,32,64,128 --context 4096 --tau 4
    python bench/k2_step.py --out DIR --tiny                            # k2-tiny dims, CPU smoke run

What is built: ``--layers`` MoE decoder layers of ``preset('k2')`` (the engine's own DecoderLayer:
absorbed MLA with 64 heads, sigmoid router over 384 experts, top-8 INT4 W4A16 routed experts with
group 32, bf16 shared expert), random weights drawn on the device (random int32 packed nibbles, bf16
scales near 1/(4.6 sqrt(K)), never zeros), and a latent cache of ``--context`` random tokens per layer.

What is timed, for each node count T in ``--nodes`` (T = 1: plain decode, causal; T > 1: tree verify
of T nodes with a random ancestor-or-self mask and positions context + depth):
  * single GPU, whole K2 layer: attention sublayer (norm + MLA + residual), MoE sublayer (norm +
    router + routed experts + shared expert + residual), and the whole layer; each against its byte
    roofline = bytes that must be read / copy bandwidth measured in the same run. Bytes: attention
    bf16 weights (q_a, q_b, kv_a, W_UK/W_UV, o) + the latent cache (context + T) x 576 x 2 + router
    (fp32) + shared expert (bf16) + INT4 bytes (packed + scales) of the distinct experts that the
    router actually chose in that step (counted from its output, per layer).
  * one rank of 8 (the layout of the projection): attention with 8 of the 64 heads (q_a / kv_a
    replicated, the full latent cache), the replicated router, 48 local experts of 384 (the rank that
    owns the most touched experts in that layer: pairs routed elsewhere are masked to id -1, which
    the fused kernel skips), the shared expert split 8 ways (I = 256); plus layer 0's dense MLP split 8
    ways and 1/8 of lm_head.
Timing: bench/common.time_calls (CUDA-graph replay of one call per layer, so the layers' weights
rotate and exceed L2; median; falls back to CUDA events if capture fails: the ``graph`` field).

Projection (8 GPUs of this kind; stated in the output): TP8 attention + EP8 routed experts + TP8
shared expert and dense MLP; every rank holds the full hidden state after each all-reduce, so the
only communication is two all-reduces of T x 7168 bf16 per layer (after attention, after the MLP)
and one all-gather of T (value, index) pairs for the vocab-parallel argmax. An all-reduce costs
``--ar-latency-us`` + 2 (W-1)/W bytes / ``--ar-busbw-GBps``. Per step = 61 x attention + 1 x dense
MLP + 60 x MoE + lm_head (all per rank, measured) + communication, with no host gaps (one graph per
step). Plain decoding: tokens/s = 1 / step(1). DDTree at ``--tau`` accepted tokens per round:
tokens/s = tau / (step(T) + ``--draft-ms``), where draft-ms covers drafter + tree build + accept.

Writes ``<out>/k2_step-<gpu>.json`` and ``.md``; prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from kdtree_engine.bench_spec import device_tag  # noqa: E402
from kdtree_engine.cache import BLOCK  # noqa: E402
from kdtree_engine.config import ModelConfig, preset  # noqa: E402
from kdtree_engine.kernels.dispatch import attention_gather_index  # noqa: E402
from kdtree_engine.kernels.paged import page_rows  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.model.layers import MLP, RMSNorm, Rope  # noqa: E402
from kdtree_engine.model.mla import MLA  # noqa: E402
from kdtree_engine.model.target import DecoderLayer  # noqa: E402
from kdtree_engine.quant import k2_quantization_config, parse_quantization_config  # noqa: E402

FULL_LAYERS = 61          # K2: layer 0 dense + 60 MoE layers
DEFAULT_NODES = (1, 4, 8, 16, 32, 64, 128)
TIME_BUDGET_S = 200.0     # node counts left when this much time has passed are reported as skipped
INT4_RMS = math.sqrt(sum(v * v for v in range(-8, 8)) / 16)  # rms of the int4 values -8..7 (4.64)


# ---- configuration ---------------------------------------------------------------------------

def k2_config(layers: int) -> ModelConfig:
    """preset('k2') with only MoE layers (the dense layer 0 is timed on its own, split 8 ways)."""
    return dataclasses.replace(preset("k2"), num_hidden_layers=layers, first_k_dense_replace=0)


def tiny_config(layers: int) -> ModelConfig:
    """k2-tiny, widened just enough to split 8 ways (8 heads, 16 experts, no group routing)."""
    return dataclasses.replace(preset("k2-tiny"), num_hidden_layers=layers, first_k_dense_replace=0,
                               num_attention_heads=8, n_routed_experts=16, n_group=1, topk_group=1)


# ---- weights ---------------------------------------------------------------------------------

@torch.no_grad()
def randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights in place, drawn on the module's device; no tensor is left at zero."""
    norms = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
    g = module_group_size(module) or 32
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.dtype == torch.int32:
            t.random_(-2**31, 2**31, generator=gen)  # every nibble uniform over -8..7
        elif name.endswith("_scale"):
            s = 1.0 / (INT4_RMS * math.sqrt(t.shape[-1] * g))  # weight rms ~ 1/sqrt(K)
            t.uniform_(0.5 * s, 1.5 * s, generator=gen)
        elif id(t) in norms:
            t.uniform_(0.8, 1.2, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 0.01, generator=gen)
        elif t.dim() >= 2:
            t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)
        elif t.dim() == 1 and t.is_floating_point():
            t.uniform_(0.8, 1.2, generator=gen)


def module_group_size(module: torch.nn.Module) -> int | None:
    for m in module.modules():
        g = getattr(m, "group_size", None)
        if isinstance(g, int):
            return g
    return None


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def attention_weight_bytes(attn: MLA) -> int:
    """Weights the absorbed path reads: q_a, q_a norm, q_b, kv_a, kv_a norm, W_UK + W_UV, o."""
    w_uk, w_uv = attn.absorbed_weights()
    ts = [attn.kv_a_proj_with_mqa.weight, attn.kv_a_layernorm.weight, attn.o_proj.weight, w_uk, w_uv]
    if hasattr(attn, "q_a_proj"):
        ts += [attn.q_a_proj.weight, attn.q_a_layernorm.weight, attn.q_b_proj.weight]
    else:
        ts.append(attn.q_proj.weight)
    return nbytes(*ts)


def expert_bytes(experts) -> int:
    """INT4 packed + scale bytes (or dense bytes) of one routed expert (w13 + w2)."""
    if experts.group_size is None:
        return nbytes(experts.w13[0], experts.w2[0])
    return nbytes(experts.w13_packed[0], experts.w13_scale[0], experts.w2_packed[0], experts.w2_scale[0])


def mlp_bytes(m: MLP) -> int:
    return nbytes(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)


# ---- timing ----------------------------------------------------------------------------------

def time_us(calls: Sequence[Callable[[], object]], reps: int) -> dict:
    """Median microseconds per call; CUDA: common.time_calls (graph replay of the calls, rotated _GRAPH_ROUNDS
    times), CPU: host clock."""
    if _DEVICE.type == "cuda":
        return common.time_calls(list(calls) * _GRAPH_ROUNDS, reps=reps)
    return {"us": common.host_time_us(calls, reps), "graph": False}


def cpu_matmul_rate(n: int = 512, reps: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * n**3 / min(ts)


_DEVICE = torch.device("cpu")
# rounds of the layers' calls in one timed CUDA graph (--graph-rounds): the graph's own launch is paid once per
# replay, as one step's graph (61 layers) pays it once per step
_GRAPH_ROUNDS = 1
_POLICY = KernelPolicy()   # set by run() from --batch-invariant and the environment


# ---- tree ------------------------------------------------------------------------------------

def random_tree(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random recursive tree of T nodes (node 0 = root): ancestor-or-self mask [T, T], depths [T]."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    mask[0, 0] = True
    for i in range(1, T):
        p = int(torch.randint(0, i, (1,), generator=g))
        mask[i] = mask[p]
        mask[i, i] = True
        depth[i] = depth[p] + 1
    return mask, depth


# ---- the benchmark ---------------------------------------------------------------------------

@dataclasses.dataclass
class Assumptions:
    world: int = 8
    ar_latency_us: float = 15.0
    ar_busbw_GBps: float = 350.0
    gather_latency_us: float = 15.0
    draft_ms: float = 1.0
    tau: float = 4.0

    def allreduce_us(self, nbytes_: int) -> float:
        w = self.world
        return self.ar_latency_us + 2 * (w - 1) / w * nbytes_ / (self.ar_busbw_GBps * 1e9) * 1e6

    def text(self, hidden: int, layers: int) -> list[str]:
        return [
            f"- {self.world} GPUs of this kind; attention tensor-parallel ({self.world} ways by heads; q_a / kv_a "
            f"replicated; the latent cache replicated on every rank), routed experts expert-parallel "
            f"(n_experts / {self.world} whole experts per rank), shared expert and layer 0's dense MLP tensor-parallel, "
            f"lm_head vocab-parallel with a distributed argmax.",
            f"- Communication: 2 all-reduces of T x {hidden} bf16 per layer ({2 * layers} per step) at "
            f"{self.ar_latency_us:g} us latency + 2(W-1)/W x bytes / {self.ar_busbw_GBps:g} GB/s bus bandwidth "
            f"(NCCL ring over NVLink with NVLS off; a custom one-shot all-reduce would be ~5-8 us), plus one "
            f"all-gather of T (value, index) pairs at {self.gather_latency_us:g} us. Not measured in this run.",
            f"- The step runs as one CUDA graph per rank (no host gaps); the EP rank with the most touched "
            f"experts sets the MoE time of each layer (all ranks wait at the all-reduce).",
            f"- DDTree: tokens/s = tau / (step(T) + draft), tau = {self.tau:g} accepted tokens per round (bonus "
            f"included), draft = {self.draft_ms:g} ms per round for drafter + tree build + accept. Break-even tau = "
            f"(step(T) + draft) / step(1).",
        ]


def build_layers(cfg: ModelConfig, n: int, dtype, dev, gen, quant) -> list[DecoderLayer]:
    layers = []
    for i in range(n):
        with dev:
            layer = DecoderLayer(cfg, i, dtype=dtype, quant=quant, policy=_POLICY)
        for m in layer.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(dtype)
        layer.eval()
        randomize_(layer, gen)
        layer.self_attn.reset_absorbed()
        layers.append(layer)
    return layers


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    global _DEVICE, _GRAPH_ROUNDS, _POLICY
    _GRAPH_ROUNDS = args.graph_rounds
    clock = common.Clock()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _DEVICE = dev
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    reps = args.reps
    A = Assumptions(world=args.world, ar_latency_us=args.ar_latency_us, ar_busbw_GBps=args.ar_busbw_GBps,
                    gather_latency_us=args.gather_latency_us, draft_ms=args.draft_ms, tau=args.tau)
    # on: the engine's default (Triton attention, GEMM, norms)
    _POLICY = KernelPolicy.from_env(batch_invariant=args.batch_invariant == "on")

    cfg = tiny_config(args.layers) if args.tiny else k2_config(args.layers)
    H, N, E, K = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok
    W = A.world
    for what, v in (("num_attention_heads", N), ("n_routed_experts", E), ("moe_intermediate_size",
                                                                          cfg.moe_intermediate_size),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if v % W:
            raise SystemExit(f"--world {W} does not divide {what} = {v}")
    quant = parse_quantization_config(k2_quantization_config(32))
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    torch.manual_seed(args.seed)

    if cuda:
        copy_bw, mm_rate = common.copy_bandwidth(), common.bf16_matmul_rate()
        env = common.device_info()
    else:
        copy_bw, mm_rate = common.cpu_copy_bandwidth(), cpu_matmul_rate()
        env = {"gpu": None, "cpu": common.cpu_model(), "torch": torch.__version__}
    log(f"copy {copy_bw / 1e12:.3f} TB/s, matmul {mm_rate / 1e12:.1f} TFLOP/s ({clock():.1f} s)")

    # Fit the layers into free memory (about 9.8 GB each at K2 size), leaving room for the rest.
    n_layers = args.layers
    with torch.device("meta"):
        probe = DecoderLayer(cfg, 0, dtype=dtype, quant=quant, policy=_POLICY)
    layer_bytes = sum(nbytes(t) for t in list(probe.parameters()) + list(probe.buffers()))
    del probe
    if cuda:
        torch.cuda.empty_cache()  # the roofline buffers are cached by the allocator
        free, _ = torch.cuda.mem_get_info()
        fit = int((free - 12 * 2**30) // (layer_bytes * 1.05))
        if fit < n_layers:
            log(f"only {fit} layers fit in {free / 2**30:.0f} GiB free; using {max(fit, 1)}")
            n_layers = max(fit, 1)
    layers = build_layers(cfg, n_layers, dtype, dev, gen, quant)
    log(f"built {n_layers} layers of {layer_bytes / 1e9:.2f} GB ({clock():.1f} s)")

    # Rank-shaped pieces (one rank of W): attention with N/W heads, shared expert and dense MLP split W ways.
    cfg_r = dataclasses.replace(cfg, num_attention_heads=N // W)
    l2 = common.l2_bytes() if cuda else 0

    def copies(make, each_bytes):
        n = max(n_layers, math.ceil(3 * l2 / max(each_bytes, 1))) if cuda else n_layers
        out = []
        for _ in range(n):
            with dev:
                m = make()
            for mm in m.modules():
                if isinstance(mm, RMSNorm):
                    mm.weight.data = mm.weight.data.to(dtype)
            randomize_(m, gen)
            out.append(m)
        return out

    class RankAttn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, policy=_POLICY)
            self.self_attn = MLA(cfg_r, dtype=dtype, policy=_POLICY)

    with torch.device("meta"):
        probe_attn = MLA(cfg_r, dtype=dtype, policy=_POLICY)
    ra_bytes = sum(nbytes(p) for p in probe_attn.parameters())
    rank_attn = copies(RankAttn, ra_bytes)
    shared_r = copies(lambda: MLP(H, cfg.moe_intermediate_size * cfg.n_shared_experts // W, dtype=dtype,
                                      policy=_POLICY),
                      3 * H * cfg.moe_intermediate_size * 2 // W)
    dense_r = copies(lambda: MLP(H, cfg.intermediate_size // W, dtype=dtype, policy=_POLICY),
                     3 * H * cfg.intermediate_size * 2 // W)
    head_r = copies(lambda: torch.nn.Linear(H, cfg.vocab_size // W, bias=False, dtype=dtype),
                    H * cfg.vocab_size * 2 // W)
    final_norm = RMSNorm(H, cfg.rms_norm_eps, policy=_POLICY).to(dev, dtype)
    for ra in rank_attn:
        ra.self_attn.reset_absorbed()
    log(f"built rank pieces ({clock():.1f} s)")

    # Per-layer latent caches: context + the largest block.
    nodes = sorted(set(args.nodes) | {1})
    S = args.context
    # each layer's cache as one request's pages in order (the engine's pool layout, a one-request block table)
    pages = -(-(S + max(nodes)) // BLOCK)
    kv = [torch.randn(pages, BLOCK, cfg.kv_cache_dim, generator=gen, device=dev).to(dtype) for _ in layers]
    rope = Rope(cfg, max_positions=S + max(nodes) + 1)

    attn_w = attention_weight_bytes(layers[0].self_attn)
    router_w = nbytes(layers[0].mlp.gate.weight, layers[0].mlp.gate.e_score_correction_bias)
    shared_w = mlp_bytes(layers[0].mlp.shared_experts) if layers[0].mlp.shared_experts is not None else 0
    norms_w = nbytes(layers[0].input_layernorm.weight, layers[0].post_attention_layernorm.weight)
    exp_b = expert_bytes(layers[0].mlp.experts)
    ra_w = attention_weight_bytes(rank_attn[0].self_attn) + nbytes(rank_attn[0].input_layernorm.weight)
    sh_r_w = mlp_bytes(shared_r[0])
    dense_r_w = mlp_bytes(dense_r[0])
    head_r_w = nbytes(head_r[0].weight)
    C, R, P, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    I = cfg.moe_intermediate_size
    qk_in = cfg.q_lora_rank or H
    attn_params = (H * qk_in + qk_in * N * (P + R) + H * (C + R) + N * V * H) if cfg.q_lora_rank else \
        (H * N * (P + R) + H * (C + R) + N * V * H)

    static = {
        "attention_weight_bytes": attn_w, "router_bytes": router_w, "shared_expert_bytes": shared_w,
        "norm_bytes": norms_w, "expert_bytes": exp_b, "layer_bytes_allocated": layer_bytes,
        "rank_attention_weight_bytes": ra_w, "rank_shared_bytes": sh_r_w, "rank_dense_mlp_bytes": dense_r_w,
        "rank_lm_head_bytes": head_r_w, "kv_bytes_per_token": cfg.kv_cache_dim * torch.tensor([], dtype=dtype).element_size(),
    }
    esz = static["kv_bytes_per_token"] // cfg.kv_cache_dim
    E_r = E // W

    steps = []
    deadline_hit = False
    for T in nodes:
        row: dict = {"T": T, "kind": "decode" if T == 1 else "verify"}
        if clock() > args.time_budget:
            row["skipped"] = "time budget"
            steps.append(row)
            deadline_hit = True
            continue
        try:
            row.update(bench_step(T, S, cfg, layers, kv, rope, rank_attn, shared_r, dense_r, head_r, final_norm,
                                  dev, dtype, gen, reps, args.seed, E_r, W, log, args.profile and cuda,
                                  args.path, args.timeline and cuda))
        except Exception as exc:  # noqa: BLE001 - one failing size is reported, the rest still run
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            steps.append(row)
            continue
        # ---- bytes, flops, rooflines (single GPU, whole K2 layer) ----
        touched = row["touched_experts_mean"]
        kv_b = (S + T) * cfg.kv_cache_dim * esz + T * cfg.kv_cache_dim * esz
        attn_bytes = attn_w + kv_b + nbytes(layers[0].input_layernorm.weight)
        moe_bytes = router_w + shared_w + touched * exp_b + nbytes(layers[0].post_attention_layernorm.weight)
        attn_flops = 2 * T * attn_params + 2 * T * N * (P + V) * C + 2 * T * N * (S + T) * (C + R + C)
        moe_flops = 2 * T * E * H + 2 * T * 3 * H * I * (cfg.n_shared_experts + K)
        row["bytes"] = {"attention_weights": attn_w, "kv": kv_b, "router": router_w, "shared_expert": shared_w,
                        "routed_experts": touched * exp_b, "attention": attn_bytes, "moe": moe_bytes,
                        "layer": attn_bytes + moe_bytes}
        row["flops"] = {"attention": attn_flops, "moe": moe_flops, "layer": attn_flops + moe_flops}
        for part, b, f in (("attn", attn_bytes, attn_flops), ("moe", moe_bytes, moe_flops),
                           ("layer", attn_bytes + moe_bytes, attn_flops + moe_flops)):
            us = row.get(f"{part}_us")
            mem_us, cmp_us = b / copy_bw * 1e6, f / mm_rate * 1e6
            row[f"{part}_roofline_us"] = mem_us
            row[f"{part}_compute_us"] = cmp_us
            if us:
                row[f"{part}_x_copy"] = mem_us / us
                row[f"{part}_x_roof"] = max(mem_us, cmp_us) / us
                row[f"{part}_TBps"] = b / (us * 1e-6) / 1e12
        # ---- one rank of W ----
        rk = row["rank"]
        rank_moe_bytes = router_w + sh_r_w + rk["experts_busiest_mean"] * exp_b
        rk["attn_bytes"] = ra_w + kv_b
        rk["moe_bytes"] = rank_moe_bytes
        for part, b in (("attn", rk["attn_bytes"]), ("moe", rank_moe_bytes), ("dense_mlp", dense_r_w),
                        ("lm_head", head_r_w)):
            if rk.get(f"{part}_us"):
                rk[f"{part}_roofline_us"] = b / copy_bw * 1e6
                rk[f"{part}_x_copy"] = b / copy_bw * 1e6 / rk[f"{part}_us"]
        # ---- projection: full model, W GPUs ----
        ar = A.allreduce_us(T * H * esz)
        comm = 2 * FULL_LAYERS * ar + A.gather_latency_us
        compute = (FULL_LAYERS * rk["attn_us"] + rk["dense_mlp_us"] + (FULL_LAYERS - 1) * rk["moe_us"]
                   + rk["lm_head_us"] + row.get("index_us", 0.0))
        mem_floor = (FULL_LAYERS * rk["attn_bytes"] + dense_r_w + (FULL_LAYERS - 1) * rank_moe_bytes
                     + head_r_w) / copy_bw * 1e6
        row["projection"] = {"compute_us": compute, "comm_us": comm, "allreduce_us": ar,
                             "step_ms": (compute + comm) / 1e3, "step_floor_ms": (mem_floor + comm) / 1e3,
                             "comm_frac": comm / (compute + comm)}
        steps.append(row)
        log(f"T={T}: layer {row['layer_us']:.0f} us (x copy {row.get('layer_x_copy', 0):.2f}), "
            f"{touched:.0f} experts; rank attn {rk['attn_us']:.0f} us, moe {rk['moe_us']:.0f} us; "
            f"projected step {row['projection']['step_ms']:.2f} ms ({clock():.0f} s)")
        if cuda:
            torch.cuda.empty_cache()

    # ---- plain vs DDTree projection ----
    ok = [r for r in steps if "projection" in r]
    base = next((r for r in ok if r["T"] == 1), None)
    proj_rows = []
    if base is not None:
        t1 = base["projection"]["step_ms"]
        for r in ok:
            st = r["projection"]["step_ms"]
            if r["T"] == 1:
                tok_s, rnd = 1e3 / st, st
                be = 1.0
            else:
                rnd = st + A.draft_ms
                tok_s = A.tau * 1e3 / rnd
                be = rnd / t1
            r["projection"].update(round_ms=rnd, tokens_per_s=tok_s, breakeven_tau=be,
                                   speedup_vs_plain=tok_s / (1e3 / t1))
            proj_rows.append({"T": r["T"], **r["projection"]})
    return {
        "command": args.command, "device": env, "dtype": str(dtype).replace("torch.", ""),
        "batch_invariant": args.batch_invariant,
        "tiny": bool(args.tiny), "copy_Bps": copy_bw, "matmul_flops": mm_rate,
        "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "n_routed_experts",
                                                 "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                                                 "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "vocab_size")},
        "layers_timed": n_layers, "graph_rounds": args.graph_rounds, "context": S, "nodes": nodes, "reps": reps, "static_bytes": static,
        "assumptions": dataclasses.asdict(A), "assumptions_text": A.text(H, FULL_LAYERS),
        "full_layers": FULL_LAYERS, "steps": steps, "projection": proj_rows,
        "time_budget_hit": deadline_hit, "elapsed_s": clock(),
    }


class StepInputs:
    """What a step's layers share: its StepContext. On the static path (the engine's device round, as captured
    in its CUDA graph) the length is on the device and the attention's per-step index is built once per step
    for all layers (timed on its own: ``index_us``)."""

    def __init__(self, T: int, S: int, mask: torch.Tensor | None, kv_capacity: int, path: str,
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dev: torch.device) -> None:
        from kdtree_engine.kernels.dispatch import attention_gather_index
        from kdtree_engine.model.context import StepContext, static_visibility
        self.S, self.path = S, path
        positions = positions.to(dev)
        table = torch.arange(-(-kv_capacity // BLOCK), dtype=torch.int32, device=dev)  # pages in order
        if path == "host":
            slots = torch.arange(S, S + T, device=dev)
            self.ctx = StepContext(positions, cos, sin, slots, S, mask, table, page_rows(table, slots, BLOCK))
            return
        mask = mask if mask is not None else torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        start = torch.tensor(S, device=dev)
        self.index = lambda: attention_gather_index(_POLICY, mask)
        gather = self.index()
        visible = static_visibility(start, mask, kv_capacity) if gather is None else None
        slots = start + torch.arange(T, device=dev)
        self.ctx = StepContext(positions, cos, sin, slots, start, mask, table, page_rows(table, slots, BLOCK), visible,
                               gather, capacity=kv_capacity)

    def attn(self, attn: MLA, x: torch.Tensor, kv: torch.Tensor):
        return attn(x, self.ctx, kv)

    def layer(self, layer: DecoderLayer, h, pending, kv):
        return layer(h, pending, self.ctx, kv)


def bench_step(T, S, cfg, layers, kv, rope, rank_attn, shared_r, dense_r, head_r, final_norm, dev, dtype, gen,
               reps, seed, E_r, W, log, profile: bool = False, path: str = "static", timeline: bool = False) -> dict:
    H = cfg.hidden_size
    L = len(layers)
    if T == 1:
        mask = None
        positions = torch.tensor([S])
    else:
        mask_c, depth = random_tree(T, seed + T)
        mask = mask_c.to(dev)
        positions = S + depth
    cos, sin = rope.tables(positions)
    cos, sin = cos.to(dev), sin.to(dev)
    xs = [torch.randn(T, H, generator=gen, device=dev).to(dtype) for _ in range(L)]
    step = StepInputs(T, S, mask, kv[0].shape[0] * BLOCK, path, positions, cos, sin, dev)

    def attn_call(l):
        layer = layers[l]
        return xs[l] + step.attn(layer.self_attn, layer.input_layernorm(xs[l]), kv[l])

    def moe_call(l, h):
        layer = layers[l]
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # the previous layer's MLP output, which a layer adds in its fused input norm
    pend = [torch.randn(T, H, generator=gen, device=dev).to(dtype) for _ in range(L)]

    def layer_call(l):
        return step.layer(layers[l], xs[l], pend[l], kv[l])

    out: dict = {"path": path}
    with torch.no_grad():
        hs = [attn_call(l) for l in range(L)]  # MoE inputs (also builds W_UK / W_UV)
        ids_per_layer = []
        for l, layer in enumerate(layers):
            ids, _ = layer.mlp.gate(layer.post_attention_layernorm(hs[l]))
            ids_per_layer.append(ids)
        touched = [int(torch.unique(ids).numel()) for ids in ids_per_layer]
        out["touched_experts"] = touched
        out["touched_experts_mean"] = sum(touched) / L
        out["finite"] = all(bool(torch.isfinite(y.float()).all()) for y in layer_call(0))

        t = time_us([lambda l=l: attn_call(l) for l in range(L)], reps)
        out["attn_us"], out["graph"] = t["us"], t["graph"]
        if "graph_error" in t:
            out["graph_error"] = t["graph_error"]
        t_moe = time_us([lambda l=l: moe_call(l, hs[l]) for l in range(L)], reps)
        t_layer = time_us([lambda l=l: layer_call(l) for l in range(L)], reps)
        out["moe_us"], out["layer_us"] = t_moe["us"], t_layer["us"]
        out["graph"] = bool(t["graph"] and t_moe["graph"] and t_layer["graph"])
        if path == "static":  # the per-step attention index, once for all layers
            out["index_us"] = time_us([step.index], reps)["us"]
        for tt in (t_moe, t_layer):
            if "graph_error" in tt:
                out.setdefault("graph_error", tt["graph_error"])

        if profile:  # where a layer's time goes: device time per kernel (eager launches, no graph)
            out["profile"] = common.kernel_profile(lambda: layer_call(0), reps=5)
            out["profile_total_us"] = sum(r["us"] for r in out["profile"]["kernels"])
        if timeline:  # the same inside a CUDA graph: each kernel's start, duration and the gap before it
            out["timeline"] = common.graph_timeline(lambda: layer_call(0), reps=5)

        # ---- one rank of W: the EP rank with the most touched experts in each layer ----
        bases, busiest, pairs = [], [], []
        for ids in ids_per_layer:
            owner = ids // E_r
            counts = [int(torch.unique(ids[owner == r]).numel()) for r in range(W)]
            npairs = [int((owner == r).sum()) for r in range(W)]
            r = max(range(W), key=lambda i: (counts[i], npairs[i]))
            bases.append(r * E_r)
            busiest.append(counts[r])
            pairs.append(npairs[r])
        rank = {"experts_busiest": busiest, "experts_busiest_mean": sum(busiest) / L, "pairs_busiest": pairs}

        def rank_attn_call(i):
            m = rank_attn[i]
            l = i % L
            return xs[l] + step.attn(m.self_attn, m.input_layernorm(xs[l]), kv[l])

        rank["attn_us"] = time_us([lambda i=i: rank_attn_call(i) for i in range(len(rank_attn))], reps)["us"]

        # the kernel family the engine's MoE takes for these experts (their words are in its order)
        kind = layers[0].mlp.experts.int4_prepare(hs[0].dtype)
        if kind == "frag":
            from kdtree_engine.kernels.moe_frag import fused_moe_frag as fused
        elif kind == "triton":
            from kdtree_engine.kernels.moe_w4a16 import fused_moe_w4a16 as fused
        else:
            from kdtree_engine.kernels.moe_w4a16 import fused_moe_reference as fused
        rank["moe_kernels"] = kind

        def rank_moe_call(i):
            l = i % L
            layer, ex = layers[l], layers[l].mlp.experts
            h = hs[l]
            xn = layer.post_attention_layernorm(h)
            ids, w = layer.mlp.gate(xn)
            loc = ids - bases[l]
            loc = torch.where((loc >= 0) & (loc < E_r), loc, torch.full_like(loc, -1))
            b = slice(bases[l], bases[l] + E_r)
            routed = fused(xn, ex.w13_packed[b], ex.w13_scale[b], ex.w2_packed[b], ex.w2_scale[b], loc, w,
                           ex.group_size)
            return h + routed + shared_r[i % len(shared_r)](xn)

        n_moe = max(L, len(shared_r))
        rank["moe_us"] = time_us([lambda i=i: rank_moe_call(i) for i in range(n_moe)], reps)["us"]
        if profile:  # the rank's MoE sublayer (router, routed experts, shared expert slice) per kernel
            rank["moe_profile"] = common.kernel_profile(lambda: rank_moe_call(0), reps=5)

        def dense_call(i):
            h = xs[i % L]
            return h + dense_r[i](h)

        rank["dense_mlp_us"] = time_us([lambda i=i: dense_call(i) for i in range(len(dense_r))], reps)["us"]

        def head_call(i):
            logits = head_r[i](final_norm(xs[i % L]))
            return logits.float().max(dim=-1)

        rank["lm_head_us"] = time_us([lambda i=i: head_call(i) for i in range(len(head_r))], reps)["us"]
    out["rank"] = rank
    return out


# ---- report ----------------------------------------------------------------------------------

def _path_text(rep: dict) -> str:
    paths = {r.get("path", "host") for r in rep["steps"] if "layer_us" in r}
    if paths != {"static"}:
        return ("Layers run the host-length forward (eager generation: the attention's per-query index built in "
                "every layer).")
    idx = ", ".join(f"{r['index_us']:.1f}" for r in rep["steps"] if "index_us" in r)
    return ("Layers run the static forward of the engine's device round (what its CUDA graph captures: committed "
            "length on the device, the attention's per-query index built once per step for all layers: "
            f"{idx} us at T = {', '.join(str(r['T']) for r in rep['steps'] if 'index_us' in r)}, counted once "
            "per step in the projection).")


def markdown(rep: dict, gpu_label: str) -> list[str]:
    A = rep["assumptions"]
    cfgd = rep["config"]
    lines = [f"# One Kimi K2 decoder step per layer, and the projected 61-layer model on {A['world']} GPUs "
             f"({gpu_label})", "",
             f"Command: `{rep['command']}`", "",
             f"Device: {', '.join(f'{k} {v}' for k, v in rep['device'].items() if v is not None)}; "
             f"dtype {rep['dtype']}; batch invariance {rep.get('batch_invariant', 'off')} (on: dense matmuls, "
             "RMSNorm and MLA attention through the batch-invariant Triton kernels, as the engine runs by default; "
             "off: cuBLAS and the torch attention).",
             f"Measured rooflines: copy {rep['copy_Bps'] / 1e12:.3g} TB/s (read + write), matmul "
             f"{rep['matmul_flops'] / 1e12:.3g} TFLOP/s. {rep['layers_timed']} MoE layers built "
             f"(hidden {cfgd['hidden_size']}, {cfgd['num_attention_heads']} heads, {cfgd['n_routed_experts']} experts "
             f"top-{cfgd['num_experts_per_tok']}, INT4 g32 experts), latent cache of {rep['context']} tokens, "
             f"random weights; T = 1 causal decode, T > 1 random tree. {_path_text(rep)}", "",
             "x copy = bytes that must be read / copy bandwidth / measured time (attention: bf16 weights + latent "
             "cache; MoE: router + shared expert + INT4 bytes of the distinct experts the router chose in that step). "
             "x roof = max(memory time, FLOPs / matmul rate) / time. Times per layer: median of CUDA-graph replays "
             f"rotating over the layers' weights ({rep['layers_timed'] * rep.get('graph_rounds', 1)} layer calls per "
             "graph).", "",
             "## Single GPU, whole K2 layer", ""]
    rows = []
    for r in rep["steps"]:
        if "layer_us" not in r:
            rows.append([r["T"], None, None, None, None, None, None, None, r.get("skipped") or r.get("error")])
            continue
        rows.append([r["T"], r["touched_experts_mean"], r["bytes"]["layer"] / 1e6, r["attn_us"], r.get("attn_x_copy"),
                     r["moe_us"], r.get("moe_x_copy"), r["layer_us"], r.get("layer_x_copy"), r.get("layer_x_roof"),
                     r["graph"]])
    lines += common.md_table(["T", "experts", "MB read", "attn us", "attn x copy", "moe us", "moe x copy",
                              "layer us", "layer x copy", "layer x roof", "graph"], rows)
    lines += ["", f"## One rank of {A['world']} (TP{A['world']} attention, EP{A['world']} experts: busiest rank)", ""]
    rows = []
    for r in rep["steps"]:
        rk = r.get("rank")
        if not rk:
            continue
        rows.append([r["T"], rk["experts_busiest_mean"], rk["attn_us"], rk.get("attn_x_copy"), rk["moe_us"],
                     rk.get("moe_x_copy"), rk["dense_mlp_us"], rk["lm_head_us"]])
    lines += common.md_table(["T", "rank experts", "attn us", "attn x copy", "moe us", "moe x copy", "dense MLP us",
                              "lm_head us"], rows)
    lines += ["", f"## Projection: full {rep['full_layers']}-layer model on {A['world']} GPUs", "",
              "Assumptions:", *rep["assumptions_text"], ""]
    rows = [[p["T"], p["compute_us"] / 1e3, p["comm_us"] / 1e3, p["step_ms"], p["step_floor_ms"], p["round_ms"],
             p["tokens_per_s"], p["speedup_vs_plain"], p["breakeven_tau"]] for p in rep["projection"]]
    lines += common.md_table(["T", "compute ms", "comm ms", "step ms", "floor ms (copy bw)", "round ms",
                              f"tok/s (T=1 plain; else tau={A['tau']:g})", "vs plain", "break-even tau"], rows)
    lines += ["", "floor = every rank's bytes at copy bandwidth + the same communication."]
    for r in rep["steps"]:
        if r.get("profile"):
            lines += ["", f"## Kernels of one layer at T = {r['T']} (torch.profiler, eager launches: "
                      f"{r['profile_total_us']:.0f} us of device time against {r['layer_us']:.0f} us per graph replay)", "",
                      "A dependent launch (kernels/pdl.py) starts before the kernel ahead of it ends and waits for "
                      "it, so its device time here includes that wait (e.g. the MoE's SwiGLU while the gate/up GEMM "
                      "finishes); the graph-replay times above are the real ones.", ""]
            for what in ("kernels", "ops"):
                lines += common.md_table([what[:-1], "calls", "us", "share"],
                                         [[k["name"][:110].replace("|", "/"), k["calls"], k["us"],
                                           f"{k['us'] / r['profile_total_us']:.0%}"] for k in r["profile"][what]])
                lines.append("")
        tl = r.get("timeline") or {}
        if tl.get("kernels"):
            lines += ["", f"## One layer at T = {r['T']} inside a CUDA graph (torch.profiler over replays: span "
                      f"{tl['span_us']:.1f} us, kernels busy {tl['busy_us']:.1f} us)", "",
                      "start: from the first kernel's start; gap: idle device time before the kernel (negative: it "
                      "overlapped the kernel before it, a dependent launch or a forked stream).", ""]
            lines += common.md_table(["#", "kernel", "start us", "us", "gap us"],
                                     [[i, k["name"][:90].replace("|", "/"), k["start_us"], k["us"], k["gap_us"]]
                                      for i, k in enumerate(tl["kernels"])])
        elif tl.get("error"):
            lines += ["", f"Timeline at T = {r['T']}: {tl['error']}"]
        rk = r.get("rank") or {}
        if rk.get("moe_profile"):
            total = sum(k["us"] for k in rk["moe_profile"]["kernels"])
            lines += ["", f"## Kernels of one rank's MoE sublayer at T = {r['T']} (torch.profiler, eager launches: "
                      f"{total:.0f} us of device time against {rk['moe_us']:.0f} us per graph replay)", ""]
            lines += common.md_table(["kernel", "calls", "us", "share"],
                                     [[k["name"][:110].replace("|", "/"), k["calls"], k["us"], f"{k['us'] / total:.0%}"]
                                      for k in rk["moe_profile"]["kernels"]])
    lines += ["", f"Elapsed {rep['elapsed_s']:.0f} s."]
    return lines


def short_table(rep: dict) -> str:
    A = rep["assumptions"]
    out = [f"{'T':>4} {'experts':>7} {'layer us':>9} {'x copy':>6} {'rank us':>8} {'step ms':>8} "
           f"{'tok/s':>7} {'be tau':>6}"]
    for r in rep["steps"]:
        if "projection" not in r:
            out.append(f"{r['T']:>4} {r.get('skipped') or r.get('error', '')}")
            continue
        p = r["projection"]
        rk = r["rank"]
        out.append(f"{r['T']:>4} {r['touched_experts_mean']:>7.1f} {r['layer_us']:>9.1f} "
                   f"{r.get('layer_x_copy', float('nan')):>6.3f} {rk['attn_us'] + rk['moe_us']:>8.1f} "
                   f"{p['step_ms']:>8.2f} {p.get('tokens_per_s', float('nan')):>7.1f} "
                   f"{p.get('breakeven_tau', float('nan')):>6.2f}")
    out.append(f"(tok/s: T=1 plain decoding; T>1 DDTree at tau={A['tau']:g} with {A['draft_ms']:g} ms draft; "
               f"{A['world']} GPUs, comm assumed)")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--layers", type=int, default=None, help="MoE layers to build (default 4; --tiny 2)")
    ap.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                    help="verify sizes T, comma separated (T=1 = plain decode; default 1,4,8,16,32,64,128)")
    ap.add_argument("--context", type=int, default=None, help="latent cache tokens (default 4096; --tiny 64)")
    ap.add_argument("--tiny", action="store_true", help="k2-tiny dims (CPU smoke test)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays per measurement (default 20; --tiny 3)")
    ap.add_argument("--graph-rounds", type=int, default=1,
                    help="rounds of the layers' calls in one timed CUDA graph (default 1: --layers calls)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tau", type=float, default=4.0, help="DDTree accepted tokens per round for the projection")
    ap.add_argument("--draft-ms", type=float, default=1.0, help="drafter + tree build + accept per round (ms)")
    ap.add_argument("--world", type=int, default=8, help="GPUs of the projection")
    ap.add_argument("--ar-latency-us", type=float, default=15.0, help="all-reduce latency (us)")
    ap.add_argument("--ar-busbw-GBps", type=float, default=350.0, help="all-reduce bus bandwidth (GB/s)")
    ap.add_argument("--gather-latency-us", type=float, default=15.0, help="argmax all-gather latency (us)")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="on",
                    help="on (the engine's default): dense matmuls, RMSNorm and MLA attention through the batch-"
                         "invariant Triton kernels; off: cuBLAS and the torch attention")
    ap.add_argument("--path", choices=("static", "host"), default="static",
                    help="static (the engine's device round, captured in its CUDA graph): device-side length, the "
                         "attention's per-query index built once per step for all layers; host: the host-length "
                         "forward (eager generation), which builds that index in every layer")
    ap.add_argument("--profile", action="store_true",
                    help="also list the device time per kernel of one layer at each T (torch.profiler, CUDA)")
    ap.add_argument("--timeline", action="store_true",
                    help="also list each kernel of one layer inside a CUDA graph at each T: start, duration, the gap "
                         "before it (torch.profiler over graph replays)")
    ap.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                    help="seconds after which the remaining node counts are skipped")
    a = ap.parse_args(argv)
    a.layers = a.layers or (2 if a.tiny else 4)
    a.nodes = a.nodes or ([1, 4, 8] if a.tiny else list(DEFAULT_NODES))
    a.context = a.context or (64 if a.tiny else 4096)
    a.reps = a.reps or (3 if a.tiny else 20)
    if a.layers < 1 or a.context < 1 or a.graph_rounds < 1 or any(t < 1 for t in a.nodes):
        ap.error("--layers, --context, --graph-rounds and --nodes must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    args.command = common.command_line(argv, "python3 bench/k2_step.py")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if dev.type == "cpu" and args.tiny:
        torch.set_num_threads(1)  # tiny matmuls: extra threads only add contention
    try:
        rep = run(args, log)
    finally:
        torch.set_num_threads(threads)
    tag = device_tag(dev)
    label = rep["device"].get("gpu") or rep["device"].get("cpu") or tag
    jp, mp = common.write_results(args.out, f"k2_step-{tag}", rep, markdown(rep, label), command=args.command,
                                  device=dev)
    print(f"wrote {jp} and {mp}")
    print(short_table(rep))
    return rep


if __name__ == "__main__":
    main()
