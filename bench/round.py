"""End-to-end decoding rounds on a small model: rounds/s and tokens/s for plain decoding, DFlash and DDTree,
and how much of a round's wall time the device spends outside kernels.

    python bench/round.py --out bench/results                 # the embedded demo model (+ its drafter)
    python bench/round.py --out DIR --model DIR --draft DIR --budgets 8,32 --max-tokens 128
    python bench/round.py --out DIR --tiny                    # a few tokens, one prompt (CPU smoke run)

Settings: none, dflash, ddtree at each of ``--budgets`` (default 8, 32), greedy, EOS ignored, the same
prompts for all (held-out standard-library files as in ``kdtree bench spec``; a fixed code snippet when
none is found). Each setting: one warm-up generation, then every prompt once.

Per setting (decode only, prefill excluded): rounds/s = rounds / decode time; tokens/s = (tokens - 1) /
decode time; tau = tokens per round; ms per round and the engine's stage times per round (draft, tree,
verify, commit; the stage timers synchronise the device at each boundary, as they always do); lossless =
greedy tokens equal to plain decoding's.

Modes (``--modes``, default eager,graph): ``eager`` = generate(eager=True), the host-driven loop; ``device`` =
the device-resident round (the kernels a graph replays) launched eagerly; ``graph`` = generate(eager=False),
each round one CUDA-graph replay and one host read (CUDA only; "n/a" elsewhere). graph/eager = eager ms
per round / graph ms per round: the host and launch overhead a graph removes.

Outside kernels (CUDA only, else n/a; per mode): prompt 0 is generated twice more under torch.profiler, once with
max_tokens = 1 (prefill only) and once in full; the kernel time of the rounds = union of the device
intervals of kernels (and memcpy/memset) of the full run minus that of the prefill-only run. Fraction
outside kernels = 1 - that / the decode wall time of the same prompt without the profiler (same tokens,
same rounds). Also: kernel launches per round and device-busy ms per round.

Writes ``<out>/round-<gpu>.json`` and ``.md`` (``cpu`` off the GPU); prints a short table last.
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
from kdtree_engine.bench_spec import Prompt, default_prompts, device_tag, environment, setting_name  # noqa: E402
from kdtree_engine.engine import (load_drafter, load_target, load_tokenizer, resolve_device,  # noqa: E402
                                  resolve_dtype)
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.sampling import SamplingParams  # noqa: E402
from kdtree_engine.speculative.decode import generate  # noqa: E402

DEMO = ROOT / "kdtree_engine" / "assets" / "demo"
GRAPH_NA = "n/a: CUDA graphs need a CUDA device"
FALLBACK_TEXT = (
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    out = []\n"
    "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
)


# ---- prompts ---------------------------------------------------------------------------------

def make_prompts(tokenizer: Any, vocab: int, num: int, tokens: int) -> tuple[list[Prompt], str]:
    if tokenizer is not None:
        try:
            return default_prompts(tokenizer, num, tokens), "held-out stdlib files"
        except Exception:  # noqa: BLE001 - any failure falls back to the fixed snippet
            ids = tokenizer.encode(FALLBACK_TEXT, special=True, add_special_tokens=True)[:tokens]
            return [Prompt(ids=ids, text=FALLBACK_TEXT)], "fixed snippet"
    g = torch.Generator().manual_seed(0)
    return ([Prompt(ids=torch.randint(2, vocab, (tokens,), generator=g).tolist()) for _ in range(num)],
            "random token ids (no tokenizer)")


# ---- profiler --------------------------------------------------------------------------------

def device_busy(prof: Any) -> dict:
    """Union of device-side intervals (kernels, memcpy, memset) in a profile: busy us and event count."""
    spans = []
    kernels = 0
    by_name: dict[str, list[float]] = {}  # kernel name -> [launches, device us]
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        tr = e.time_range
        spans.append((tr.start, tr.end))
        kernels += 1
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += tr.end - tr.start
    busy = common.union_us(spans)
    if not spans:  # no device events listed: fall back to the summed self device time of all ops
        total = 0.0
        for k in prof.key_averages():
            total += float(getattr(k, "self_device_time_total", getattr(k, "self_cuda_time_total", 0.0)) or 0.0)
        return {"busy_us": total, "events": 0, "method": "sum of self device time", "by_name": {}}
    return {"busy_us": busy, "events": kernels, "method": "union of device intervals", "by_name": by_name}


def kernel_table(full: dict, pre: dict, rounds: int, top: int) -> list[dict]:
    """The ``top`` kernels by device time per round: the full run's per-name launches and time minus the
    prefill-only run's, divided by the rounds."""
    rows = []
    for name, (n, us) in full["by_name"].items():
        n0, us0 = pre["by_name"].get(name, (0, 0.0))
        if n - n0 > 0:
            rows.append({"kernel": name, "launches_per_round": (n - n0) / rounds, "us_per_round": (us - us0) / rounds})
    rows.sort(key=lambda r: -r["us_per_round"])
    return rows[:top]


