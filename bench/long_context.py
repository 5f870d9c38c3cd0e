"""Long context on one GPU: prefill throughput, decode and tree-verify steps over a long cache, time to first token.

    python3 bench/long_context.py --out bench/results                              # one H200, every part
    python3 bench/long_context.py --parts prefill --prompts 131072 --layers 8 --label ttft --out DIR
    python3 bench/long_context.py --tiny --device cpu --out DIR                    # CPU smoke run

Parts (``--parts``, default all):

prefill   ``Target.prefill`` (the engine's chunked prefill, default chunk) of ``--prompts`` random tokens on the K2
          one-rank model (bench/k2_model.py's builder: rank 0 of TP8 / EP8, INT4 routed experts with uniform routes,
          bf16 elsewhere; ``--layers`` of its 61, random weights) and on the demo model (its checkpoint; prompts past
          its 4096 positions are a throughput figure only). Each distinct chunk length is prefilled once untimed
          (compiles), then the prompt is timed (median of ``--reps`` up to 8K tokens, one run beyond). TTFT = the
          prefill plus the greedy pick of the first token. FLOPs counted per rank: 2 x in x out of every linear per
          token (kv_b_proj aside), the router (float32), the routed experts' 3 products for each local route (the
          expected local share of top-k under uniform routes; every route for the demo), the lm_head of the last
          token, and per chunk the attention of the form the engine chooses (model/prefill.py: the key-side
          expansion of the naive form over all keys of the chunk, scores and values over the causal pairs only).
          Achieved TFLOP/s against the bf16 matmul rate measured in this run (an 8192^3 torch.matmul).
steps     a decode step (1 token) and a tree verify (``--nodes``, a random tree) at ``--contexts`` tokens on the K2
          one-rank model: the target's device-resident forward, captured in a CUDA graph and replayed. The cache
          pool is filled with random latents (normal, the model dtype) and the committed length set directly
          (no prefill: the attention reads the same bytes). Byte roofline = (weights the step touches: attention
          as the absorbed path reads it, norms, router, shared / dense MLP, lm_head, the local experts the step
          routes to, counted in one eager run; + the latent cache of context + nodes, 576 x 2 bytes a token a
          layer) / the copy bandwidth measured in this run.
demo      the demo engine (``LLM``, its drafter, DDTree 16) after its start-up warm-up (kdtree_engine/warmup.py,
          timed and recorded): TTFT (``stats["prefill_s"]``: prefill + first token) of a ~100-token prompt
          (``--ttft-reps`` runs, median) and of ``--demo-prompts`` prompts of random lengths in
          ``--demo-lengths`` (seed printed): median, max / median (the goal: under 5 ms, no prompt above 2x the
          median), and the kernel variants compiled during those prompts (the goal: none).

``--layers N`` < 61 times N layers and also reports a 61-layer projection (linear in the layers: the embedding
and the last token's lm_head are counted as if per layer, an over-estimate). Writes ``<out>/long_context[-LABEL]-
<device>.json`` and ``.md`` after every measured row (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
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
from bench.k2_model import (CountingCommunicator, build, draft_config, k2_config, tiny_config,  # noqa: E402
                            touched_local_experts)
from bench.k2_step import attention_weight_bytes, nbytes, random_tree  # noqa: E402
from kdtree_engine import LLM, SamplingParams  # noqa: E402
from kdtree_engine.bench_spec import device_tag  # noqa: E402
from kdtree_engine.cache import bytes_per_token  # noqa: E402
from kdtree_engine.config import ModelConfig  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.model.layers import Linear  # noqa: E402
from kdtree_engine.model.moe import MoE  # noqa: E402
from kdtree_engine.model.prefill import choose_form, plan_chunks, resolve_chunk  # noqa: E402
from kdtree_engine.model.target import Target  # noqa: E402
from kdtree_engine.kernels.loader import compiled_variants  # noqa: E402

PARTS = ("prefill", "steps", "demo")
K2_LAYERS = 61
PROMPTS = (1024, 8192, 32768, 131072)
CONTEXTS = (4096, 32768, 131072, 262144)
NODES = (1, 16)
TIMED_REPS_UP_TO = 8192  # prompts up to this many tokens are timed --reps times (median); longer ones once
GOAL_TTFT_MS, GOAL_OUTLIER = 5.0, 2.0  # the demo's TTFT goal: under 5 ms, no prompt above 2x the median


def log(msg: str) -> None:
    """Progress on stderr (the record and its table go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


# ---- FLOPs -----------------------------------------------------------------------------------

def attention_flops(cfg: ModelConfig, n_heads: int, T: int, S: int, form: str) -> float:
    """One chunk of T queries over S committed keys and itself, causal: the key-side work of the form over all
    S + T keys (naive: the expansion through kv_b; absorbed: the queries into and the output out of the latent
    space, per query) and the scores and values over the visible (query, key) pairs only."""
    N, P, R, V, C = n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pairs = T * S + T * (T + 1) // 2
    if form == "naive":
        return 2 * (S + T) * C * N * (P + V) + 2 * pairs * N * (P + R + V)
    return 2 * T * N * P * C + 2 * T * N * C * V + 2 * pairs * N * (C + R + C)


def prefill_flops(target: Target, T: int, chunk: int, routes_per_token: float) -> dict[str, float]:
    """FLOPs of this rank's prefill of T tokens (see the module docstring), by part."""
    cfg = target.cfg
    linear = router = routed = 0.0
    for layer in target.layers:
        for m in layer.modules():
            if isinstance(m, Linear) and m is not layer.self_attn.kv_b_proj:
                linear += 2.0 * T * m.in_features * m.out_features
        if isinstance(layer.mlp, MoE):
            ex = layer.mlp.experts
            router += 2.0 * T * cfg.hidden_size * cfg.n_routed_experts
            routed += 2.0 * T * routes_per_token * 3 * ex.hidden * ex.inter
    N = target.layers[0].self_attn.n_heads
    attn = 0.0
    plan = [(0, T)] if T <= chunk else plan_chunks(T, chunk)
    for a, b in plan:
        form = "naive" if T <= chunk else choose_form(cfg, N, b - a, a, target.dtype.itemsize, target.device)
        attn += attention_flops(cfg, N, b - a, a, form) * len(target.layers)
    head = 2.0 * target.lm_head_proj.in_features * target.lm_head_proj.out_features
    return {"linears": linear, "router": router, "routed_experts": routed, "attention": attn, "lm_head": head}


# ---- timing ----------------------------------------------------------------------------------

def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_prefill(target: Target, ids: torch.Tensor, chunk: int) -> tuple[float, float, dict[str, int]]:
    """(prefill seconds, seconds to the first token: the prefill and its greedy pick, prefill stats) of one prompt into
    a fresh cache of its length; the cache's blocks go back to the pool."""
    dev = target.device
    cache = target.new_cache(ids.shape[0] + 1)
    try:
        sync(dev)
        t0 = time.perf_counter()
        out = target.prefill(ids, cache, chunk=chunk)
        sync(dev)
        t1 = time.perf_counter()
        int(out.logits[-1].argmax())   # the first token, read on the host as a request does
        t2 = time.perf_counter()
    finally:
        cache.release()
    return t1 - t0, t2 - t0, out.stats()


def prefill_rows(name: str, target: Target, prompts: Sequence[int], chunk: int, reps: int, peak: float | None,
                 routes: float, gen: torch.Generator, layers_scale: float, emit: Callable[[dict], None],
                 log: Callable[[str], None], profile: bool = False) -> None:
    """Prefill rows of one model (see the module docstring); each row handed to ``emit`` as it is measured. ``peak``:
    the bf16 matmul rate (None on the CPU: no ratio)."""
    vocab = target.cfg.vocab_size
    warmed: set[int] = set()
    for T in prompts:
        target.rope.ensure(T + 1)
        ids = torch.randint(0, vocab, (T,), generator=gen).to(target.device)
        for c in {b - a for a, b in ([(0, T)] if T <= chunk else plan_chunks(T, chunk))} - warmed:
            timed_prefill(target, ids[:c], chunk)   # compiles the chunk length's kernels, untimed
            warmed.add(c)
        runs = [timed_prefill(target, ids, chunk) for _ in range(reps if T <= TIMED_REPS_UP_TO else 1)]
        pre = statistics.median(r[0] for r in runs)
        ttft = statistics.median(r[1] for r in runs)
        flops = prefill_flops(target, T, chunk, routes)
        total = sum(flops.values())
        row = {"model": name, "prompt_tokens": T, "runs": len(runs), "prefill_s": pre, "ttft_s": ttft,
               "tokens_per_s": T / pre, "flops": flops, "flops_total": total, "tflops": total / pre / 1e12,
               "x_matmul_peak": None if peak is None else total / pre / peak, **runs[0][2]}
        if layers_scale != 1.0:
            row.update(projected_61_layers_prefill_s=pre * layers_scale, projected_61_layers_ttft_s=ttft * layers_scale)
        if profile and target.device.type == "cuda":
            row["profile"] = common.kernel_profile(lambda: timed_prefill(target, ids, chunk), reps=1, top=25)
        emit(row)
        ratio = "" if peak is None else f" ({total / pre / peak:.2f} of the matmul peak)"
        log(f"{name} prefill {T}: {pre * 1e3:.1f} ms, {T / pre:.0f} tok/s, {total / pre / 1e12:.1f} TFLOP/s{ratio}, "
            f"TTFT {ttft * 1e3:.1f} ms")


def step_bytes(target: Target) -> tuple[int, int]:
    """(bytes every step reads but the routed experts and the cache, bytes of one routed expert)."""
    fixed = nbytes(target.lm_head_proj.weight, target.norm.weight)
    one = 0
    for layer in target.layers:
        fixed += attention_weight_bytes(layer.self_attn) + nbytes(layer.input_layernorm.weight,
                                                                  layer.post_attention_layernorm.weight)
        if isinstance(layer.mlp, MoE):
            fixed += nbytes(*layer.mlp.gate.parameters())
            if layer.mlp.shared_experts is not None:
                fixed += nbytes(*layer.mlp.shared_experts.parameters())
            ex = layer.mlp.experts
            one = nbytes(*[t[0] for t in list(ex.parameters()) + list(ex.buffers())])
        else:
            fixed += nbytes(*layer.mlp.parameters())
    return fixed, one


def step_rows(target: Target, contexts: Sequence[int], nodes: Sequence[int], reps: int, copy_bw: float,
              gen: torch.Generator, layers_scale: float, emit: Callable[[dict], None],
              log: Callable[[str], None]) -> None:
    """Decode and tree-verify steps over random latents (see the module docstring)."""
    dev, cfg = target.device, target.cfg
    fixed, per_expert = step_bytes(target)
    pool = target.pool()
    with torch.no_grad():
        pool.kv.normal_(generator=gen)   # every block random: the committed length is set directly below
    for S in contexts:
        for T in nodes:
            cache = target.new_cache(S + T + 64)
            try:
                target.rope.ensure(S + T + 1)
                mask, depth = random_tree(T, S + T) if T > 1 else (torch.ones(1, 1, dtype=torch.bool),
                                                                   torch.zeros(1, dtype=torch.long))
                ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, device=gen.device).to(dev)
                pos, mask, start = (S + depth).to(dev), mask.to(dev), torch.tensor(S, device=dev)
                cache.length = S

                def step(ids=ids, pos=pos, mask=mask, start=start, cache=cache):
                    return target(ids, cache, positions=pos, tree_mask=mask, start=start)

                exp_b, counts = touched_local_experts(target, step)
                if dev.type == "cuda":
                    timing = common.time_calls([step], reps=reps)
                    us = timing["us"]
                else:
                    timing, us = {"graph": False}, common.host_time_us([step], reps)
                touched = sum(counts) * per_expert
                kv = (S + T) * bytes_per_token(cfg, target.dtype)
                total = fixed + touched + kv
                roof_us = total / copy_bw * 1e6
                row = {"context": S, "T": T, "kind": "decode" if T == 1 else "verify", "ms": us / 1e3,
                       "graph": timing["graph"], "bytes": {"weights": fixed, "routed_experts": touched,
                                                           "latent_cache": kv},
                       "bytes_total": total, "roofline_ms": roof_us / 1e3, "x_roofline": us / roof_us,
                       "touched_experts_per_layer": statistics.mean(counts) if counts else 0.0}
                if layers_scale != 1.0:
                    row["projected_61_layers_ms"] = us / 1e3 * layers_scale
                emit(row)
                log(f"step context {S}, {T} node(s): {us / 1e3:.3f} ms (x byte roofline {us / roof_us:.2f})")
            finally:
                cache.release()


