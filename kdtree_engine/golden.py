"""``kdtree golden make | check``: write golden bundles from the numpy reference, check the engine.

The CLI registers these with ``add_golden_parser(subparsers)``; each leaf parser sets
``func(args) -> int`` (the exit code). ``main(argv)`` (argv starting with ``make`` / ``check``) and ``python -m kdtree_engine.golden`` run them
standalone.

Exit codes of ``check``: 0 all tokens match, 1 mismatch, 2 bundle missing/unreadable/malformed
(or the engine cannot be run).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import torch

from .bundle import QUANT_MODES, Bundle, engine_tensors, load_bundle, make_bundle, save_bundle
from .config import PRESETS, preset
from .engine import greedy_from_weights
from .errors import BundleError, ConfigError
from .exit_codes import EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_OK

EXIT_MATCH, EXIT_BAD_BUNDLE = EXIT_OK, EXIT_BAD_INPUT


def add_golden_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``golden`` (with ``make`` and ``check``) on an ``argparse`` subparsers object."""
    golden = subparsers.add_parser("golden", help="golden bundles: make from the numpy reference, check the engine",
                                   description="Golden bundles: one .safetensors with a random model, a prompt "
                                               "and the float64 reference's greedy tokens.")
    _add_commands(golden)
    return golden


def _add_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="golden_cmd", metavar="{make,check}")
    sub.required = True

    mk = sub.add_parser("make", help="write a bundle from the numpy reference (float64)")
    mk.add_argument("--preset", default="k2-tiny", choices=sorted(PRESETS), help="model config preset")
    mk.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    mk.add_argument("--tokens", type=int, default=64, help="number of golden tokens")
    mk.add_argument("--prompt-len", type=int, default=8, help="prompt length in tokens")
    mk.add_argument("--quant", choices=QUANT_MODES, default="none",
                    help="w4a16: routed experts INT4; fp8: every linear but lm_head FP8 block-quantized (32 x 32)")
    mk.add_argument("--group-size", type=int, default=32, help="W4A16 group size")
    mk.add_argument("--out", required=True, help="output .safetensors path")
    mk.set_defaults(func=cmd_make)

    ck = sub.add_parser("check", help="run the engine on a bundle and compare with its golden tokens")
    ck.add_argument("bundle", help="path of a golden bundle (.safetensors)")
    ck.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ck.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ck.set_defaults(func=cmd_check)


def cmd_make(args: argparse.Namespace) -> int:
    try:
        cfg = preset(args.preset)
    except ConfigError as e:
        print(f"kdtree: error: {e}", file=sys.stderr)
        return EXIT_BAD_BUNDLE
    t0 = time.perf_counter()
    try:
        bundle = make_bundle(cfg, args.seed, args.tokens, args.prompt_len, quant=args.quant,
                             group_size=args.group_size)
    except ValueError as e:
        print(f"kdtree: error: {e}", file=sys.stderr)
        return EXIT_BAD_BUNDLE
    path = save_bundle(bundle, args.out)
    size_mb = path.stat().st_size / 2**20
    quant = bundle.quant + (f" (group {args.group_size})" if bundle.quant == "w4a16" else "")
    print(f"wrote {path} ({size_mb:.2f} MiB): preset {args.preset}, seed {args.seed}, quant {quant}, "
          f"prompt {len(bundle.prompt_ids)} tokens, {len(bundle.golden_tokens)} golden tokens "
          f"(float64 reference, min margin {bundle.meta['min_margin']}, {time.perf_counter() - t0:.1f}s)")
    return 0


def compare(golden: Sequence[int], got: Sequence[int]) -> tuple[bool, str]:
    """(ok, message) in the ``check`` output format."""
    golden, got = [int(t) for t in golden], [int(t) for t in got]
    n = len(golden)
    for i, expected in enumerate(golden):
        actual = got[i] if i < len(got) else None
        if actual != expected:
            shown = "nothing (output ended)" if actual is None else str(actual)
            return False, f"mismatch at position {i}: expected {expected}, got {shown} (match {i}/{n})"
    return True, f"match {n}/{n}"


def run_engine(bundle: Bundle, device: str, dtype_name: str) -> list[int]:
    """The engine's greedy tokens for the bundle's prompt (torch model, not the reference)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    return greedy_from_weights(bundle.cfg, engine_tensors(bundle), [int(t) for t in bundle.prompt_ids],
                               len(bundle.golden_tokens), device=device, dtype=dtype)


def cmd_check(args: argparse.Namespace) -> int:
    try:
        bundle = load_bundle(args.bundle)
    except BundleError as e:
        print(f"kdtree: error: {e}", file=sys.stderr)
        return EXIT_BAD_BUNDLE
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("kdtree: error: --device cuda requested but CUDA is not available", file=sys.stderr)
            return EXIT_BAD_BUNDLE
    tokens = run_engine(bundle, args.device, args.dtype)
    ok, message = compare(bundle.golden_tokens, tokens)
    print(message)
    return EXIT_MATCH if ok else EXIT_MISMATCH


def main(argv: Sequence[str] | None = None) -> int:
    """``kdtree golden`` on its own: argv starts with ``make`` or ``check``."""
    parser = argparse.ArgumentParser(prog="kdtree golden")
    _add_commands(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
