"""Kernel-launch census of one decoding round on the CPU: which parts of the model issue how many ops.

    python bench/launch_census.py                       # torch paths (the CPU backends)
    python bench/launch_census.py --triton              # the CUDA kernel choices, run in the Triton interpreter
    python bench/launch_census.py --methods none --budget 32 --top 30 --json out.json

One device-resident round (:class:`DeviceRound.step`, what a CUDA graph replays) per method (none, dflash,
ddtree at ``--budget``) of the embedded demo model and its drafter, after a prompt and one warm-up round.

``--batch N[,N...]``: instead, one step of the continuous batch (``Scheduler.step`` with static steps, the
arithmetic CUDA replays from graphs) with N DDTree requests at ``--budget`` (greedy, or ``--sampled``), after their
prompts and two warm-up steps: the ops the HOST launches in that step. The bodies CUDA replays from a graph (the
static slots' forward, the draft slots' pass, the tree slots' whole round, where the code has them) are not counted;
everything else is (the draft pass where it is host-driven, top-k, trees, the slots' inputs, picks, walks, commits).
Every op that would be a device kernel is counted and attributed to a part of the model:

  * aten ops, seen through a TorchDispatchMode; views (``OpOverload.is_view``) and bare allocations
    (empty*) are not counted: they launch nothing on CUDA;
  * Triton launches (``--triton``: ``TRITON_INTERPRET=1`` with every backend forced to Triton, i.e. the
    kernel choices of CUDA with batch invariance on); the torch ops the interpreter itself runs while
    executing a kernel are not counted.

A part is chosen from the Python call stack (innermost frame of the engine that names one): drafter,
mla, rope, norm, router, experts, shared expert, dense mlp, layer (residual adds and glue), lm_head, tree,
accept, commit, round (the rest of the round's bookkeeping). Target layers are counted per layer type.

How this differs from the CUDA launch count: one aten op is usually one kernel, but some are several on
CUDA (sort, topk, nonzero, index_copy with a deterministic path), and some CPU-only paths have no CUDA twin
(without ``--triton``: dense and INT4 matmuls are ``F.linear`` / dequantize + matmul, MLA attention is the
masked torch reference, the MoE runs every expert; on CUDA they are the batch-invariant Triton GEMM (+ a
split-K sum), the W4A16 kernels, the MLA chunk + merge kernels and the fused MoE). ``--triton`` mirrors
CUDA closely (the DDTree builder too: one Triton program); it runs every kernel in the interpreter, which
takes minutes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

if "--triton" in sys.argv:  # must be set before triton and the dispatch module are imported
    os.environ.update(TRITON_INTERPRET="1", KDTREE_DENSE_BACKEND="triton", KDTREE_ATTN_BACKEND="triton",
                      KDTREE_INT4_BACKEND="triton", KDTREE_TREE_BACKEND="triton")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kdtree_engine.engine import load_drafter, load_target  # noqa: E402
from kdtree_engine.records import command_line, run_metadata  # noqa: E402
from kdtree_engine.speculative.config import SpecConfig  # noqa: E402
from kdtree_engine.speculative.device_round import DeviceRound  # noqa: E402

DEMO = ROOT / "kdtree_engine" / "assets" / "demo"
PKG = str(ROOT / "kdtree_engine")

# (file, function or class.function) -> part; the innermost matching frame decides
PARTS: dict[tuple[str, str], str] = {
    ("reference.py", "apply_rope"): "rope",
    ("rope.py", "*"): "rope",
    ("layers.py", "RMSNorm.forward"): "norm",
    ("reference.py", "rms_norm_torch"): "norm",
    ("rmsnorm.py", "*"): "norm",
    ("moe.py", "Router.forward"): "router",
    ("reference.py", "route_torch"): "router",
    ("reference.py", "stable_top"): "router",
    ("router.py", "*"): "router",
    ("moe.py", "moe"): "experts",
    ("moe_w4a16.py", "*"): "experts",
    ("layers.py", "MLP.forward"): "mlp",
    ("moe.py", "MoE.forward"): "moe glue",
    ("mla.py", "*"): "mla",
    ("reference.py", "mla_attention_reference"): "mla",
    ("reference.py", "mla_attention_masked"): "mla",
    ("mla_attention.py", "*"): "mla",
    ("target.py", "Target.lm_head"): "lm_head",
    ("target.py", "Target.embed"): "embed",
    ("target.py", "static_visibility"): "visibility",
    ("target.py", "*"): "layer",
    ("tree.py", "*"): "tree",
    ("reference.py", "topk_logprobs_torch"): "tree",
    ("tree_ops.py", "*"): "tree",
    ("accept.py", "*"): "accept",
    ("cache.py", "*"): "commit",
    ("device_round.py", "*"): "round",
    ("sampling.py", "*"): "round",
    ("walks.py", "*"): "accept",
    ("host_rounds.py", "*"): "round",
    ("graph_step.py", "*"): "slots",
    ("draft_slots.py", "*"): "drafter",
    ("scheduler.py", "*"): "batch",
}


def _frame_key(frame: Any) -> tuple[str, str] | None:
    path = frame.f_code.co_filename
    if not path.startswith(PKG):
        return None
    return os.path.basename(path), frame.f_code.co_qualname


class Census(TorchDispatchMode):
    """Counts kernel-like aten ops and Triton launches by (part, target layer, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()  # (part, layer or None, op name)
        self.paused = 0

    def where(self) -> tuple[str, int | None]:
        f = sys._getframe(2)
        part: str | None = None
        layer: int | None = None
        drafter = False
        while f is not None:
            key = _frame_key(f)
            if key is not None:
                if key[0] == "dflash.py":
                    drafter = True
                if part is None:
                    part = PARTS.get(key) or PARTS.get((key[0], "*"))
                    if part == "mlp" and _in_moe(f):
                        part = "shared"
                if layer is None and key[1].startswith("DecoderLayer."):
                    layer = _layer_index(f)
            f = f.f_back
        if drafter:
            return "drafter", None
        return part or "other", layer

    def record(self, name: str) -> None:
        part, layer = self.where()
        self.counts[(part, layer, name)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if not self.paused and not func.is_view and func.__name__.split(".")[0] not in FREE:
            self.record(func.__name__.split(".")[0])
        return out


FREE = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "_reshape_alias", "_unsafe_view",
        "set_", "resize_", "promote_types", "result_type"}  # no kernel on CUDA


def _in_moe(frame: Any) -> bool:
    f = frame.f_back
    while f is not None:
        if f.f_code.co_qualname == "MoE.forward":
            return True
        f = f.f_back
    return False


def _layer_index(frame: Any) -> int | None:
    me = frame.f_locals.get("self")
    return getattr(me, "census_index", None)


def hook_triton(census: Census) -> None:
    """Count interpreted Triton launches (and pause the aten count while the interpreter runs one)."""
    from triton.runtime import interpreter

    orig = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if not census.paused:   # a launch inside a paused body (a graph's) is not the host's
            census.record("triton:" + self.fn.__name__)
        census.paused += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            census.paused -= 1

    interpreter.GridExecutor.__call__ = call


def layer_types(target: Any) -> dict[int, str]:
    from kdtree_engine.model.moe import MoE
    kinds = {}
    for i, layer in enumerate(target.layers):
        layer.census_index = i
        kinds[i] = "moe layer" if isinstance(layer.mlp, MoE) else "dense layer"
    return kinds


def summarize(counts: Counter, kinds: dict[int, str]) -> dict:
    """Totals per part, per layer type (mean per layer of that type) and the top ops."""
    per_part: Counter = Counter()
    per_layer: dict[int, Counter] = defaultdict(Counter)
    ops: Counter = Counter()
    for (part, layer, op), n in counts.items():
        per_part["target layers" if layer is not None else part] += n
        if layer is not None:
            per_layer[layer][part] += n
        ops[(part, op)] += n
    by_type: dict[str, dict[str, float]] = {}
    for kind in sorted(set(kinds.values())):
        idx = [i for i, k in kinds.items() if k == kind]
        parts: Counter = Counter()
        for i in idx:
            parts.update(per_layer[i])
        by_type[kind] = {p: n / len(idx) for p, n in sorted(parts.items(), key=lambda kv: -kv[1])}
        by_type[kind]["total"] = sum(parts.values()) / len(idx)
    return {"total": sum(counts.values()), "parts": dict(per_part.most_common()), "per_layer_type": by_type,
            "top_ops": [(f"{p}:{o}", n) for (p, o), n in ops.most_common()]}


def census_round(rnd: DeviceRound, prompt: list[int], triton: bool) -> Counter:
    rnd.prefill(prompt)
    rnd.step()  # warm-up (lazy weight preparation, interpreter set-up)
    census = Census()
    if triton:
        hook_triton(census)
    with census:
        rnd.step()
    return census.counts


def census_batch(target: Any, drafter: Any, n: int, budget: int, triton: bool, sampled: bool = False) -> Counter:
    """The host's ops in one step of ``n`` DDTree requests through the scheduler's static steps (graph bodies
    paused: CUDA replays them)."""
    from kdtree_engine.batch import graph_step
    from kdtree_engine.batch.scheduler import Scheduler
    from kdtree_engine.sampling import SamplingParams
    census = Census()
    bodies = [(graph_step.Slots, "run")]
    for module, cls in (("draft_slots", "SlotSet"), ("tree_slots", "TreeSlots")):
        try:   # code without them: the draft pass (the round) is host-driven, and counted
            bodies.append((getattr(importlib.import_module(f"kdtree_engine.batch.{module}"), cls), "run"))
        except ImportError:
            pass

    def paused(fn: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            census.paused += 1
            try:
                return fn(self, *args)
            finally:
                census.paused -= 1
        return run
    saved = [(cls, name, getattr(cls, name)) for cls, name in bodies]
    for cls, name, fn in saved:
        setattr(cls, name, paused(fn))
    try:
        sched = Scheduler(target, drafter, token_budget=4096, step_mode="static")
        for i in range(n):
            params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=i)
            sched.submit(list(range(2 + i, 26 + i)), params, spec="ddtree", budget=budget)
        for _ in range(3):   # the prompts, then two tree steps (lazy weight preparation, the slots)
            sched.step()
        if triton:
            hook_triton(census)
        with census:
            sched.step()
        sched.close()
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    return census.counts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--methods", default="none,dflash,ddtree")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--triton", action="store_true", help="CUDA kernel choices in the Triton interpreter")
    ap.add_argument("--top", type=int, default=15, help="ops listed per method")
    ap.add_argument("--json", default=None, help="write the summaries here")
    ap.add_argument("--batch", default=None, help="requests a batched step, comma-separated: the host's ops of one "
                    "scheduler step of that many DDTree requests at --budget (instead of device rounds)")
    ap.add_argument("--sampled", action="store_true", help="--batch: sampled requests (temperature 0.8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    target = load_target(args.model, device=dev, dtype=dtype, progress=False)
    drafter = load_drafter(args.draft, target)
    kinds = layer_types(target)
    prompt = list(range(2, 26))
    report = {"mode": "triton-interpreter" if args.triton else "torch (cpu backends)", "methods": {}}
    if args.batch:
        report["batch"] = {}
        for n in (int(x) for x in args.batch.split(",")):
            s = summarize(census_batch(target, drafter, n, args.budget, args.triton, args.sampled), kinds)
            report["batch"][n] = s
            kind = "sampled" if args.sampled else "greedy"
            print(f"== {n} {kind} requests, ddtree-{args.budget}: {s['total']} host ops a step [{report['mode']}]")
            print("   parts: " + ", ".join(f"{p} {c}" for p, c in s["parts"].items()))
            print("   top ops: " + ", ".join(f"{o} {c}" for o, c in s["top_ops"][: args.top]))
    for method in ([] if args.batch else args.methods.split(",")):
        shape = SpecConfig(method, args.budget if method == "ddtree" else None).resolve(drafter.block_size,
                                                                                       target.cfg.vocab_size)
        rnd = DeviceRound(target, drafter, shape, args.capacity)
        s = summarize(census_round(rnd, prompt, args.triton), kinds)
        name = f"ddtree-{args.budget}" if method == "ddtree" else method
        report["methods"][name] = s
        print(f"== {name} (N1={rnd.n1}): {s['total']} ops per round [{report['mode']}]")
        print("   parts: " + ", ".join(f"{p} {n}" for p, n in s["parts"].items()))
        for kind, parts in s["per_layer_type"].items():
            print(f"   per {kind}: " + ", ".join(f"{p} {n:g}" for p, n in parts.items()))
        print("   top ops: " + ", ".join(f"{o} {n}" for o, n in s["top_ops"][: args.top]))
    if args.json:
        meta = run_metadata(command_line(argv, "python3 bench/launch_census.py"), device="cpu")
        Path(args.json).write_text(json.dumps({"meta": meta, **report}, indent=1))
    return report


if __name__ == "__main__":
    main()