def demo_ttft(args: argparse.Namespace, dev: torch.device, emit: Callable[[str, Any], None],
              log: Callable[[str], None]) -> None:
    """The demo engine's TTFT after its start-up warm-up (see the module docstring)."""
    llm = LLM(device=dev.type, progress=False, warm_up=False, threads=1 if dev.type == "cpu" else None)
    report = llm.warm_up(chunk=args.warmup_chunk)
    emit("demo_warm_up", {"prompt_lengths": len(report.lengths), "longest": max(report.lengths),
                          "decode_requests": report.decode_requests, "compiled": report.compiled,
                          "seconds": report.seconds, "chunk": args.warmup_chunk})
    log(report.line())
    vocab = llm.target.cfg.vocab_size
    rng = random.Random(args.seed)
    first = SamplingParams(max_tokens=1, ignore_eos=True)

    def ttft(n: int) -> tuple[float, float]:
        ids = [rng.randrange(vocab) for _ in range(n)]
        t0 = time.perf_counter()
        res = llm.generate([ids], first)[0]
        return res.stats["prefill_s"] * 1e3, (time.perf_counter() - t0) * 1e3

    before = compiled_variants()
    fixed = [ttft(args.ttft_prompt) for _ in range(args.ttft_reps)]
    lo, hi = args.demo_lengths
    lengths = [rng.randint(lo, hi) for _ in range(args.demo_prompts)]
    rand = [ttft(n) for n in lengths]
    after = compiled_variants()
    ms = [t for t, _ in rand]
    med = statistics.median(ms)
    worst = max(range(len(ms)), key=ms.__getitem__)
    out = {"prompt_tokens": args.ttft_prompt, "runs": len(fixed),
           "ttft_ms_median": statistics.median(t for t, _ in fixed), "ttft_ms_min": min(t for t, _ in fixed),
           "request_ms_median": statistics.median(w for _, w in fixed),
           "random": {"seed": args.seed, "lengths": [lo, hi], "prompts": len(ms), "ttft_ms_median": med,
                      "ttft_ms_max": ms[worst], "max_prompt_tokens": lengths[worst], "max_over_median": ms[worst] / med,
                      "ttft_ms_p90": sorted(ms)[int(0.9 * (len(ms) - 1))],
                      "request_ms_median": statistics.median(w for _, w in rand)},
           "compiled_during": None if before is None or after is None else after - before,
           "goal": {"ttft_ms": GOAL_TTFT_MS, "max_over_median": GOAL_OUTLIER}}
    out["goal"]["met"] = bool(out["ttft_ms_median"] < GOAL_TTFT_MS and out["random"]["max_over_median"] <= GOAL_OUTLIER)
    emit("demo_ttft", out)
    log(f"demo TTFT {args.ttft_prompt} tokens: {out['ttft_ms_median']:.2f} ms median; {len(ms)} random prompts "
        f"(seed {args.seed}) median {med:.2f} ms, max {ms[worst]:.2f} ms ({ms[worst] / med:.2f}x, {lengths[worst]} "
        f"tokens), kernel variants compiled meanwhile: {out['compiled_during']}")


