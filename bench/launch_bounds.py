"""Upper bounds on what removing a launch could gain: the K2 MoE and a small tree's attention timed as the engine
runs them and with one of their launches left out (the outputs are then wrong: timing only).

    python3 bench/launch_bounds.py [--out bench/results]

MoE (routed experts, kernels/moe_frag.py on the engine's tiled words, T = 1 / 4 / 16), the epilogues in their own
launches: as is, without the SwiGLU launch, without the top-k sum launch, without both (a fused epilogue cannot
gain more than its launch's row); and fused: the engine's default (moe_frag.fused_epilogues).
Attention (kernels/mla_attention.py, device-length forward, N = 64 / 8 heads over a 4096-token cache, trees of
4 / 8 nodes): as is (prefix launch beside the tree-tail launch, then the merge), the two launches one after the
other, the prefix alone, the tail alone. Whether the tail launch is on the critical path.
Times: median of CUDA-graph replays (bench/common.time_calls) over 4 routings / the same inputs.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import command_line, device_info, md_table, time_calls, write_results  # noqa: E402
from bench.kernels import E, G, H, I, TOPK, rand_w4, route  # noqa: E402
from kdtree_engine.kernels import mla_attention as mla  # noqa: E402
from kdtree_engine.kernels import moe_frag  # noqa: E402
from kdtree_engine.kernels.layouts import ENGINE_ORDER, to_engine_int4  # noqa: E402


def patched(mod, **attrs):
    """mock.patch.multiple, which refuses an empty set of attributes (the unpatched variants)."""
    return mock.patch.multiple(mod, **attrs) if attrs else nullcontext()


def _skip(*_a, **_k) -> None:
    return None


def moe_rows(reps: int) -> list[dict]:
    w13p, w13s, w2p, w2s = (*rand_w4(E, 2 * I, H), *rand_w4(E, H, I))
    frag = (*to_engine_int4(w13p, w13s, H), *to_engine_int4(w2p, w2s, I))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    unfused = {"FUSE_MAX_PAIRS": 0}   # the epilogues in their own launches (moe_frag.fused_epilogues off)
    variants = {"as is": unfused, "no SwiGLU launch": {**unfused, "moe_swiglu": _skip},
                "no top-k sum launch": {**unfused, "moe_topk_sum": _skip},
                "neither": {**unfused, "moe_swiglu": _skip, "moe_topk_sum": _skip},
                "fused": {}}
    for T in (1, 4, 16):
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        sets = route(T, 4, gen)
        row = {"T": T}
        for name, attrs in variants.items():
            with patched(moe_frag, **attrs):
                row[name] = time_calls([lambda ids=ids, tw=tw: moe_frag.fused_moe_frag(x, *frag, ids, tw, G,
                                                                                       **ENGINE_ORDER)
                                        for ids, tw in sets], reps=reps)["us"]
        rows.append(row)
        print(row, flush=True)
    return rows


def _serial(dev, on_side, here) -> None:
    on_side()
    here()


def attention_rows(reps: int) -> list[dict]:
    C, R, S = 512, 64, 4096
    rows = []
    for N in (64, 8):
        for T in (4, 8):
            g = torch.Generator(device="cuda").manual_seed(T)
            q_lat = torch.randn(T, N, C, generator=g, device="cuda").to(torch.bfloat16)
            q_pe = torch.randn(T, N, R, generator=g, device="cuda").to(torch.bfloat16)
            kv = torch.randn(S + 64, C + R, generator=g, device="cuda").to(torch.bfloat16)
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))
            mask[T - 1, 1:T - 1] = False        # a fork: the last node hangs off the root
            start = torch.tensor([S], device="cuda", dtype=torch.int32)
            index = mla.tree_gather_index(mask)

            def call():
                return mla.mla_attention_device(q_lat, q_pe, kv, start, mask, C ** -0.5, gather_index=index)

            row = {"N": N, "T": T}
            for name, fn in {"as is": None, "one after the other": _serial,
                             "prefix alone": lambda dev, on_side, here: on_side(),
                             "tail alone": lambda dev, on_side, here: here()}.items():
                with patched(mla, **({"side_by_side": fn} if fn else {})):
                    row[name] = time_calls([call], reps=reps)["us"]
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/launch_bounds.py needs a CUDA device")
    torch.manual_seed(0)
    payload = {"command": command_line(), "device": device_info(), "moe": moe_rows(args.reps),
               "attention": attention_rows(args.reps)}
    mv = ["as is", "no SwiGLU launch", "no top-k sum launch", "neither", "fused"]
    av = ["as is", "one after the other", "prefix alone", "tail alone"]
    lines = ["# Launch bounds (" + payload["device"].get("gpu", "?") + ")", "", f"Command: `{payload['command']}`", "",
             __doc__.split("\n\n")[1], "", "## MoE, us per call", "",
             *md_table(["T", *mv], [[r["T"], *(f"{r[k]:.1f}" for k in mv)] for r in payload["moe"]]), "",
             "## Attention of a small tree over 4096 tokens, us per call", "",
             *md_table(["N", "T", *av], [[r["N"], r["T"], *(f"{r[k]:.1f}" for k in av)]
                                         for r in payload["attention"]])]
    write_results(args.out, "launch-bounds-h200", payload, lines)
    return payload


if __name__ == "__main__":
    main()
