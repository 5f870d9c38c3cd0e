"""The BF16 and FP8 weight formats' kernels at K2 shapes, against copy bandwidth and cuBLAS.

    python bench/moe_formats.py --out bench/results            # H200: K2 shapes
    python bench/moe_formats.py --tiny --device cpu --out DIR  # CPU smoke run (the torch paths)

1. Routed experts (384 experts top-8, hidden 7168, moe inter 2048; T = 1, 4, 16, 64 tokens, each token's experts
   drawn at random without repeats): the engine's ``moe()`` on BF16 experts and on FP8 block-quantized experts
   (kernels/moe_grouped.py on CUDA). x copy = (bytes of the touched experts / copy bandwidth measured in the same
   run) / time: 1.0 would be a copy of exactly those bytes. The FP8 bytes include the block scales.
2. Dense linears of K2 (q_a, q_b, kv_a, kv_b, o, the dense MLP's gate and down) at M = 1, 2, 4, 8, 16 tokens: the
   engine's FP8 linear (kernels/w8a16.py on CUDA), BF16 ``F.linear`` (cuBLAS) and the engine's batch-invariant
   BF16 GEMM (kernels/gemm.py), with speedup = F.linear time / W8A16 time, x copy of the FP8 weight bytes, and the
   W8A16 result's relative error against BF16 math on the dequantized weights.

Timing (CUDA): bench/common.time_calls, CUDA-graph replays over rotating inputs (several routings, several
weight copies for the small linears) so the weights come from HBM, not L2. CPU: host clock, a few repetitions.
Writes ``<out>/moe_formats-<device>.json`` and ``.md`` with the run's metadata.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from kdtree_engine.bench_spec import device_tag  # noqa: E402
from kdtree_engine.config import ModelConfig, preset  # noqa: E402
from kdtree_engine.fp8 import Fp8Block, dequantize_fp8  # noqa: E402
from kdtree_engine.kernels.dispatch import dense_matmul, grouped_moe_backend, w8a16_backend  # noqa: E402
from kdtree_engine.kernels.moe_grouped import GroupedConfig  # noqa: E402
from kdtree_engine.kernels.w8a16 import W8Config  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.model.layers import Linear  # noqa: E402
from kdtree_engine.model.moe import Experts  # noqa: E402

BLOCK = Fp8Block(128, 128)
TINY_BLOCK = Fp8Block(16, 16)
TOKENS = (1, 4, 16, 64)
ROWS = (1, 2, 4, 8, 16)


def k2_linears(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """K2's dense linears that the FP8 release quantizes: name -> (N, K)."""
    nh, h = cfg.num_attention_heads, cfg.hidden_size
    return {
        "q_a_proj": (cfg.q_lora_rank, h), "q_b_proj": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
        "kv_a_proj_with_mqa": (cfg.kv_cache_dim, h), "kv_b_proj": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                                  cfg.kv_lora_rank),
        "o_proj": (h, nh * cfg.v_head_dim), "mlp.gate_proj": (cfg.intermediate_size, h),
        "mlp.down_proj": (h, cfg.intermediate_size),
    }


def moe_shape(cfg: ModelConfig) -> str:
    return (f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, "
            f"moe inter {cfg.moe_intermediate_size}")


def tiny_config() -> ModelConfig:
    return preset("k2-tiny").replace(n_group=1, topk_group=1, n_routed_experts=16, num_experts_per_tok=4)


# ---- timing and bandwidth (shared with bench/moonlight.py) ------------------------------------------