# ---- the run -----------------------------------------------------------------------------------

def k2_target(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype, gen: torch.Generator,
              pool_tokens: int) -> tuple[Target, dict[str, Any]]:
    """The K2 one-rank target (bench/k2_model.build; its small drafter dropped) with a pool of ``pool_tokens``."""
    base = tiny_config() if args.tiny else k2_config()
    layers = args.layers or base.num_hidden_layers
    cfg = dataclasses.replace(base, num_hidden_layers=layers)
    comm = CountingCommunicator(0, args.world)
    # build() makes a drafter too: the smallest one, dropped at once
    small = dataclasses.replace(draft_config(dataclasses.replace(cfg, num_hidden_layers=4), True),
                                target_layer_ids=(1,), num_target_layers=layers)
    target, drafter = build(cfg, small, comm, KernelPolicy.from_env(batch_invariant=True), dev,
                            dtype, gen, uniform=True)
    del drafter
    target.init_cache_pool(tokens=pool_tokens)
    E = cfg.n_routed_experts
    local = len(target.layers[-1].mlp.experts.owned or range(E)) if isinstance(target.layers[-1].mlp, MoE) else E
    info = {"layers": layers, "of_layers": K2_LAYERS if not args.tiny else base.num_hidden_layers,
            "world": args.world, "heads": target.layers[0].self_attn.n_heads, "local_experts": local,
            "routes_per_token": cfg.num_experts_per_tok * local / E,
            "weight_bytes": sum(nbytes(t) for t in list(target.parameters()) + list(target.buffers()))}
    return target, info


