"""Moonlight-16B-A3B on one GPU: plain decoding and DDTree verify steps by tree size, BF16 and INT4 experts, against
the byte roofline.

    python bench/moonlight.py --out bench/results             # H200: the real shape, random weights
    python bench/moonlight.py --tiny --device cpu --out DIR   # CPU smoke run

The model: config.py's ``moonlight-16b`` preset at its exact shape (27 layers, hidden 2048, 64 routed experts
top-6 + 2 shared, vocabulary 163,840), built on the device with random weights (nothing is downloaded), once
with BF16 routed experts and once with INT4 ones (W4A16 group 32, the layout ``--quantize w4a16`` loads: random
words and scales of the same shapes, so the same bytes and kernels). Every other weight is BF16.

A step is the target's device-resident forward (the one a round's CUDA graph replays: the committed length on
the device) of T tokens over a latent cache of ``--context`` tokens: T = 1 is a plain decoding step, T > 1 a
DDTree verify step of a random tree of T nodes (the drafter, tree build and accept walk are not included).
Each step is captured in a CUDA graph and replayed (bench/common.time_calls).

Roofline: bytes a step must read = every weight except the routed experts and the embedding (its T rows), the
routed experts that the step's routing touches (distinct experts per layer, counted in one eager run of the same
step), the latent cache; time at copy bandwidth (measured in this run) / measured time = x roof (1.0 = the
step runs at copy speed). Writes ``<out>/moonlight-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.k2_step import random_tree, randomize_  # noqa: E402
from bench.moe_formats import copy_bandwidth, env_info, time_us, write  # noqa: E402
from kdtree_engine.config import ModelConfig, preset  # noqa: E402
from kdtree_engine.kernels.dispatch import prepare_int4  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.model.moe import MoE  # noqa: E402
from kdtree_engine.model.target import Target  # noqa: E402
from kdtree_engine.quant import k2_quantization_config, parse_quantization_config  # noqa: E402

NODES = (1, 4, 8, 16, 32, 64)
FORMATS = ("bf16", "int4")


def tiny_config() -> ModelConfig:
    """k2-tiny reshaped like Moonlight: no query LoRA, no rope scaling, no group routing, 2 shared experts."""
    return preset("k2-tiny").replace(q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1,
                                     n_shared_experts=2, num_experts_per_tok=3, num_hidden_layers=3)


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def build(cfg: ModelConfig, fmt: str, dtype: torch.dtype, device: torch.device, policy: KernelPolicy,
          seed: int) -> Target:
    """A target of cfg's shape with random weights drawn on the device (fmt: bf16 or int4 routed experts)."""
    quant = parse_quantization_config(k2_quantization_config(32)) if fmt == "int4" else None
    target = Target(cfg, dtype=dtype, device=device, quant=quant, policy=policy)
    gen = torch.Generator(device=device).manual_seed(seed)
    for part in (target.embed_tokens, target.layers, target.norm, target.lm_head_proj):
        randomize_(part, gen)
    for layer in target.layers:
        layer.self_attn.reset_absorbed()
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.reset_parts()
            layer.mlp.experts.reset_dense()
    prepare_int4(target, dtype)
    return target


def static_bytes(target: Target) -> tuple[int, int]:
    """(bytes every step reads: all weights but the routed experts and the embedding, bytes of one routed expert)."""
    experts = [m.mlp.experts for m in target.layers if isinstance(m.mlp, MoE)]
    routed = {id(t) for ex in experts for t in list(ex.parameters()) + list(ex.buffers())}
    skip = routed | {id(target.embed_tokens.weight)}
    seen: set[int] = set()
    total = 0
    for t in list(target.parameters()) + [b for n, b in target.named_buffers() if not n.startswith("rope.")]:
        if id(t) in skip or id(t) in seen:
            continue
        seen.add(id(t))
        total += nbytes([t])
    ex = experts[0]
    one = nbytes([t[0] for t in list(ex.parameters()) + list(ex.buffers())])
    return total, one


def step_inputs(T: int, S: int, device: torch.device, seed: int, vocab: int):
    mask, depth = random_tree(T, seed) if T > 1 else (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (T,), generator=g).to(device)
    return ids, (S + depth).to(device), mask.to(device), torch.tensor(S, device=device)


