"""The scheduler's batched step alone, replayed from one CUDA graph: what a step of S requests costs without the
host work between steps and the prompts' prefill (bench/batch.py measures the whole scheduler).

    python3 bench/batch_graph.py --model k2 --out bench/results                  # one H200: the K2 one-rank model
    python3 bench/batch_graph.py --model demo --out bench/results
    python3 bench/batch_graph.py --model k2 --tiny --device cpu --concurrency 1,3 --out DIR   # CPU smoke run

For each concurrency S: S requests, each with ``--context`` committed tokens of random latents (the pool filled with
random values and the committed length set directly, as bench/long_context.py's steps do), take one step of
``--nodes`` rows each (1: a plain decoding step; more: a chain verified at once) laid into the static slots the
scheduler's batched steps run (kdtree_engine/batch/graph_step.py: each slot its request's block table, committed
length and mask), their forward captured in a CUDA graph and replayed (eager on the CPU). Measured: ms per step, and for plain steps tokens/s = S / step time against one
request's step from a graph (the issue's goal: 16 requests at least 8x one). On CUDA with the demo, every part's
logits are checked bit for bit against that request's own device-resident forward (the batch-invariance promise,
graph against eager); the K2 rank draws its routes at random each forward (bench/k2_model.py), so it has no such check.

Writes ``<out>/batch_graph-<model>[-tiny]-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.batch import load_demo, load_k2  # noqa: E402
from kdtree_engine.batch.graph_step import BatchedSteps, Slots  # noqa: E402
from kdtree_engine.model.target import BatchPart, Target  # noqa: E402


def parts_for(target: Target, S: int, context: int, nodes: int, gen: torch.Generator) -> list[BatchPart]:
    """S requests at ``context`` committed tokens, each a step of ``nodes`` rows (1: plain; more: a causal chain)."""
    dev, V = target.device, target.cfg.vocab_size
    target.rope.ensure(context + nodes + 1)
    mask = torch.ones(nodes, nodes, dtype=torch.bool, device=dev).tril()
    parts = []
    for _ in range(S):
        cache = target.new_cache(context + nodes + 64)
        cache.length = context
        ids = torch.randint(0, V, (nodes,), generator=gen, device=gen.device).to(dev)
        if nodes == 1:
            parts.append(BatchPart(ids, cache))
        else:
            parts.append(BatchPart(ids, cache, torch.arange(context, context + nodes, device=dev), mask))
    return parts


def solo_logits(target: Target, p: BatchPart) -> torch.Tensor:
    T = p.ids.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool, device=target.device).tril()
    pos = torch.arange(p.cache.length, p.cache.length + T, device=target.device)
    return target(p.ids, p.cache, positions=pos, tree_mask=mask,
                  start=torch.tensor(p.cache.length, device=target.device)).logits


def measure(target: Target, S: int, args: argparse.Namespace, gen: torch.Generator) -> dict[str, Any]:
    parts = parts_for(target, S, args.context, args.nodes, gen)
    key = BatchedSteps(target, "static").key(parts, ())
    slots = Slots(target, key, target.pool().trash)
    try:
        spans, _ = slots.fill(parts)

        def step() -> None:
            with torch.no_grad():
                slots.run()

        if target.device.type == "cuda":
            timing = common.time_calls([step], reps=args.reps)
            us, graph = timing["us"], timing["graph"]
        else:
            us, graph = common.host_time_us([step], args.reps), False
        row = {"concurrency": S, "nodes": args.nodes, "context": args.context, "ms": us / 1e3, "graph": graph,
               "rows": S * args.nodes, "slots": key.slots, "width": key.width}
        if args.nodes == 1:
            row["tokens_per_s"] = S / (us / 1e6)
        if target.device.type == "cuda" and args.model == "demo":   # the K2 rank's routes are redrawn each forward
            step()
            with torch.no_grad():
                row["bitwise_equal_solo"] = all(torch.equal(slots.logits[a:a + n], solo_logits(target, p))
                                                for (a, n), p in zip(spans, parts))
        if target.device.type == "cuda" and S in args.profile:
            row["profile"] = kernel_families(common.graph_timeline(step, reps=3))
        return row
    finally:
        for p in parts:
            p.cache.release()


def kernel_families(timeline: dict[str, Any], top: int = 14) -> dict[str, Any]:
    """A replayed step's kernels summed by name: where the step's device time goes, and how much of its span is idle."""
    acc: dict[str, list[float]] = {}
    for k in timeline.get("kernels", []):
        slot = acc.setdefault(k["name"], [0, 0.0])
        slot[0] += 1
        slot[1] += k["us"]
    rows = sorted(({"name": n, "calls": c, "us": us} for n, (c, us) in acc.items()), key=lambda r: -r["us"])
    rest = rows[top:]
    rows = rows[:top] + ([{"name": f"({len(rest)} others)", "calls": sum(r["calls"] for r in rest),
                           "us": sum(r["us"] for r in rest)}] if rest else [])
    return {"span_us": timeline.get("span_us"), "busy_us": timeline.get("busy_us"),
            "launches": len(timeline.get("kernels", [])), "kernels": rows, "error": timeline.get("error")}


def run(args: argparse.Namespace, log: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] = lambda rep: None) -> dict[str, Any]:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    top = max(args.concurrency)
    if args.model == "demo":
        target = load_demo(dev, dtype, 16, 1)[0]
    else:
        target = load_k2(dev, dtype, 16, 1, args.tiny)[0]
    target.init_cache_pool(tokens=top * (args.context + args.nodes + 128) + 4096)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    with torch.no_grad():
        target.pool().kv.normal_(generator=gen)
    rep: dict[str, Any] = {"model": args.model, "tiny": bool(args.tiny), "dtype": str(dtype).removeprefix("torch."),
                           "context": args.context, "nodes": args.nodes, "seed": args.seed, "rows": []}
    for S in args.concurrency:
        row = measure(target, S, args, gen)
        one = rep["rows"][0]["ms"] if rep["rows"] and rep["rows"][0]["concurrency"] == 1 else None
        if one is not None:
            row["x_one_request"] = (S * one / row["ms"]) if args.nodes == 1 else None
        rep["rows"].append(row)
        save(rep)
        log(f"S={S}: {row['ms']:.3f} ms a step ({'graph' if row['graph'] else 'eager'})"
            + (f", {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else "")
            + (f", bitwise == solo: {row['bitwise_equal_solo']}" if "bitwise_equal_solo" in row else ""))
    return rep


def markdown(rep: dict[str, Any], label: str) -> list[str]:
    out = [f"# Batched steps from one CUDA graph, {rep['model']} ({label})", "",
           f"Each request: {rep['context']} committed tokens (random latents), a step of {rep['nodes']} row(s); the "
           f"batched step's static slots (graph_step.Slots) a step; {rep['dtype']}.", ""]
    out += common.md_table(["concurrent", "rows", "ms a step", "graph", "tok/s", "x one request", "bitwise == solo"],
                           [[r["concurrency"], r["rows"], r["ms"], r["graph"], r.get("tokens_per_s"),
                             r.get("x_one_request"), r.get("bitwise_equal_solo")] for r in rep["rows"]])
    for r in rep["rows"]:
        p = r.get("profile")
        if not p:
            continue
        out += ["", f"Kernels of one replayed step at {r['concurrency']} request(s): {p['launches']} launches, span "
                    f"{(p['span_us'] or 0) / 1e3:.2f} ms, device busy {(p['busy_us'] or 0) / 1e3:.2f} ms"
                    + (f" ({p['error']})" if p.get("error") else "") + ":", ""]
        out += common.kernel_lines(p["kernels"])
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--model", choices=("demo", "k2"), default="k2")
    ap.add_argument("--tiny", action="store_true", help="K2: the tiny K2-shaped model (CPU smoke run)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=4096, help="committed tokens of every request")
    ap.add_argument("--nodes", type=int, default=1, help="rows a request a step (1: plain decoding)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", type=ints, default=[],
                    help="CUDA: the replayed step's kernels at these concurrencies (e.g. 1,16), summed by kernel name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    if not a.concurrency or min(a.concurrency) < 1 or a.context < 1 or a.nodes < 1 or a.reps < 1:
        ap.error("--concurrency, --context, --nodes and --reps must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = f"{args.model}-tiny" if args.tiny else args.model
    return common.bench_main(argv, "bench/batch_graph.py", args.out, args.device,
                             lambda tag: f"batch_graph-{name}-{tag}", markdown, lambda log, save: run(args, log, save))


if __name__ == "__main__":
    main()