def run(args: argparse.Namespace, dev: torch.device, save: Callable[[dict], None], log: Callable[[str], None]) -> dict:
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    rep: dict[str, Any] = {"tiny": bool(args.tiny), "parts": list(args.parts), "dtype": str(dtype).removeprefix("torch."),
                           "chunk": resolve_chunk(args.chunk), "prefill": [], "steps": []}
    if "prefill" in args.parts or "steps" in args.parts:
        rep["matmul_peak_flops"] = common.bf16_matmul_rate() if cuda else None
        rep["copy_Bps"] = common.copy_bandwidth() if cuda else common.cpu_copy_bandwidth()

    def emit(kind: str) -> Callable[[dict], None]:
        def add(row: dict) -> None:
            rep[kind].append(row)
            save(rep)
        return add

    peak = rep.get("matmul_peak_flops")
    need = max(([max(args.prompts) + 64] if "prefill" in args.parts else [])
               + ([max(args.contexts) + 2 * max(args.nodes) + 128] if "steps" in args.parts else []), default=0)
    if need:
        target, info = k2_target(args, dev, dtype, gen, need)
        rep["k2"] = info
        scale = info["of_layers"] / info["layers"]
        log(f"K2 one rank: {info['layers']} layers, {info['weight_bytes'] / 1e9:.1f} GB")
        if "prefill" in args.parts:
            prefill_rows("k2-rank", target, args.prompts, rep["chunk"], args.reps, peak, info["routes_per_token"], cpu_gen, scale,
                         emit("prefill"), log, profile=args.profile)
        if "steps" in args.parts:
            step_rows(target, args.contexts, args.nodes, args.reps, rep["copy_Bps"], gen, scale, emit("steps"), log)
        del target
        if cuda:
            torch.cuda.empty_cache()
    if "prefill" in args.parts and not args.no_demo_prefill:
        llm = LLM(device=dev.type, progress=False, warm_up=False, threads=1 if not cuda else None)
        prompts = [T for T in args.demo_prompt_sizes if T + 64 <= llm.target.pool().free_tokens]
        prefill_rows("demo", llm.target, prompts, rep["chunk"], args.reps, peak, llm.target.cfg.num_experts_per_tok, cpu_gen, 1.0,
                     emit("prefill"), log, profile=args.profile)
        del llm
    if "demo" in args.parts:
        demo_ttft(args, dev, lambda key, value: (rep.__setitem__(key, value), save(rep)), log)
    return rep