def time_us(calls: Sequence[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Median microseconds per call: CUDA graph replays (common.time_calls), or the host clock on the CPU."""
    if device.type == "cuda":
        return common.time_calls(list(calls), reps=reps)["us"]
    return common.host_time_us(calls, reps)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a device-to-device copy, measured now."""
    return common.copy_bandwidth() if device.type == "cuda" else common.cpu_copy_bandwidth()


def env_info(device: torch.device) -> dict:
    if device.type == "cuda":
        return common.device_info()
    return {"gpu": None, "cpu": common.cpu_model(), "torch": torch.__version__}


def write(out: str, name: str, rep: dict, markdown: Callable[[dict, str], list[str]], device: torch.device) -> dict:
    """<out>/<name>-<device tag>.json and .md with the run's metadata; returns rep."""
    tag = device_tag(device)
    label = rep["device"].get("gpu") or rep["device"].get("cpu") or tag
    jp, mp = common.write_results(out, f"{name}-{tag}", rep, markdown(rep, label), command=rep["command"],
                                  device=device)
    print(f"wrote {jp} and {mp}")
    return rep


# ---- random weights on the device -------------------------------------------------------------------

@torch.no_grad()
def random_fp8_(weight: torch.Tensor, scale_inv: torch.Tensor, gen: torch.Generator) -> None:
    """FP8 values spread over the e4m3 range and block scales giving a weight rms of about 1/sqrt(K)."""
    k = weight.shape[-1]
    for i in range(weight.shape[0] if weight.dim() == 3 else 1):   # one expert at a time: no float32 copy of all
        w = weight[i] if weight.dim() == 3 else weight
        w.copy_((torch.randn(w.shape, device=w.device, generator=gen, dtype=torch.bfloat16) * 64).clamp(-448, 448))
    scale_inv.uniform_(0.5 / (64 * math.sqrt(k)), 1.5 / (64 * math.sqrt(k)), generator=gen)


@torch.no_grad()
def random_dense_(w: torch.Tensor, gen: torch.Generator) -> None:
    for i in range(w.shape[0] if w.dim() == 3 else 1):
        t = w[i] if w.dim() == 3 else w
        t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)


def experts_of(cfg: ModelConfig, block: Fp8Block | None, dtype: torch.dtype, device: torch.device,
               policy: KernelPolicy, gen: torch.Generator) -> Experts:
    with device:
        ex = Experts(cfg, dtype=dtype, group_size=block, policy=policy)
    if block is None:
        random_dense_(ex.w13, gen)
        random_dense_(ex.w2, gen)
    else:
        random_fp8_(ex.w13, ex.w13_scale_inv, gen)
        random_fp8_(ex.w2, ex.w2_scale_inv, gen)
    return ex


def expert_bytes(ex: Experts) -> int:
    """Bytes of one routed expert (w13 + w2, plus the FP8 block scales)."""
    ts = [ex.w13[0], ex.w2[0]] + ([ex.w13_scale_inv[0], ex.w2_scale_inv[0]] if ex.fp8_block is not None else [])
    return sum(t.numel() * t.element_size() for t in ts)


# ---- the two measurements ---------------------------------------------------------------------------

def bench_moe(cfg: ModelConfig, block: Fp8Block, dtype: torch.dtype, device: torch.device, policy: KernelPolicy,
              tokens: Sequence[int], reps: int, rotations: int, copy_bw: float, wgen: torch.Generator,
              gen: torch.Generator, log: Callable[[str], None]) -> list[dict]:
    """wgen: the weights' generator (on the device); gen: the inputs' (host)."""
    rows = []
    E, k, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    for fmt, blk in ((str(dtype).removeprefix("torch."), None), ("fp8", block)):
        ex = experts_of(cfg, blk, dtype, device, policy, wgen)
        per_expert = expert_bytes(ex)
        for T in tokens:
            sets = []
            for _ in range(rotations):
                ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device)
                w = torch.rand(T, k, generator=gen).to(device)
                x = torch.randn(T, H, generator=gen).to(device, dtype)
                sets.append((x, ids, w))
            touched = statistics.mean(len(torch.unique(ids)) for _, ids, _ in sets)
            calls = [lambda s=s: ex(s[0], s[1], s[2], None, False) for s in sets]
            us = time_us(calls, device, reps)
            nbytes = touched * per_expert
            row = {"format": fmt, "T": T, "us": us, "touched_experts": touched, "bytes": nbytes,
                   "x_copy": nbytes / copy_bw * 1e6 / us, "TBps": nbytes / (us * 1e-6) / 1e12,
                   "backend": grouped_moe_backend(policy, sets[0][0], blk)}
            rows.append(row)
            log(f"MoE {fmt} T={T}: {us:.1f} us, {touched:.0f} experts, x copy {row['x_copy']:.2f}")
        del ex
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def weight_copies(n: int, k: int, copies: int, block: Fp8Block, dtype: torch.dtype, device: torch.device,
                  policy: KernelPolicy, wgen: torch.Generator) -> tuple[list[Linear], list[torch.Tensor]]:
    """`copies` random FP8 linears [n, k] and as many random dense weights of the activation dtype."""
    lins, dense = [], []
    for _ in range(copies):
        with device:
            lin = Linear(k, n, group_size=block, dtype=dtype, policy=policy)
        random_fp8_(lin.weight, lin.weight_scale_inv, wgen)
        lins.append(lin)
        d = torch.empty(n, k, device=device, dtype=dtype)
        random_dense_(d, wgen)
        dense.append(d)
    return lins, dense


