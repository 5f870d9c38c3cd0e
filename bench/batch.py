"""Continuous batching throughput: many concurrent requests, plain batched decoding against DDTree with the
load-aware budget, on the demo pair and on the K2 one-rank model (bench/k2_model.py's build).

    python bench/batch.py --model demo --out bench/results
    python bench/batch.py --model k2 --out bench/results            # one H200: about 90 GB of weights
    python bench/batch.py --model demo --device cpu --concurrency 1,2 --max-tokens 8 --out DIR   # smoke run
    python bench/batch.py --model k2 --ranks all --layers 12 --methods plain --out DIR   # K2 over every GPU

For each method and concurrency C, C requests arrive together and run to their end through the method's
:class:`~kdtree_engine.batch.Scheduler` (one per method for the whole run, as a server keeps one: its graphs and
what its load-aware budget learned carry over; host-driven rounds, one batched target forward per step, the running
requests' rows replayed from CUDA graphs per slot bucket unless ``--step-mode eager``; on CUDA, short prompts from the
target's prompt graphs as the engine runs them, unless ``--no-prompt-graphs``). At each C every method runs once
unmeasured (it captures the graphs of its buckets), then ``--repeats`` measured runs, the methods in turn (the record
keeps the run of median throughput and lists every run's tokens/s); measured: generated tokens / wall seconds (prefill included), per-request latency and time to first token, forwards and rows
per forward, and for DDTree the mean tree budget chosen (the load-aware curve). The baseline of the throughput goal
is the engine's fastest batch-1 plain decoding: one request, its rounds replayed from a CUDA graph (CUDA).

Demo prompts: held-out Python files (bench_spec's default prompts). K2: random weights and random prompt ids (its
drafter accepts nothing, so DDTree's budgets fall to plain decoding and its draft passes are the cost measured).

With ``--ranks N`` (``all``: every visible GPU; K2 only) N processes run, one a device (NCCL; gloo on the CPU), each
one real rank of TP-N / EP-N holding its shards (``--layers L`` builds L of K2's layers, for fewer ranks than its
shards need): rank 0 runs the batches (``parallel/batch.py``'s RankedScheduler), the others follow each step, the
collectives inside the measured time. The load-aware budget is refused there (it chooses from timings, which differ
between ranks); the prompts run host-driven (the prompt graphs are the engine's on one device).

Writes ``<out>/batch-<model>-<gpu>.json`` and ``.md`` (``-xN`` after the device with ``--ranks N``).
"""

from __future__ import annotations

import argparse
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
from kdtree_engine.batch.scheduler import Scheduler  # noqa: E402
from kdtree_engine.parallel.batch import RankedScheduler, follow_batch  # noqa: E402
from kdtree_engine.parallel.broadcast import BatchOpen, Request, recv_message, send_request, send_stop  # noqa: E402
from kdtree_engine.model.prompt_graph import PromptGraphs  # noqa: E402
from kdtree_engine.sampling import SamplingParams  # noqa: E402
from kdtree_engine.bench_spec import device_tag  # noqa: E402
from kdtree_engine.speculative.decode import generate  # noqa: E402
from kdtree_engine.speculative.stats import sync  # noqa: E402

# plain and the load-aware budget by default; a fixed 16-node tree (--methods ...,ddtree-16) shows what a tree gains
# or costs at each concurrency, the curve the load-aware budget chooses along
METHODS = {"plain": ("none", None), "ddtree-auto": ("ddtree", "auto"), "ddtree-8": ("ddtree", 8),
           "ddtree-16": ("ddtree", 16), "ddtree-auto-slots": ("ddtree", "auto")}
SLOTTED = ("ddtree-auto-slots",)   # the load-aware budget in tree slots (Scheduler(auto_slots=True))
DEFAULT_METHODS = ("plain", "ddtree-auto")