# ---- output ----------------------------------------------------------------------------------

def markdown(rep: dict, label: str) -> list[str]:
    out = [f"# Long context: prefill, decode / verify steps, time to first token ({label})", ""]
    k2 = rep.get("k2")
    if k2:
        scaled = (f" Timed with {k2['layers']} of {k2['of_layers']} layers; the 61-layer columns project linearly in "
                  "the layers." if k2["layers"] != k2["of_layers"] else "")
        out += [f"K2 one rank of TP{k2['world']} / EP{k2['world']}: {k2['heads']} heads, {k2['local_experts']} local "
                f"experts a MoE layer (uniform routes: {k2['routes_per_token']:g} local routes a token), INT4 experts, "
                f"{k2['weight_bytes'] / 1e9:.1f} GB of weights, random.{scaled}", ""]
    if rep.get("matmul_peak_flops"):
        out += [f"bf16 matmul peak (8192^3, this run): {rep['matmul_peak_flops'] / 1e12:.0f} TFLOP/s; copy bandwidth "
                f"(read + write): {rep['copy_Bps'] / 1e12:.2f} TB/s.", ""]
    if rep["prefill"]:
        out += [f"Prefill (chunks of {rep['chunk']} tokens; TTFT = prefill + the first token's pick):", ""]
        out += common.md_table(["model", "prompt", "chunks", "ms", "tok/s", "TFLOP/s", "x matmul peak", "TTFT ms",
                                "61-layer TTFT s"],
                               [[r["model"], r["prompt_tokens"], r["prefill_chunks"], r["prefill_s"] * 1e3,
                                 r["tokens_per_s"], r["tflops"], r["x_matmul_peak"], r["ttft_s"] * 1e3,
                                 r.get("projected_61_layers_ttft_s")] for r in rep["prefill"]])
    for r in rep["prefill"]:
        if r.get("profile"):
            out += ["", f"Kernels of one prefill, {r['model']}, {r['prompt_tokens']} tokens (device us, torch.profiler):", ""]
            out += common.kernel_lines(r["profile"]["kernels"])
    if rep["steps"]:
        out += ["", "Steps over a cache of random latents (committed length set directly), each replayed from a CUDA "
                    "graph on CUDA:", ""]
        out += common.md_table(["context", "nodes", "ms", "GB read", "roofline ms", "x roofline", "61-layer ms"],
                               [[r["context"], r["T"], r["ms"], r["bytes_total"] / 1e9, r["roofline_ms"],
                                 r["x_roofline"], r.get("projected_61_layers_ms")] for r in rep["steps"]])
    w, d = rep.get("demo_warm_up"), rep.get("demo_ttft")
    if w:
        out += ["", f"Demo start-up warm-up: {w['prompt_lengths']} prompt lengths (1..{w['longest']}), "
                    f"{w['decode_requests']} decoding requests, {w['compiled']} kernel variants compiled, "
                    f"{w['seconds']:.2f} s."]
    if d:
        r = d["random"]
        out += ["", f"Demo TTFT (DDTree 16 engine, after the warm-up): {d['prompt_tokens']}-token prompt "
                    f"{d['ttft_ms_median']:.2f} ms median of {d['runs']}; {r['prompts']} prompts of "
                    f"{r['lengths'][0]}-{r['lengths'][1]} tokens (seed {r['seed']}): median {r['ttft_ms_median']:.2f} ms, "
                    f"p90 {r['ttft_ms_p90']:.2f} ms, max {r['ttft_ms_max']:.2f} ms = {r['max_over_median']:.2f}x the "
                    f"median ({r['max_prompt_tokens']} tokens); kernel variants compiled during them: "
                    f"{d['compiled_during']}. Goal (under {d['goal']['ttft_ms']:g} ms, max <= "
                    f"{d['goal']['max_over_median']:g}x the median): {'met' if d['goal']['met'] else 'not met'}."]
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--label", default=None, help="record name: long_context-LABEL-<device> (default: none)")
    ap.add_argument("--parts", type=lambda s: [x for x in s.split(",") if x], default=list(PARTS),
                    help="prefill,steps,demo (default all)")
    ap.add_argument("--tiny", action="store_true", help="a tiny K2-shaped model and small sizes (CPU smoke run)")
    ap.add_argument("--quick", action="store_true", help="the smallest sizes of each part (with --tiny: the test's)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--layers", type=int, default=None, help="K2 layers built and timed (default all 61)")
    ap.add_argument("--world", type=int, default=8, help="ranks of the layout this rank is one of")
    ap.add_argument("--prompts", type=ints, default=None, help="K2 prefill prompt tokens (default 1K,8K,32K,128K)")
    ap.add_argument("--demo-prompt-sizes", type=ints, default=None, help="demo prefill prompt tokens (default --prompts)")
    ap.add_argument("--no-demo-prefill", action="store_true", help="prefill part: the K2 model only")
    ap.add_argument("--contexts", type=ints, default=None, help="step contexts (default 4K,32K,128K,256K)")
    ap.add_argument("--nodes", type=ints, default=None, help="step widths: 1 = decode, more = a tree verify (1,16)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; --tiny 2)")
    ap.add_argument("--ttft-prompt", type=int, default=100, help="demo TTFT prompt tokens")
    ap.add_argument("--ttft-reps", type=int, default=None, help="demo TTFT runs of that prompt (default 20)")
    ap.add_argument("--demo-prompts", type=int, default=None, help="demo prompts of random lengths (default 100)")
    ap.add_argument("--demo-lengths", type=ints, default=None, help="their length range lo,hi (default 16,512)")
    ap.add_argument("--warmup-chunk", type=int, default=None, help="the demo warm-up's chunk (default the engine's)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default the engine's; --tiny 64)")
    ap.add_argument("--profile", action="store_true", help="prefill: also list the kernels of one prefill per prompt (CUDA)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    small = a.tiny or a.quick
    a.prompts = a.prompts or ([48, 160] if a.tiny else [1024] if a.quick else list(PROMPTS))
    a.demo_prompt_sizes = a.demo_prompt_sizes or a.prompts
    a.contexts = a.contexts or ([64] if a.tiny else [4096] if a.quick else list(CONTEXTS))
    a.nodes = a.nodes or ([1, 4] if a.tiny else list(NODES))
    a.reps = a.reps or (2 if small else 5)
    a.ttft_reps = a.ttft_reps or (2 if small else 20)
    a.demo_prompts = a.demo_prompts or (3 if small else 100)
    a.demo_lengths = a.demo_lengths or ([16, 40] if a.tiny else [16, 512])
    if a.tiny:
        a.warmup_chunk = a.warmup_chunk or 40
        a.chunk = a.chunk or 64
    check_args(ap, a)
    return a


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """One argparse error line (exit 2) for the first bad value."""
    bad = [p for p in a.parts if p not in PARTS]
    if bad or not a.parts:
        ap.error(f"--parts takes {', '.join(PARTS)}, got {','.join(a.parts)}")
    if len(a.demo_lengths) != 2 or not 1 <= a.demo_lengths[0] <= a.demo_lengths[1]:
        ap.error(f"--demo-lengths takes lo,hi with 1 <= lo <= hi, got {a.demo_lengths}")
    sizes = a.prompts + a.demo_prompt_sizes + a.contexts + a.nodes
    if min(sizes) < 1 or a.reps < 1 or a.ttft_reps < 1 or a.demo_prompts < 1 or a.ttft_prompt < 1 or a.world < 1:
        ap.error("sizes, --reps, --ttft-reps, --demo-prompts, --ttft-prompt and --world must be positive")
    if a.layers is not None and a.layers < 2:
        ap.error(f"--layers must be at least 2 (the dense first layer and a MoE layer), got {a.layers}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    command = common.command_line(argv, "python3 bench/long_context.py")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tag = device_tag(dev)
    stem = f"long_context-{args.label}-{tag}" if args.label else f"long_context-{tag}"
    save = common.results_saver(args.out, stem, lambda rep: markdown(rep, tag), command=command, device=dev)
    rep = run(args, dev, save, log)
    jp, mp = save(rep)
    print(f"wrote {jp} and {mp}")
    print("\n".join(markdown(rep, tag)[2:]))
    return rep


if __name__ == "__main__":
    main()