def touched_experts(target: Target, run: Callable[[], object]) -> float:
    """Mean over the MoE layers of the distinct experts one run of the step routes to (forward pre-hooks)."""
    counts: list[int] = []
    hooks = [m.mlp.experts.register_forward_pre_hook(lambda _, args: counts.append(len(torch.unique(args[1]))))
             for m in target.layers if isinstance(m.mlp, MoE)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return statistics.mean(counts)


def bench_format(cfg: ModelConfig, fmt: str, dtype: torch.dtype, device: torch.device, policy: KernelPolicy,
                 nodes: Sequence[int], S: int, reps: int, copy_bw: float, seed: int,
                 log: Callable[[str], None], profile: bool = False) -> list[dict]:
    target = build(cfg, fmt, dtype, device, policy, seed)
    fixed, per_expert = static_bytes(target)
    moe_layers = sum(isinstance(m.mlp, MoE) for m in target.layers)
    cache = target.new_cache(S + max(nodes) + 1)
    target.rope.ensure(S + max(nodes) + 1)
    rows = []
    for T in nodes:
        ids, pos, mask, start = step_inputs(T, S, device, seed + T, cfg.vocab_size)

        def step(ids=ids, pos=pos, mask=mask, start=start):
            return target(ids, cache, positions=pos, tree_mask=mask, start=start)

        touched = touched_experts(target, step)
        us = time_us([step], device, reps)
        kv = S * cfg.kv_cache_dim * dtype.itemsize * cfg.num_hidden_layers
        emb = T * cfg.hidden_size * target.embed_tokens.weight.element_size()
        total = fixed + emb + kv + touched * per_expert * moe_layers
        roof_us = total / copy_bw * 1e6
        row = {"format": fmt, "T": T, "kind": "decode" if T == 1 else "verify", "us": us, "ms": us / 1e3,
               "touched_experts_per_layer": touched, "bytes": total, "roofline_us": roof_us,
               "x_roof": roof_us / us, "tokens_per_s_plain": 1e6 / us if T == 1 else None}
        if profile and T == 1 and device.type == "cuda":
            # where the plain step goes: kernels of an eager step, and the replayed graph's span against its busy time
            line = common.graph_timeline(step, reps=3)
            row["profile"] = {"kernels": common.kernel_profile(step, reps=3, top=25)["kernels"],
                              "graph_span_us": line.get("span_us"), "graph_busy_us": line.get("busy_us"),
                              "graph_launches": len(line.get("kernels", []))}
        rows.append(row)
        log(f"{fmt} T={T}: {us / 1e3:.3f} ms, {touched:.1f} experts per layer, roofline {roof_us / 1e3:.3f} ms "
            f"(x roof {row['x_roof']:.2f})")
    del target, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rep: dict, label: str) -> list[str]:
    lines = [f"# {'Moonlight-shaped tiny model' if rep['tiny'] else 'Moonlight-16B-A3B'} (random weights): "
             "decoding and DDTree verify steps", "",
             f"Device: {label}. Context {rep['context']} tokens, {rep['dtype']} activations. Copy bandwidth (read + "
             f"write) {rep['copy_Bps'] / 1e12:.2f} TB/s, measured in this run. x roof = (bytes the step reads / copy "
             "bandwidth) / time. Verify steps exclude the drafter, tree build and accept walk.", ""]
    lines += common.md_table(["experts", "T", "kind", "ms", "experts per layer", "GB read", "roofline ms", "x roof"],
                             [[r["format"], r["T"], r["kind"], r["ms"], r["touched_experts_per_layer"],
                               r["bytes"] / 1e9, r["roofline_us"] / 1e3, r["x_roof"]] for r in rep["steps"]])
    plain = {r["format"]: r["ms"] for r in rep["steps"] if r["T"] == 1}
    if len(plain) == 2:
        lines += ["", f"Plain decoding: BF16 experts / INT4 experts = {plain['bf16'] / plain['int4']:.2f}x."]
    for r in rep["steps"]:
        prof = r.get("profile")
        if not prof:
            continue
        lines += ["", f"Plain step, {r['format']} experts: replayed graph {prof['graph_launches']} launches, span "
                  f"{prof['graph_span_us']:.0f} us, kernels busy {prof['graph_busy_us']:.0f} us; kernels of one eager "
                  "step (device us):", ""]
        lines += common.kernel_lines(prof["kernels"])
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tiny", action="store_true", help="a Moonlight-shaped tiny model (CPU smoke run)")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",") if x], default=None,
                    help="tree sizes T (T=1: plain decoding; default 1,4,8,16,32,64)")
    ap.add_argument("--formats", type=lambda s: [x for x in s.split(",") if x], default=list(FORMATS),
                    help="routed experts: bf16,int4")
    ap.add_argument("--context", type=int, default=None, help="latent cache tokens (default 1024; --tiny 32)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default 20; --tiny 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: the plain step's kernels (torch.profiler) and its replayed graph's busy time")
    a = ap.parse_args(argv)
    a.nodes = a.nodes or ([1, 4] if a.tiny else list(NODES))
    a.context = a.context or (32 if a.tiny else 1024)
    a.reps = a.reps or (3 if a.tiny else 20)
    if any(t < 1 for t in a.nodes) or a.context < 1 or a.reps < 1:
        ap.error("--nodes, --context and --reps must be positive")
    bad = [f for f in a.formats if f not in FORMATS]
    if bad or not a.formats:
        ap.error(f"--formats takes {', '.join(FORMATS)}, got {','.join(a.formats)}")
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    command = common.command_line(argv, "python3 bench/moonlight.py")
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cfg = tiny_config() if args.tiny else preset("moonlight-16b")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    policy = KernelPolicy.from_env()
    copy_bw = copy_bandwidth(dev)
    steps: list[dict] = []
    with torch.no_grad():
        for fmt in args.formats:
            steps += bench_format(cfg, fmt, dtype, dev, policy, args.nodes, args.context, args.reps, copy_bw,
                                  args.seed, log, args.profile)
    rep = {"command": command, "tiny": args.tiny, "device": env_info(dev), "dtype": str(dtype).removeprefix("torch."),
           "context": args.context, "copy_Bps": copy_bw, "config": cfg.to_dict(), "steps": steps}
    return write(args.out, "moonlight", rep, markdown, dev)


if __name__ == "__main__":
    main()
