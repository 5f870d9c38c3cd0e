"""A prompt's forward replayed from a CUDA graph per length bucket: what it would do to the demo's time to first token
(an experiment for the long-context issue's 5 ms goal; the engine prefills eagerly today, docs/long_context.md).

    python3 bench/prefill_graph.py --out bench/results                       # one H200, the demo target
    python3 bench/prefill_graph.py --device cpu --prompts 5 --buckets 16,32 --out DIR   # CPU smoke run (eager)

For each bucket B (``--buckets``) one static prompt step is captured: ids [B] into a fresh request's slots 0..B-1,
positions 0..B-1 (rope rows gathered without a host read), MLA's naive form on the prefill kernel, the drafter's aux
layers, the final norm, and the lm_head of one row picked on the device (the last real token). A prompt of T tokens
takes the smallest bucket B >= T: its ids copied into the static buffer (zeros after them), the graph replayed. The
padded rows come after the real ones, so no real query sees them (causal attention), and every other kernel is
batch-invariant, so the real rows' logits and aux rows should be those of the eager prefill bit for bit: checked for
every prompt (CUDA), beside the TTFT of both (the prefill and the first token's pick, median over ``--prompts``
prompts of random lengths).

Writes ``<out>/prefill_graph-<device>.json`` and ``.md``.
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
from kdtree_engine.cache import LatentCache  # noqa: E402
from kdtree_engine.kernels.common import take_rows  # noqa: E402
from kdtree_engine.model.context import StepContext  # noqa: E402
from kdtree_engine.model.target import Target  # noqa: E402


class BucketStep:
    """The static prompt step of bucket B over ``cache`` (fresh: nothing committed)."""

    def __init__(self, target: Target, cache: LatentCache, B: int, aux_layers: tuple[int, ...]) -> None:
        dev = target.device
        self.target, self.cache, self.B, self.aux_layers = target, cache, B, aux_layers
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)   # the last real row
        target.rope.ensure(B + 1)
        pos = torch.arange(B, device=dev)
        cos, sin = target.rope.gather(pos)
        self.ctx = StepContext(pos, cos, sin, pos, 0, None, cache.table, cache.rows(pos))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = self.aux = None

    def body(self) -> None:
        t = self.target
        x, aux = t._layers(t.embed(self.ids), self.ctx, self.cache, self.aux_layers)
        self.logits = t.lm_head(take_rows(x, self.last))
        self.aux = aux

    def capture(self) -> None:
        self.graph = common.capture_graph(self.body)

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = ids.shape[0]
        self.ids.zero_()
        self.ids[:T].copy_(ids)
        self.last.fill_(T - 1)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()
        return self.logits, None if self.aux is None else self.aux[:T]


def run(args: argparse.Namespace, log: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] = lambda rep: None) -> dict[str, Any]:
    from kdtree_engine.engine import LLM
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    llm = LLM(device=dev.type, progress=False, warm_up=False, threads=1 if not cuda else None)
    target = llm.target
    aux_layers = tuple(llm.drafter.target_layer_ids) if llm.drafter is not None else ()
    steps = {}
    for B in sorted(args.buckets):
        cache = target.new_cache(B + 64)
        cache.reserve(B)   # the capture writes slots 0..B-1; the cache is rewritten by every prompt of the bucket
        steps[B] = BucketStep(target, cache, B, aux_layers)
        if cuda:
            steps[B].capture()
    log(f"{len(steps)} bucket step(s) {'captured' if cuda else 'built (eager on the CPU)'}")
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = 1, max(args.buckets)
    lengths = torch.randint(lo, hi + 1, (args.prompts,), generator=g).tolist()
    V = target.cfg.vocab_size
    rows = []
    for T in lengths:
        ids = torch.randint(0, V, (T,), generator=g).to(dev)
        step = steps[min(B for B in steps if B >= T)]
        common_sync = torch.cuda.synchronize if cuda else (lambda: None)
        # eager: the engine's prefill into a fresh cache, the first token read on the host
        eager_cache = target.new_cache(T + 1)
        try:
            common_sync()
            t0 = time.perf_counter()
            ref = target.prefill(ids, eager_cache, aux_layers=aux_layers)
            first_eager = int(ref.logits[-1].argmax())
            eager_s = time.perf_counter() - t0
        finally:
            eager_cache.release()
        common_sync()
        t0 = time.perf_counter()
        logits, aux = step.run(ids)
        first_graph = int(logits[-1].argmax())
        graph_s = time.perf_counter() - t0
        diff = (logits[-1] - ref.logits[-1]).abs().max() / ref.logits[-1].abs().max()
        row = {"tokens": T, "bucket": step.B, "eager_ms": eager_s * 1e3, "graph_ms": graph_s * 1e3,
               "same_first_token": first_eager == first_graph, "logits_max_rel": float(diff)}
        if cuda:
            row["logits_bitwise"] = bool(torch.equal(logits[-1], ref.logits[-1]))
            row["aux_bitwise"] = aux is None or bool(torch.equal(aux, ref.aux))
        rows.append(row)
    for s in steps.values():
        s.cache.release()
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    rep = {"device": dev.type, "buckets": sorted(args.buckets), "seed": args.seed, "prompts": len(rows), "rows": rows,
           "eager_ms_median": med("eager_ms"), "graph_ms_median": med("graph_ms"),
           "graph_ms_max": max(r["graph_ms"] for r in rows),
           "all_same_first_token": all(r["same_first_token"] for r in rows),
           "logits_max_rel": max(r["logits_max_rel"] for r in rows),
           "all_bitwise": all(r.get("logits_bitwise", True) and r.get("aux_bitwise", True) for r in rows) if cuda
           else None}
    save(rep)
    log(f"TTFT median: eager {rep['eager_ms_median']:.2f} ms, graph {rep['graph_ms_median']:.2f} ms "
        f"(max {rep['graph_ms_max']:.2f}); bitwise: {rep['all_bitwise']}")
    return rep


def markdown(rep: dict[str, Any], label: str) -> list[str]:
    out = [f"# The demo's prompt forward replayed from a graph per bucket ({label})", "",
           f"{rep['prompts']} prompts of random lengths (seed {rep['seed']}), buckets {rep['buckets']}. TTFT (the prefill "
           f"and the first token read on the host): eager median {rep['eager_ms_median']:.2f} ms, graph median "
           f"{rep['graph_ms_median']:.2f} ms, graph max {rep['graph_ms_max']:.2f} ms. The same first token for every "
           f"prompt: {rep['all_same_first_token']}; logits and aux rows bit for bit: {rep['all_bitwise']}.", ""]
    out += common.md_table(["tokens", "bucket", "eager ms", "graph ms", "same first token", "logits bitwise",
                            "aux bitwise"],
                           [[r["tokens"], r["bucket"], r["eager_ms"], r["graph_ms"], r["same_first_token"],
                             r.get("logits_bitwise"), r.get("aux_bitwise")] for r in rep["rows"]])
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--buckets", type=ints, default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    if not a.buckets or min(a.buckets) < 1 or a.prompts < 1:
        ap.error("--buckets and --prompts must be positive")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return common.bench_main(argv, "bench/prefill_graph.py", args.out, args.device, lambda tag: f"prefill_graph-{tag}",
                             markdown, lambda log, save: run(args, log, save))


if __name__ == "__main__":
    main()