def load_demo(dev: torch.device, dtype: torch.dtype, prompt_tokens: int, n: int):
    from kdtree_engine.bench_spec import default_prompts
    from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target, load_tokenizer
    target = load_target(DEMO_DIR, device=dev, dtype=dtype, progress=False)
    drafter = load_drafter(DEMO_DIR / "draft", target)
    prompts = [p.ids for p in default_prompts(load_tokenizer(DEMO_DIR), n, prompt_tokens)]
    return target, drafter, (prompts * (n // max(len(prompts), 1) + 1))[:n]


def load_k2(dev: torch.device, dtype: torch.dtype, prompt_tokens: int, n: int, tiny: bool, comm: Any = None,
            layers: int | None = None):
    """The K2 one-rank build (rank 0 of a pretended eight), or with ``comm`` this process's rank of a real group."""
    import dataclasses

    from bench import k2_model
    from kdtree_engine.kernels.policy import KernelPolicy
    cfg = k2_model.tiny_config() if tiny else k2_model.k2_config()
    if layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    gen = torch.Generator(device=dev).manual_seed(0)
    comm = (k2_model.CountingCommunicator(0, 8) if comm is None else
            k2_model.CountingCommunicator(comm.rank, comm.world_size, inner=comm))
    target, drafter = k2_model.build(cfg, k2_model.draft_config(cfg, tiny), comm,
                                     KernelPolicy.from_env(batch_invariant=True), dev, dtype, gen, True)
    g = torch.Generator().manual_seed(1)
    V = cfg.vocab_size // comm.world_size   # rank 0's vocabulary shard: ids it embeds
    prompts = [torch.randint(0, V, (prompt_tokens,), generator=g).tolist() for _ in range(n)]
    return target, drafter, prompts


def run_batch(sched: Scheduler, prompts: list[list[int]], method: str, max_tokens: int) -> dict[str, Any]:
    spec, budget = METHODS[method]
    target = sched.target
    captures = sched.steps.captures if sched.steps is not None else 0
    ahead = sched.ahead.steps if sched.ahead is not None else 0
    forwards, rows_run = sched.forwards, sched.rows_run   # the scheduler's counts run on over its runs
    slots_before = slot_counts(sched)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync(target.device)
    t0 = time.perf_counter()
    seqs = [sched.submit(p, params, spec=spec, budget=budget) for p in prompts]
    sched.run()
    sync(target.device)
    wall = time.perf_counter() - t0
    res = [s.result for s in seqs]
    tokens = sum(len(r.token_ids) for r in res)
    lat = [r.stats["latency_s"] for r in res]
    chosen: dict[int, int] = {}
    for r in res:
        for b, k in r.stats.get("budget_chosen", {}).items():
            chosen[int(b)] = chosen.get(int(b), 0) + k
    rounds = sum(chosen.values())
    slots_after = slot_counts(sched)
    return {"method": method, "concurrency": len(prompts), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latency_s_mean": statistics.mean(lat), "latency_s_max": max(lat),
            "ttft_s_mean": statistics.mean(r.stats["ttft_s"] for r in res),
            "tau": statistics.mean(r.stats["tau"] for r in res), "forwards": sched.forwards - forwards,
            "rows_per_forward": (sched.rows_run - rows_run) / max(sched.forwards - forwards, 1),
            "budget_mean": sum(b * k for b, k in chosen.items()) / rounds if rounds else None,
            "budget_chosen": dict(sorted(chosen.items())),
            "graph_captures": (sched.steps.captures if sched.steps is not None else 0) - captures,
            # tree slots: their graph captures and steps by budget in this run (a load-aware group's choices)
            "slot_captures": slots_after["captures"] - slots_before["captures"],
            "slot_steps": {b: k - slots_before["steps"].get(b, 0) for b, k in sorted(slots_after["steps"].items())
                           if k > slots_before["steps"].get(b, 0)},
            # requests whose tree rounds ran whole on the device (tree slots: greedy, a fixed budget)
            "device_round_requests": sum(bool(r.stats.get("device_rounds")) for r in res),
            # steps queued ahead of the read of their predecessor's tokens (plain greedy over static steps)
            "steps_ahead": (sched.ahead.steps if sched.ahead is not None else 0) - ahead,
            # what the load-aware budget steers by, as learned by the end of the run
            "draft_s": sched.draft_s.value, "tree_host_s": sched.tree_host_s.value, "draft_samples": sched.draft_s.n,
            "probe_s": sched.probe_s.value,
            "forward_scale": sched.forward_scale.value}


def slot_counts(sched: Scheduler) -> dict[str, Any]:
    """The tree slots' graph captures and steps by budget so far, over every group."""
    groups = list((sched.tree_slots or {}).values())
    steps: dict[int, int] = {}
    for g in groups:
        for b, k in g.steps_at.items():
            steps[b] = steps.get(b, 0) + k
    return {"captures": sum(g.captures for g in groups), "steps": steps}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (the lower middle of an even count), with every run's tokens/s beside it."""
    row = dict(sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2])
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return row


def host_profile(fn: Callable[[], object], top: int = 25) -> list[dict[str, Any]]:
    """The functions of one call of fn by their own host seconds (cProfile): calls, own s, cumulative s."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = [{"function": f"{Path(f).name}:{line}({name})", "calls": v[1], "own_s": v[2], "cum_s": v[3]}
            for (f, line, name), v in pstats.Stats(prof).stats.items()]
    return sorted(rows, key=lambda r: -r["own_s"])[:top]


def batch1_plain(target, prompt: list[int], max_tokens: int, comm: Any = None) -> dict[str, Any]:
    """The engine's fastest single-request plain decoding (graph rounds on CUDA): decode tokens/s. ``comm``: rank 0
    of real ranks, which it tells each request first (they run it too)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def one():
        if comm is not None:
            send_request(comm, Request(list(prompt), params), target.device)
        return generate(target, prompt, params)
    one()   # warm: capture and compile
    r = one()
    return {"tokens_per_s": r.stats["tokens_per_s"], "mode": r.stats.get("rounds_mode", "eager")}


def load(args: argparse.Namespace, dev: torch.device, comm: Any = None):
    """(target, drafter, prompts) with its cache pool, and on one CUDA device the prompt graphs the engine sets."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    top = max(args.concurrency)
    if args.model == "demo":
        target, drafter, prompts = load_demo(dev, dtype, args.prompt_tokens, top)
    else:
        target, drafter, prompts = load_k2(dev, dtype, args.prompt_tokens, top, args.tiny, comm, args.layers)
    target.init_cache_pool(tokens=top * (args.prompt_tokens + args.max_tokens + 300) + 4096)
    if dev.type == "cuda" and not args.no_prompt_graphs and comm is None:   # as the engine sets them (engine.py)
        target.prompt_graphs = PromptGraphs(target, capture=True)
    return target, drafter, prompts


def run(args: argparse.Namespace, log: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] = lambda rep: None, comm: Any = None,
        dev: torch.device | None = None) -> dict[str, Any]:
    """The measurements (``comm``: rank 0 of ``--ranks`` real ranks, the others in :func:`follow`)."""
    clock = common.Clock()
    dev = dev or torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, drafter, prompts = load(args, dev, comm)
    log(f"loaded {args.model} ({clock():.0f} s)")
    base = batch1_plain(target, prompts[0], args.max_tokens, comm)
    log(f"batch-1 plain ({base['mode']}): {base['tokens_per_s']:.1f} tok/s ({clock():.0f} s)")

    def scheduler(auto_slots: bool = False) -> Scheduler:
        if comm is None:
            return Scheduler(target, drafter, token_budget=args.token_budget, step_mode=args.step_mode,
                             auto_slots=auto_slots)
        return RankedScheduler(target, drafter, comm, dev, token_budget=args.token_budget)
    # one scheduler a method for the whole run, as a server keeps one; real ranks follow one batch at a time, so
    # there the methods share one (each request carries its own)
    if comm is None:
        scheds = {m: scheduler(m in SLOTTED) for m in args.methods}
    else:
        shared = scheduler()
        scheds = {m: shared for m in args.methods}
    mode = next(iter(scheds.values())).steps
    rep = {"model": args.model, "tiny": bool(args.tiny), "dtype": str(dtype).replace("torch.", ""),
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "token_budget": args.token_budget,
           "step_mode": "eager" if mode is None else mode.mode,
           "prompt_graphs": target.prompt_graphs is not None, "ranks": 1 if comm is None else comm.world_size,
           "layers": target.cfg.num_hidden_layers, "batch1_plain": base, "repeats": args.repeats, "rows": [],
           "elapsed_s": clock()}
    try:
        measure(args, rep, scheds, prompts, base, log, save, clock)
    finally:
        if comm is not None:   # the ranks leave the batch, then their loop
            shared.close()
            send_stop(comm, dev)
    return rep


def measure(args: argparse.Namespace, rep: dict[str, Any], scheds: dict[str, Scheduler], prompts: list[list[int]],
            base: dict[str, Any], log: Callable[[str], None], save: Callable[[dict[str, Any]], None],
            clock: Callable[[], float]) -> None:
    """Each concurrency: a warm run of each method, then ``--repeats`` measured runs, the methods in turn."""
    for c in args.concurrency:
        warm = {m: run_batch(scheds[m], prompts[:c], m, args.max_tokens) for m in args.methods}   # captures graphs
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        for _ in range(args.repeats):   # the methods in turn, so a drift of the host's speed reaches them alike
            for m in args.methods:
                runs[m].append(run_batch(scheds[m], prompts[:c], m, args.max_tokens))
        for m in args.methods:
            row = median_run(runs[m])
            row["warm_run_s"] = warm[m]["wall_s"]
            if c in args.host_profile:   # one more run under cProfile: where the host's time goes (not measured)
                row["host_profile"] = host_profile(lambda: run_batch(scheds[m], prompts[:c], m, args.max_tokens))
            row["x_batch1_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
            rep["rows"].append(row)
            rep["elapsed_s"] = clock()
            save(rep)   # a run cut by a time limit keeps the rows it finished
            log(f"C={c} {m}: {row['tokens_per_s']:.1f} tok/s ({row['x_batch1_plain']:.2f}x batch-1 plain; runs "
                f"{', '.join(f'{t:.0f}' for t in row['tokens_per_s_runs'])}), latency {row['latency_s_mean']:.2f} s, "
                f"budget {row['budget_mean']} ({clock():.0f} s)")


def follow(args: argparse.Namespace, comm: Any, dev: torch.device) -> None:
    """A rank > 0 of ``--ranks``: the same build, then rank 0's requests (its batch-1 baseline) and batches, step for
    step, until it stops."""
    target, drafter, _ = load(args, dev, comm)
    while (msg := recv_message(comm, dev)) is not None:
        if isinstance(msg, BatchOpen):
            follow_batch(target, drafter, comm, dev, msg)
        else:
            generate(target, msg.prompt_ids, msg.params)


def rank_body(comm: Any, dev: torch.device, args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank of ``--ranks``: rank 0 measures (:func:`run`), the others follow it."""
    if comm.rank == 0:
        return run(args, lambda m: print(m, file=sys.stderr, flush=True), comm=comm, dev=dev)
    follow(args, comm, dev)
    return None


def markdown(rep: dict, label: str) -> list[str]:
    ranks = rep.get("ranks", 1)
    where = (f" over {ranks} ranks (TP-{ranks} / EP-{ranks}, {rep['layers']} layers; one process a device, rank 0's "
             "batches followed by the others step for step)" if ranks > 1 else "")
    out = [f"# Continuous batching, {rep['model']}{where} ({label})", "",
           f"{rep['prompt_tokens']}-token prompts, {rep['max_tokens']} tokens each, all arriving together; up to "
           f"{rep['token_budget']} rows per forward; {rep['dtype']}; batched steps {rep.get('step_mode', 'eager')}"
           f"{', prompts from graphs' if rep.get('prompt_graphs') else ''}. "
           f"Batch-1 plain decoding "
           f"({rep['batch1_plain']['mode']} rounds): {rep['batch1_plain']['tokens_per_s']:.1f} tok/s.", ""]
    out += common.md_table(
        ["concurrent", "method", "tok/s", "runs tok/s", "x batch-1 plain", "latency mean s", "latency max s", "TTFT mean s",
         "tau", "forwards", "steps ahead", "rows/forward", "mean budget", "device rounds", "slot steps by budget",
         "slot captures"],
        [[r["concurrency"], r["method"], r["tokens_per_s"],
          " / ".join(f"{t:.0f}" for t in r.get("tokens_per_s_runs", [r["tokens_per_s"]])), r["x_batch1_plain"], r["latency_s_mean"],
          r["latency_s_max"], r["ttft_s_mean"], r["tau"], r["forwards"], r.get("steps_ahead", "n/a"),
          r["rows_per_forward"], r["budget_mean"], r.get("device_round_requests", "n/a"),
          " ".join(f"{b}:{k}" for b, k in r.get("slot_steps", {}).items()) or "n/a", r.get("slot_captures", "n/a")]
         for r in rep["rows"]])
    out += ["", f"tok/s: the run of median throughput of {rep.get('repeats', 1)} measured runs (the methods in turn), "
                "all of them in `runs tok/s`; the other columns are the median run's.",
            "", "Steps ahead: forwards queued before the host read the previous step's tokens (plain greedy steps, "
                "batch/ahead.py). Device rounds: requests whose tree rounds ran whole on the device (tree slots, "
                "batch/tree_slots.py)."]
    for r in rep["rows"]:
        if r.get("host_profile"):
            out += ["", f"Host time of one more run at {r['concurrency']} requests, {r['method']} (cProfile, its own "
                        "overhead included):", ""]
            out += common.md_table(["function", "calls", "own s", "cumulative s"],
                                   [[f["function"][:80], f["calls"], f["own_s"], f["cum_s"]] for f in r["host_profile"]])
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("demo", "k2"), default="demo")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="k2: the k2-tiny dims (CPU smoke run)")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)} (default {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--step-mode", choices=("eager", "static", "graph"), default=None,
                    help="how the running requests' rows run (default: graph on CUDA, eager elsewhere)")
    ap.add_argument("--ranks", default="0",
                    help="k2: N real ranks, one process a device (NCCL; gloo on the CPU), or 'all' (every visible "
                         "GPU); 0 (default): one process holding rank 0 of eight")
    ap.add_argument("--layers", type=int, default=None, help="k2: build this many of its layers (fewer ranks than "
                    "its shards need)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measured runs of each (concurrency, method), the methods in turn; the record keeps the run "
                         "of median throughput and every run's tokens/s (host-bound runs vary from run to run)")
    ap.add_argument("--host-profile", type=ints, default=[],
                    help="after the measured run at these concurrencies, one more under cProfile (its top functions "
                         "in the record)")
    ap.add_argument("--no-prompt-graphs", action="store_true",
                    help="CUDA: prompts through the host-driven forward only (default: short prompts from the "
                         "target's prompt graphs, as the engine runs them)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: must be at least 1, got {args.repeats}")
    if args.ranks == "all":
        args.ranks = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif not args.ranks.isdigit():
        ap.error(f"--ranks {args.ranks!r}: a number of ranks or 'all'")
    args.ranks = int(args.ranks)
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers: must be at least 1, got {args.layers}")
    auto = any(m.startswith("ddtree-auto") for m in args.methods)
    if args.ranks and (args.model != "k2" or auto or args.step_mode is not None):
        ap.error("--ranks: the k2 model only, without ddtree-auto (its budgets follow each rank's own timings) and "
                 "with the default step mode")
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad[0]!r} (known: {', '.join(METHODS)})")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    command = common.command_line(argv, "python3 bench/batch.py")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tag = device_tag(dev) + (f"-x{args.ranks}" if args.ranks else "")
    save = common.results_saver(args.out, f"batch-{args.model}{'-tiny' if args.tiny else ''}-{tag}",
                                lambda rep: markdown(rep, tag), command=command, device=dev)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    rep = common.run_ranks(args.ranks, rank_body, (args,), dev.type) if args.ranks else run(args, log, save)
    jp, mp = save(rep)
    print(f"wrote {jp} and {mp}")
    print("\n".join(markdown(rep, tag)[4:]))
    return rep


if __name__ == "__main__":
    main()