def bench_dense(shapes: dict[str, tuple[int, int]], block: Fp8Block, dtype: torch.dtype, device: torch.device,
                policy: KernelPolicy, rows_m: Sequence[int], reps: int, copies_bytes: int, copy_bw: float,
                wgen: torch.Generator, gen: torch.Generator, log: Callable[[str], None]) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        copies = max(1, min(16, -(-copies_bytes // (n * k))))   # rotating copies: together past L2
        lins, dense = weight_copies(n, k, copies, block, dtype, device, policy, wgen)
        fp8_bytes = n * k + lins[0].weight_scale_inv.numel() * 4
        for M in rows_m:
            xs = [torch.randn(M, k, generator=gen).to(device, dtype) for _ in range(copies)]
            t_fp8 = time_us([lambda x=x, l=l: l(x) for x, l in zip(xs, lins)], device, reps)
            t_cublas = time_us([lambda x=x, d=d: F.linear(x, d) for x, d in zip(xs, dense)], device, reps)
            t_bi = time_us([lambda x=x, d=d: dense_matmul(policy, x, d) for x, d in zip(xs, dense)], device, reps)
            # the W8A16 result against BF16 math on the same (dequantized) weights: the arithmetic's own error
            deq = dequantize_fp8(lins[0].weight, lins[0].weight_scale_inv, block, dtype)
            want = F.linear(xs[0], deq).double()
            err = float((lins[0](xs[0]).double() - want).norm() / want.norm())
            row = {"linear": name, "N": n, "K": k, "M": M, "w8a16_us": t_fp8, "f_linear_us": t_cublas,
                   "bi_gemm_us": t_bi, "speedup_vs_f_linear": t_cublas / t_fp8,
                   "x_copy": fp8_bytes / copy_bw * 1e6 / t_fp8, "rel_err_vs_bf16": err,
                   "backend": w8a16_backend(policy, xs[0])}
            out.append(row)
            log(f"{name} [{n} x {k}] M={M}: W8A16 {t_fp8:.1f} us, F.linear {t_cublas:.1f} us "
                f"({row['speedup_vs_f_linear']:.2f}x), x copy {row['x_copy']:.2f}")
        del lins, dense
    return out


# ---- --sweep: candidate kernel configs (speed only: each keeps a row's result independent of M / T) -------------

def moe_candidates() -> list[GroupedConfig]:
    out = [GroupedConfig(BLOCK_N=bn, num_warps=4, num_stages=st) for bn in (32, 64, 128) for st in (3, 4, 5)]
    out += [GroupedConfig(BLOCK_N=bn, num_warps=8, num_stages=st) for bn in (64, 128) for st in (3, 4)]
    # the gate/up launch split along H and the down launch's along I (more programs at one token), on the default
    out += [GroupedConfig(BLOCK_N=64, num_warps=4, num_stages=3, SPLIT_K=sk, SPLIT_K2=sk2)
            for sk, sk2 in ((2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (8, 2), (4, 4))]
    return out


def dense_candidates() -> list[W8Config]:
    return [W8Config(BLOCK_N=bn, num_stages=st, target_programs=tp)
            for bn in (32, 64, 128) for st in (4, 6) for tp in (264, 1056, 4224)]


def fits(run: Callable[[], float], config: object, log: Callable[[str], None]) -> float | None:
    """run()'s time, or None for a config whose kernel does not fit the device (shared memory, registers)."""
    from triton.runtime.errors import OutOfResources
    try:
        return run()
    except OutOfResources as exc:
        log(f"sweep: {config} does not fit: {exc}")
        return None


def sweep_moe(label: str, cfg: ModelConfig, block: Fp8Block | None, dtype: torch.dtype, device: torch.device,
              policy: KernelPolicy, tokens: Sequence[int], reps: int, copy_bw: float, wgen: torch.Generator,
              gen: torch.Generator, log: Callable[[str], None]) -> list[dict]:
    """The grouped MoE (FP8 experts with `block`, else dense ones) at every candidate config and T (one config
    serves every T: batch invariance)."""
    from kdtree_engine.kernels.moe_grouped import fused_moe_grouped
    E, k, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    ex = experts_of(cfg, block, dtype, device, policy, wgen)
    per_expert = expert_bytes(ex)
    inputs = {}
    for T in tokens:
        sets = []
        for _ in range(4):
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device)
            sets.append((torch.randn(T, H, generator=gen).to(device, dtype), ids, torch.rand(T, k, generator=gen).to(device)))
        inputs[T] = (sets, statistics.mean(len(torch.unique(i)) for _, i, _ in sets))
    rows = []
    for c in moe_candidates():
        for T, (sets, touched) in inputs.items():
            kw = dict(w13_scale_inv=ex.w13_scale_inv, w2_scale_inv=ex.w2_scale_inv, block=block) if block else {}
            calls = [lambda s=s: fused_moe_grouped(s[0], ex.w13, ex.w2, s[1], s[2], config=c, **kw) for s in sets]
            us = fits(lambda: time_us(calls, device, reps), c, log)
            if us is None:
                break
            rows.append({"experts": label, "config": repr(c), "T": T, "us": us,
                         "x_copy": touched * per_expert / copy_bw * 1e6 / us})
            log(f"sweep MoE {label} {c} T={T}: {us:.1f} us, x copy {rows[-1]['x_copy']:.3f}")
    del ex
    torch.cuda.empty_cache()
    return rows


def sweep_dense(shapes: dict[str, tuple[int, int]], block: Fp8Block, dtype: torch.dtype, device: torch.device,
                policy: KernelPolicy, rows_m: Sequence[int], reps: int, copies_bytes: int,
                wgen: torch.Generator, gen: torch.Generator, log: Callable[[str], None]) -> list[dict]:
    """W8A16 at every candidate config per K2 shape and M, with BF16 F.linear's time beside it."""
    from kdtree_engine.kernels.w8a16 import w8a16_linear
    out = []
    for name, (n, k) in shapes.items():
        copies = max(1, min(16, -(-copies_bytes // (n * k))))
        lins, dense = weight_copies(n, k, copies, block, dtype, device, policy, wgen)
        for M in rows_m:
            xs = [torch.randn(M, k, generator=gen).to(device, dtype) for _ in range(copies)]
            t_ref = time_us([lambda x=x, d=d: F.linear(x, d) for x, d in zip(xs, dense)], device, reps)
            for c in dense_candidates():
                us = fits(lambda: time_us([lambda x=x, l=l: w8a16_linear(x, l.weight, l.weight_scale_inv, block,
                                                                         config=c)
                                           for x, l in zip(xs, lins)], device, reps), c, log)
                if us is None:
                    continue
                out.append({"linear": name, "N": n, "K": k, "M": M, "config": repr(c), "us": us,
                            "f_linear_us": t_ref, "speedup_vs_f_linear": t_ref / us})
            best = min((r for r in out if r["linear"] == name and r["M"] == M), key=lambda r: r["us"])
            log(f"sweep {name} M={M}: F.linear {t_ref:.1f} us, best {best['us']:.1f} us {best['config']}")
        del lins, dense
    return out


def sweep_markdown(rep: dict) -> list[str]:
    """Per MoE config: us at each T and the sum; per dense shape: the 5 configs with the least summed time over M."""
    lines = []
    for label in dict.fromkeys(r["experts"] for r in rep["sweep_moe"]):
        lines += ["", f"## Sweep: grouped MoE configs, {label} (one config for every T)", ""]
        mine = [r for r in rep["sweep_moe"] if r["experts"] == label]
        ts = sorted({r["T"] for r in mine})
        by: dict[str, dict[int, dict]] = {}
        for r in mine:
            by.setdefault(r["config"], {})[r["T"]] = r
        order = sorted(by, key=lambda c: sum(by[c][t]["us"] for t in ts))
        lines += common.md_table(["config"] + [f"T={t} us (x copy)" for t in ts] + ["sum us"],
                                 [[c] + [f"{by[c][t]['us']:.1f} ({by[c][t]['x_copy']:.3f})" for t in ts]
                                  + [sum(by[c][t]["us"] for t in ts)] for c in order])
    lines += ["", "## Sweep: W8A16 configs per K2 shape (the 5 with the least time summed over M)", ""]
    body = []
    for name in dict.fromkeys(r["linear"] for r in rep["sweep_dense"]):
        rows = [r for r in rep["sweep_dense"] if r["linear"] == name]
        ms = sorted({r["M"] for r in rows})
        cfgs: dict[str, dict[int, dict]] = {}
        for r in rows:
            cfgs.setdefault(r["config"], {})[r["M"]] = r
        for c in sorted(cfgs, key=lambda c: sum(cfgs[c][m]["us"] for m in ms))[:5]:
            body.append([name, c] + [f"{cfgs[c][m]['us']:.1f} ({cfgs[c][m]['speedup_vs_f_linear']:.2f}x)"
                                     for m in ms])
    lines += common.md_table(["linear", "config", "us (x F.linear) at M = " + ", ".join(map(str, ms))]
                             + [""] * (len(ms) - 1), body)
    return lines


def markdown(rep: dict, label: str) -> list[str]:
    lines = [f"# Weight formats at {'tiny' if rep['tiny'] else 'K2'} shapes: fused BF16 / FP8 MoE and W8A16", "",
             f"Device: {label}. Copy bandwidth (read + write) {rep['copy_Bps'] / 1e12:.2f} TB/s, measured in this run. "
             f"MoE: {rep['moe_shape']}. x copy = (bytes touched / copy bandwidth) / time.", "", "## Routed experts", ""]
    lines += common.md_table(["format", "T", "us", "touched experts", "MB", "x copy", "TB/s", "backend"],
                             [[r["format"], r["T"], r["us"], r["touched_experts"], r["bytes"] / 1e6, r["x_copy"],
                               r["TBps"], r["backend"]] for r in rep["moe"]])
    lines += ["", "## Dense linears: FP8 W8A16 vs BF16", ""]
    lines += common.md_table(["linear", "N x K", "M", "W8A16 us", "F.linear us", "BI GEMM us", "speedup vs F.linear",
                              "x copy", "rel. error vs BF16", "backend"],
                             [[r["linear"], f"{r['N']} x {r['K']}", r["M"], r["w8a16_us"], r["f_linear_us"],
                               r["bi_gemm_us"], r["speedup_vs_f_linear"], r["x_copy"], r["rel_err_vs_bf16"],
                               r["backend"]] for r in rep["dense"]])
    lines += ["", "rel. error vs BF16: ||W8A16(x) - F.linear(x, dequantized W in the activation dtype)|| / ||F.linear||."]
    if rep.get("sweep_moe") is not None:
        lines += sweep_markdown(rep)
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tiny", action="store_true", help="k2-tiny shapes (CPU smoke run)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                    help="MoE token counts (default 1,4,16,64)")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                    help="dense rows M (default 1,2,4,8,16)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default 20; --tiny 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true",
                    help="also time every candidate config of the FP8 MoE and W8A16 kernels (record moe_formats_sweep)")
    a = ap.parse_args(argv)
    a.tokens = a.tokens or ([1, 4] if a.tiny else list(TOKENS))
    a.rows = a.rows or ([1, 4] if a.tiny else list(ROWS))
    a.reps = a.reps or (3 if a.tiny else 20)
    if any(t < 1 for t in a.tokens + a.rows) or a.reps < 1:
        ap.error("--tokens, --rows and --reps must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    command = common.command_line(argv, "python3 bench/moe_formats.py")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cfg = tiny_config() if args.tiny else preset("k2")
    block = TINY_BLOCK if args.tiny else BLOCK
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    policy = KernelPolicy.from_env()
    wgen = torch.Generator(device=dev).manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    copy_bw = copy_bandwidth(dev)
    l2 = common.l2_bytes() if dev.type == "cuda" else 1 << 20
    rotations = 1 if args.tiny else 4
    moe_rows = bench_moe(cfg, block, dtype, dev, policy, args.tokens, args.reps, rotations, copy_bw, wgen, gen, log)
    dense_rows = bench_dense(k2_linears(cfg), block, dtype, dev, policy, args.rows, args.reps, 2 * l2, copy_bw,
                             wgen, gen, log)
    rep = {"command": command, "tiny": args.tiny, "device": env_info(dev), "dtype": str(dtype).removeprefix("torch."),
           "copy_Bps": copy_bw, "block": [block.n, block.k],
           "moe_shape": moe_shape(cfg),
           "moe": moe_rows, "dense": dense_rows}
    if args.sweep:
        # FP8 experts at K2's shape; BF16 experts at Moonlight-16B's (64 experts top-6, hidden 2048, inter 1408)
        small = tiny_config() if args.tiny else preset("moonlight-16b")
        rep["sweep_moe"] = (
            sweep_moe(f"fp8 {moe_shape(cfg)}", cfg, block, dtype, dev, policy, args.tokens, args.reps, copy_bw,
                      wgen, gen, log)
            + sweep_moe(f"{str(dtype).removeprefix('torch.')} {moe_shape(small)}", small, None, dtype, dev, policy,
                        args.tokens, args.reps, copy_bw, wgen, gen, log))
        rep["sweep_dense"] = sweep_dense(k2_linears(cfg), block, dtype, dev, policy, sorted({1, 4, 16} & set(args.rows)),
                                         args.reps, 2 * l2, wgen, gen, log)
    return write(args.out, "moe_formats_sweep" if args.sweep else "moe_formats", rep, markdown, dev)


if __name__ == "__main__":
    main()