def profile_generate(fn: Callable[[], Any]) -> tuple[Any, dict]:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize()
    return res, device_busy(prof)


# ---- the benchmark ---------------------------------------------------------------------------

MODES = ("eager", "device", "graph")
TOP_KERNELS = 40  # kernels listed per setting (graph rounds), by device time per round
MODE_TEXT = {
    "eager": "generate(eager=True): the host-driven loop (heap tree builder, host accept, stage timers)",
    "device": "device-resident rounds run eagerly (the kernels a graph replays, launched one by one)",
    "graph": "generate(eager=False): each round one CUDA-graph replay, one host read per round",
}


def _generator(mode: str, target: Any, method: str, drafter: Any, budget: int | None) -> Callable:
    if mode == "device":
        from kdtree_engine.speculative.decode import generate_device

        def gen_device(p: Prompt, sp: SamplingParams):
            return generate_device(target, p.ids, sp, method=method, drafter=drafter, budget=budget, graph=False)
        return gen_device

    def gen(p: Prompt, sp: SamplingParams):
        return generate(target, p.ids, sp, spec=method, drafter=drafter, budget=budget, eager=mode == "eager")
    return gen


def _kernel_profile(cuda: bool, gen: Callable, prompt: Prompt, params: SamplingParams, r0: dict,
                    plain0: list[int]) -> dict:
    """Time outside kernels (CUDA): profiled prefill-only and full runs of prompt 0."""
    if not cuda:
        return {"outside_kernels_frac": None, "note": "n/a: no CUDA device"}
    try:
        _, pre = profile_generate(lambda: gen(prompt, dataclasses.replace(params, max_tokens=1)))
        res, full = profile_generate(lambda: gen(prompt, params))
        busy_us = full["busy_us"] - pre["busy_us"]
        n_rounds = res.stats["rounds"]
        return {
            "prompt": 0, "rounds": n_rounds, "same_tokens": res.token_ids == plain0,
            "busy_method": full["method"],
            "device_busy_ms_per_round": busy_us / 1e3 / n_rounds if n_rounds else None,
            "wall_ms_per_round": 1e3 * r0["decode_s"] / r0["rounds"] if r0["rounds"] else None,
            "launches_per_round": (full["events"] - pre["events"]) / n_rounds if n_rounds else None,
            "outside_kernels_frac": 1 - busy_us / 1e6 / r0["decode_s"] if r0["decode_s"] > 0 else None,
            "profiled_wall_s": res.stats["decode_s"],
            "top_kernels": kernel_table(full, pre, n_rounds, TOP_KERNELS) if n_rounds else [],
        }
    except Exception as exc:  # noqa: BLE001 - the profile is reported missing, the rates stand
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "outside_kernels_frac": None}


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    clock = common.Clock()
    dev = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    cuda = dev.type == "cuda"
    policy = KernelPolicy.from_env(batch_invariant=args.batch_invariant == "on")  # on: the engine's default
    model = Path(args.model)
    draft = Path(args.draft) if args.draft else (model / "draft" if (model / "draft").is_dir() else None)
    target = load_target(model, device=dev, dtype=dtype, progress=False, policy=policy)
    drafter = load_drafter(draft, target) if draft is not None else None
    tok = load_tokenizer(model)
    prompts, source = make_prompts(tok, target.cfg.vocab_size, args.prompts, args.prompt_tokens)
    log(f"loaded {model.name} (+ {draft.name if draft else 'no drafter'}) on {dev} {dtype}, "
        f"{len(prompts)} prompts ({clock():.1f} s)")
    settings: list[tuple[str, int | None]] = [("none", None)]
    if drafter is not None:
        settings += [("dflash", None)] + [("ddtree", b) for b in args.budgets]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warm = dataclasses.replace(params, max_tokens=min(args.max_tokens, args.warmup_tokens))

    modes = [m for m in args.modes if m != "graph" or cuda]
    results = []
    plain: list[list[int]] | None = None
    for method, budget in settings:
        name = setting_name(method, budget)
        d = drafter if method != "none" else None
        rec: dict[str, Any] = {"setting": name, "method": method, "budget": budget}
        for mode in MODES:
            if mode not in modes:
                rec[mode] = GRAPH_NA if mode == "graph" and not cuda else "n/a: not run (--modes)"
                continue
            gen = _generator(mode, target, method, d, budget)
            gen(prompts[0], warm)
            runs = []
            for i, p in enumerate(prompts):
                res = gen(p, params)
                s = res.stats
                runs.append({"prompt": i, "tokens": s["generated_tokens"], "rounds": s["rounds"],
                             "decode_s": s["decode_s"], "prefill_s": s["prefill_s"], "tau": s["tau"],
                             **{k: s[k] for k in ("draft_s", "tree_s", "verify_s", "commit_s")},
                             "token_ids": res.token_ids})
            if plain is None:
                plain = [r["token_ids"] for r in runs]
            decode = sum(r["decode_s"] for r in runs)
            rounds = sum(r["rounds"] for r in runs)
            steps = sum(max(r["tokens"] - 1, 0) for r in runs)
            m: dict[str, Any] = {
                "rounds_per_s": rounds / decode if decode > 0 else None,
                "tokens_per_s": steps / decode if decode > 0 else None,
                "ms_per_round": 1e3 * decode / rounds if rounds else None,
                "rounds": rounds, "decode_s": decode,
                "lossless": all(r["token_ids"] == ref for r, ref in zip(runs, plain)),
            }
            if mode == "eager":
                rec.update({
                    "prompts": len(runs), "tokens": sum(r["tokens"] for r in runs), "rounds": rounds,
                    "decode_s": decode, "tau": steps / rounds if rounds else None,
                    "stage_ms_per_round": {k[:-2]: 1e3 * sum(r[k] for r in runs) / rounds if rounds else None
                                           for k in ("draft_s", "tree_s", "verify_s", "commit_s")},
                    "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
                })
            m["kernels"] = _kernel_profile(cuda, gen, prompts[0], params, runs[0], plain[0])
            rec[mode] = m
        rec["lossless"] = all(rec[mo]["lossless"] for mo in modes)
        rec["kernels"] = rec["eager"]["kernels"]
        ge, gg = rec["eager"], rec.get("graph")
        if isinstance(gg, dict) and ge["ms_per_round"] and gg["ms_per_round"]:
            rec["graph_vs_eager"] = {"speedup": ge["ms_per_round"] / gg["ms_per_round"],
                                     "ms_saved_per_round": ge["ms_per_round"] - gg["ms_per_round"]}
        results.append(rec)
        log(f"{name:>10}: " + "; ".join(
            f"{mo} {rec[mo]['rounds_per_s']:.1f} rounds/s {rec[mo]['tokens_per_s']:.1f} tok/s "
            f"outside kernels {_pct(rec[mo]['kernels'].get('outside_kernels_frac'))}" for mo in modes)
            + f", tau {rec['tau']:.2f} ({clock():.0f} s)")
    for mode in modes:
        base = results[0][mode]["tokens_per_s"]
        for rec in results:
            t = rec[mode]["tokens_per_s"]
            rec[mode]["speedup"] = t / base if base and t else None
    env = environment(dev, dtype)
    if cuda:
        env["gpu"] = common.device_info()
    return {
        "command": args.command, "env": env, "model": str(model), "draft": str(draft) if draft else None,
        "block_size": getattr(drafter, "block_size", None), "prompt_source": source,
        "prompt_tokens": [len(p.ids) for p in prompts], "max_tokens": args.max_tokens,
        "budgets": list(args.budgets), "batch_invariant": args.batch_invariant == "on",
        "modes": {"eager": MODE_TEXT["eager"], "device": MODE_TEXT["device"],
                  "graph": MODE_TEXT["graph"] if cuda else GRAPH_NA},
        "results": results, "elapsed_s": clock(),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _rate(m: Any, key: str) -> Any:
    return m.get(key) if isinstance(m, dict) else "n/a"


def markdown(rep: dict, tag: str) -> list[str]:
    env = rep["env"]
    lines = [f"# Decoding rounds end to end ({tag})", "",
             f"Command: `{rep['command']}`", "",
             f"torch {env['torch']}, device {env['device']} ({env['device_name']}), dtype {env['dtype']}. "
             f"Model `{rep['model']}`, drafter `{rep['draft']}` (block {rep['block_size']}); "
             f"{len(rep['prompt_tokens'])} prompts of {rep['prompt_tokens']} tokens ({rep['prompt_source']}), "
             f"{rep['max_tokens']} tokens each, greedy, EOS ignored, one warm-up per setting and mode; "
             f"batch-invariant matmuls {'on' if rep['batch_invariant'] else 'off'}.", "",
             "Decode only (prefill excluded). Modes: " + "; ".join(f"**{k}**: {v}" for k, v in rep["modes"].items())
             + ". Outside kernels: 1 - device-busy time (union of kernel / memcpy intervals, torch.profiler, "
             "prefill subtracted) / decode wall time of the same prompt unprofiled. Stage ms: the eager loop's "
             "stage timers (they synchronise at each stage boundary). graph/eager: eager ms per round / graph ms "
             "per round.", ""]
    rows = []
    for r in rep["results"]:
        e, g, dv, st = r["eager"], r["graph"], r["device"], r["stage_ms_per_round"]
        ek, gk = e["kernels"], g.get("kernels", {}) if isinstance(g, dict) else {}
        rows.append([r["setting"], r["tau"],
                     e["rounds_per_s"], _rate(dv, "rounds_per_s"), _rate(g, "rounds_per_s"),
                     e["ms_per_round"], _rate(dv, "ms_per_round"), _rate(g, "ms_per_round"),
                     e["tokens_per_s"], _rate(g, "tokens_per_s"),
                     r.get("graph_vs_eager", {}).get("speedup", "n/a"),
                     ek.get("device_busy_ms_per_round"), ek.get("launches_per_round"),
                     _pct(ek.get("outside_kernels_frac")), _pct(gk.get("outside_kernels_frac")),
                     st["draft"], st["tree"], st["verify"], st["commit"],
                     "yes" if r["lossless"] else "NO"])
    lines += common.md_table(["setting", "tau", "eager rounds/s", "device rounds/s", "graph rounds/s",
                              "eager ms/round", "device ms/round", "graph ms/round", "eager tok/s", "graph tok/s",
                              "graph/eager", "kernel ms/round", "launches/round", "outside kernels eager",
                              "outside kernels graph", "draft ms", "tree ms", "verify ms", "commit ms",
                              "lossless"], rows)
    lines += kernel_sections(rep)
    lines += ["", f"Elapsed {rep['elapsed_s']:.0f} s."]
    return lines


def kernel_sections(rep: dict) -> list[str]:
    """Per setting: the graph round's kernels by device time (prompt 0 profiled, prefill subtracted)."""
    lines: list[str] = []
    for r in rep["results"]:
        g = r["graph"]
        top = g.get("kernels", {}).get("top_kernels") if isinstance(g, dict) else None
        if not top:
            continue
        total = sum(k["us_per_round"] for k in top)
        lines += ["", f"### {r['setting']}: kernels of a graph round (top {len(top)} by device time, "
                      f"{total:.1f} us per round in these)", ""]
        lines += common.md_table(["kernel", "launches/round", "us/round", "us/launch"],
                                 [[k["kernel"][:90].replace("|", "/"), k["launches_per_round"], k["us_per_round"],
                                   k["us_per_round"] / k["launches_per_round"]] for k in top])
    return lines


def short_table(rep: dict) -> str:
    def f(x: Any, fmt: str) -> str:
        return fmt % x if isinstance(x, (int, float)) else "n/a"

    out = [f"{'setting':>10} {'tau':>5} {'eager r/s':>10} {'device r/s':>10} {'graph r/s':>10} "
           f"{'eager ms':>9} {'graph ms':>9} {'out eager':>9} {'out graph':>9} lossless"]
    for r in rep["results"]:
        e, g, dv = r["eager"], r["graph"], r["device"]
        gk = g.get("kernels", {}) if isinstance(g, dict) else {}
        out.append(f"{r['setting']:>10} {r['tau']:>5.2f} {e['rounds_per_s']:>10.1f} "
                   f"{f(_rate(dv, 'rounds_per_s'), '%.1f'):>10} {f(_rate(g, 'rounds_per_s'), '%.1f'):>10} "
                   f"{e['ms_per_round']:>9.2f} {f(_rate(g, 'ms_per_round'), '%.2f'):>9} "
                   f"{_pct(e['kernels'].get('outside_kernels_frac')):>9} {_pct(gk.get('outside_kernels_frac')):>9} "
                   f"{'yes' if r['lossless'] else 'NO'}")
    if not isinstance(rep["results"][0]["graph"], dict):
        out.append(f"(graph: {rep['results'][0]['graph']})")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--model", default=str(DEMO), help="target checkpoint directory (default: the embedded demo)")
    ap.add_argument("--draft", default=None, help="DFlash drafter directory (default: <model>/draft if present)")
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 32],
                    help="DDTree budgets (non-root nodes), comma separated")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128; --tiny 6)")
    ap.add_argument("--prompts", type=int, default=None, help="number of prompts (default 4; --tiny 1)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 64; --tiny 16)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up run (default 32; --tiny 3)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="on",
                    help="on (the engine's default, as kdtree --batch-invariant on): dense matmuls, RMSNorm and "
                         "MLA attention through the batch-invariant Triton kernels; off: cuBLAS and torch")
    ap.add_argument("--modes", type=lambda t: [x for x in t.split(",") if x], default=["eager", "graph"],
                    help="comma separated among eager, device, graph (default eager,graph; eager always runs, "
                         "graph only on CUDA; device = the graph's kernels launched one by one, slow on CUDA)")
    ap.add_argument("--tiny", action="store_true", help="one short prompt, a few tokens (smoke test)")
    a = ap.parse_args(argv)
    a.max_tokens = a.max_tokens or (6 if a.tiny else 128)
    a.prompts = a.prompts or (1 if a.tiny else 4)
    a.prompt_tokens = a.prompt_tokens or (16 if a.tiny else 64)
    a.warmup_tokens = a.warmup_tokens or (3 if a.tiny else 32)
    if any(m not in MODES for m in a.modes):
        ap.error(f"--modes must be among {', '.join(MODES)}")
    if "eager" not in a.modes:
        a.modes = ["eager"] + a.modes  # the reference column
    if min(a.max_tokens, a.prompts, a.prompt_tokens, a.warmup_tokens) < 1 or any(b < 1 for b in a.budgets):
        ap.error("counts and budgets must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    args.command = common.command_line(argv, "python3 bench/round.py")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    dev = resolve_device(args.device)
    threads = torch.get_num_threads()
    if dev.type == "cpu" and args.tiny:
        torch.set_num_threads(1)  # a tiny model: extra threads only add contention
    try:
        rep = run(args, log)
    finally:
        torch.set_num_threads(threads)
    tag = device_tag(dev)
    jp, mp = common.write_results(args.out, f"round-{tag}", rep, markdown(rep, tag), command=args.command,
                                  device=dev)
    print(f"wrote {jp} and {mp}")
    print(short_table(rep))
    return rep


if __name__ == "__main__":
    main()
