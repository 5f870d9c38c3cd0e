"""``kdtree`` command line: generate | serve | quantize | golden make / check | selfcheck | bench (docs/cli.md is the
reference).

Exit codes (:mod:`kdtree_engine.exit_codes`): 0 success; 1 a check found a mismatch; 2 bad input (missing or
unreadable model, bad flag value, prompt too long, corrupt bundle, a GPU benchmark without a GPU), printed as one
line ``kdtree: error: ...``. Logs go to stderr (automatic choices at DEBUG: ``-v``); ``--json`` prints exactly one
JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import torch

from .batch.scheduler import DEFAULT_TOKEN_BUDGET
from .bench_spec import add_bench_spec_parser
from .convert import quantize_checkpoint
from .engine import DEMO_DIR, LLM
from .errors import BadInput, RankFailure
from .exit_codes import BAD_INPUT_ERRORS, EXIT_BAD_INPUT, EXIT_RANK_FAILED
from .golden import add_golden_parser
from .golden import main as golden_main
from .sampling import SamplingParams
from .show_tree import add_show_tree_argument, render_last_round
from .speculative.decode import GenerationResult

log = logging.getLogger("kdtree_engine")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _positive(flag: str, auto: bool = False) -> Callable[[str], int | str]:
    """argparse type of a positive integer flag (and, with ``auto``, the word 'auto')."""
    def parse(text: str) -> int | str:
        if auto and text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            also = " or 'auto'" if auto else ""
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer{also}, got {text!r}")
        return value
    return parse


def _fraction(text: str) -> float:
    """argparse type of --gpu-memory-fraction: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--gpu-memory-fraction must be a number in (0, 1], got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line ``kdtree: error: ...`` pointing to ``--help``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"kdtree: error: {message} (`{self.prog} --help` lists the arguments)\n")


# API messages name arguments as ``name=value`` (kdtree_engine.engine, speculative.config); the CLI shows them
# as its flags, ``--name value``.
ARG_FLAGS = ("spec", "draft", "budget", "device", "dtype", "quantize", "threads", "tp", "cache_tokens",
             "memory_fraction")
FLAG_OF_ARG = {"cache_tokens": "cache-tokens", "memory_fraction": "gpu-memory-fraction"}  # where the names differ
ARG_IN_MESSAGE = re.compile(r"\b(" + "|".join(ARG_FLAGS) + r")=(?:'([^']*)'|([^\s,;:()]+))")


def as_flags(message: str) -> str:
    """An API error message with its ``name=value`` arguments written as the CLI's ``--name value``."""
    return ARG_IN_MESSAGE.sub(lambda m: f"--{FLAG_OF_ARG.get(m[1], m[1])} {m[2] if m[2] is not None else m[3]}",
                              message)


def error_line(e: BaseException) -> str:
    return f"kdtree: error: {as_flags(str(e))}"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that choose and load the model (``generate`` and ``serve``)."""
    p.add_argument("--model", default=None,
                   help="HF-format checkpoint directory (default: the embedded demo model, with its drafter)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quantize", choices=["none", "w4a16"], default="none",
                   help="w4a16: quantize the routed experts of a BF16 or FP8 checkpoint while loading")
    p.add_argument("--draft", default=None, help="DFlash drafter directory")
    p.add_argument("--spec", choices=["none", "dflash", "ddtree"], default=None,
                   help="decoding strategy (default: ddtree with --draft, else none)")
    p.add_argument("--budget", type=_positive("--budget", auto=True), default=None,
                   help="ddtree: non-root tree nodes, or 'auto': chosen each round from the measured verify cost "
                        "and the drafter's running acceptance (default block size - 1); dflash: the chain's "
                        "length (default block size - 1)")
    p.add_argument("--batch-invariant", choices=["on", "off"], default="on",
                   help="on (default): CUDA kernels whose per-row result does not depend on how many rows share "
                        "the launch, so greedy speculative output equals plain decoding bit for bit in bfloat16; "
                        "off: the fastest kernels (cuBLAS), equal up to floating point only")
    p.add_argument("--eager", action="store_true",
                   help="run each decoding round from the host (stage timers, --show-tree, sampling) instead of "
                        "replaying it from a CUDA graph (the default on CUDA with a fixed budget), and every prompt "
                        "forward eagerly (on CUDA, prompts of up to 512 tokens replay from a graph per length bucket)")
    p.add_argument("--cache-tokens", type=_positive("--cache-tokens"), default=None,
                   help="latent cache pool size in tokens, shared by the requests (default: --gpu-memory-fraction "
                        "on CUDA, 2 x the model's max_position_embeddings on the CPU); logged with the maximum "
                        "context")
    p.add_argument("--gpu-memory-fraction", type=_fraction, default=None,
                   help="size the latent cache pool as this fraction of the free device memory after the weights "
                        "(CUDA; default 0.9)")
    p.add_argument("--threads", type=_positive("--threads"), default=None,
                   help="torch CPU threads (default: chosen by the model's size on the CPU, logged; one for the "
                        "demo)")
    p.add_argument("--tp", type=_positive("--tp"), default=1,
                   help="ranks of tensor + expert parallelism, one process per device (docs/parallel.md); this "
                        "process is rank 0, the others are started and stopped with it")


def llm_kwargs(args: argparse.Namespace, eager: bool) -> dict:
    """The engine's arguments from the flags of :func:`add_model_arguments` (``eager``: host-driven rounds); every
    rank of ``--tp`` builds the same engine from them."""
    return dict(model=args.model, draft=args.draft, spec=args.spec, budget=args.budget, device=args.device,
                dtype=args.dtype, quantize=args.quantize, batch_invariant=args.batch_invariant == "on",
                eager=True if eager else None, threads=args.threads if args.threads is not None else "auto",
                tp=args.tp, cache_tokens=args.cache_tokens, memory_fraction=args.gpu_memory_fraction,
                # a server warms up before its first request (on CUDA); a one-shot command starts at once
                warm_up=None if getattr(args, "warm_up", False) else False)


def load_llm(args: argparse.Namespace, eager: bool) -> LLM:
    """The model the flags of :func:`add_model_arguments` name (``eager``: host-driven rounds)."""
    if args.model is None and not (DEMO_DIR / "config.json").exists():
        raise BadInput(f"no --model given and the embedded demo model is missing ({DEMO_DIR})")
    if args.model is not None and not Path(args.model).is_dir():
        raise BadInput(f"--model {args.model!r} is not a directory")
    return LLM(**llm_kwargs(args, eager), progress=True)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text or token ids from a prompt")
    p.add_argument("prompt", nargs="?", help="prompt text (needs the model's tokenizer.json)")
    p.add_argument("--prompt-ids", type=_ids, help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate (at most what the model's context leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_model_arguments(p)
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help=f"also run plain decoding and report the speedup: after an untimed warm-up of each, "
                        f"{COMPARE_RUNS} timed runs of each, interleaved, the fastest of each compared "
                        f"(default: on for the embedded demo)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_show_tree_argument(p)
    p.set_defaults(func=cmd_generate)


COMPARE_RUNS = 3  # timed runs of each decoding for --compare, interleaved (the fastest of each is compared)


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise BadInput("give exactly one of PROMPT or --prompt-ids")
    if args.show_tree and args.tp > 1:
        raise BadInput("--show-tree is not available with --tp > 1 (the display reads the draft logits of the whole "
                       "vocabulary, which no rank holds)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    compare = args.model is None if args.compare is None else args.compare
    llm = load_llm(args, args.eager or args.show_tree)
    if args.show_tree and not args.eager:
        log.debug("--show-tree: rounds run eagerly (a replayed round records no tree)")
    prompt = args.prompt if args.prompt_ids is None else args.prompt_ids
    if isinstance(prompt, str) and llm.tokenizer is None:
        raise BadInput(f"{args.model} has no tokenizer.json; pass the prompt as --prompt-ids")
    streamed: list[int] = []
    printed = [""]

    def on_tokens(toks: list[int]) -> None:
        if not streamed and isinstance(prompt, str):
            sys.stdout.write(prompt)  # after the first forward, so its one-time logs come first
        streamed.extend(toks)
        if llm.tokenizer is None:
            sys.stdout.write("".join(f"{t} " for t in toks))
        else:
            text = llm.decode(streamed) or ""
            if text.startswith(printed[0]):
                sys.stdout.write(text[len(printed[0]):])
                printed[0] = text
        sys.stdout.flush()

    compare = bool(compare) and llm.spec.method != "none"
    res = llm.generate(prompt, params, on_tokens=None if args.json else on_tokens)[0]
    stats = dict(res.stats)
    if compare:
        # the run above (streamed) was the speculative warm-up; the timed runs follow
        res, stats = compare_with_plain(llm, llm.encode(prompt), params, COMPARE_RUNS)
    if args.json:
        print(json.dumps({"token_ids": res.token_ids, "text": res.text, "finish_reason": res.finish_reason,
                          "stats": stats}))
    else:
        sys.stdout.write("\n")
        print(format_stats(res.finish_reason, stats), file=sys.stderr)
    if args.show_tree:
        print(render_last_round(res, llm.decode), file=sys.stderr if args.json else sys.stdout)
    return 0


def plain_decode(llm: LLM, ids: list[int], params: SamplingParams) -> GenerationResult:
    """Plain decoding of the request on the loaded target: the reference of ``--compare``."""
    return llm.run(ids, params, plain=True)


def compare_with_plain(llm: LLM, ids: list[int], params: SamplingParams,
                       runs: int) -> tuple[GenerationResult, dict]:
    """``--compare``: after the speculative request has run once (the caller's, untimed), one untimed plain run,
    then ``runs`` timed runs of each, interleaved (plain first in even pairs, speculative first in odd ones, so
    neither always follows the other). Returns the fastest speculative run and its stats with the comparison:
    the fastest of each compared, and the min-max of the per-pair speedups.

    The warm-up keeps one-time work out of the timed runs (CUDA: kernel compilation and the capture of the round
    graphs, kept per cache capacity, which the request's length sets; the CPU: first-touch allocation).
    """
    log.debug("--compare: warm-up (the speculative request above and one plain run, untimed), then %d timed runs "
              "of each, interleaved", runs)
    plain_decode(llm, ids, params)
    spec_runs: list[GenerationResult] = []
    plain_runs: list[GenerationResult] = []
    for i in range(runs):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        for which in order:
            if which == "plain":
                plain_runs.append(plain_decode(llm, ids, params))
            else:
                spec_runs.append(llm.generate(ids, params)[0])
    best = max(spec_runs, key=lambda r: r.stats["tokens_per_s"])
    base = max(plain_runs, key=lambda r: r.stats["tokens_per_s"])
    stats = dict(best.stats)
    stats["compare_warmed_up"] = True
    stats["compare_runs"] = runs
    stats["baseline_tokens_per_s"] = base.stats["tokens_per_s"]
    pairs = [s.stats["tokens_per_s"] / p.stats["tokens_per_s"] for s, p in zip(spec_runs, plain_runs)
             if p.stats["tokens_per_s"] > 0 and s.stats["tokens_per_s"] > 0]
    if len(pairs) == runs:
        stats["speedup"] = best.stats["tokens_per_s"] / base.stats["tokens_per_s"]
        stats["speedup_min"], stats["speedup_max"] = min(pairs), max(pairs)
    else:
        # fewer than two tokens: the first comes from the prefill, so no decode step was timed
        stats["speedup"] = stats["speedup_min"] = stats["speedup_max"] = None
    # sampled text is equal to plain decoding's in distribution only: no token comparison then
    stats["same_tokens_as_plain"] = (all(r.token_ids == p.token_ids for r in spec_runs for p in plain_runs)
                                     if params.greedy else None)
    return best, stats


def _same(same: bool | None) -> str:
    return "n/a (sampled: equal in distribution only)" if same is None else ("yes" if same else "NO")


def format_stats(finish_reason: str, s: dict) -> str:
    line = (f"[{s['generated_tokens']} tokens, finish {finish_reason}, prefill {s['prefill_s']:.3f}s, "
            f"decode {s['decode_s']:.3f}s, {s['tokens_per_s']:.1f} tok/s")
    if s.get("spec", "none") != "none":
        chosen = (f" (chosen per round, mean {s['budget_auto']['mean']:.1f})" if "budget_auto" in s else "")
        line += (f", spec {s['spec']}" + (f" budget {s['budget']}{chosen}" if "budget" in s else "")
                 + f", rounds {s['rounds']}, tau {s['tau']:.2f}, accepted per depth {s['accepted_per_depth']}")
        if "rounds_mode" in s:  # device-resident rounds: no stage boundaries to time
            line += f", {s['rounds_mode']} rounds"
        else:
            line += (f", draft {s['draft_s']:.3f}s tree {s['tree_s']:.3f}s verify {s['verify_s']:.3f}s"
                     f" commit {s['commit_s']:.3f}s")
    if "speedup" in s and s["speedup"] is None:
        line += (f", no speedup: nothing to compare ({s['generated_tokens']} tokens generated; decode speed needs "
                 "at least 2, the first comes from the prefill)")
    elif "speedup" in s:
        n = s["compare_runs"]
        line += (f", plain decoding {s['baseline_tokens_per_s']:.1f} tok/s, speedup {s['speedup']:.2f}x"
                 f" (fastest of {n} timed runs of each, interleaved, after an untimed warm-up of each; "
                 f"per-pair speedups {s['speedup_min']:.2f}-{s['speedup_max']:.2f}x; one prompt: "
                 "`kdtree bench spec` measures several)"
                 f", same tokens as plain: {_same(s['same_tokens_as_plain'])}")
    return line + "]"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (docs/serve.md)")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one, printed at start)")
    p.add_argument("--max-queue", type=_positive("--max-queue"), default=64,
                   help="requests that may wait (in the queue, or in the batch until it has cache for them); past "
                        "it: 503 with Retry-After")
    p.add_argument("--max-batch-tokens", type=_positive("--max-batch-tokens"), default=None,
                   help="continuous batching: the most rows of one batched forward (every running request's round, "
                        f"then prompt chunks; default {DEFAULT_TOKEN_BUDGET})")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip the start-up warm-up on CUDA (every prompt-length bucket and the budget's verify width "
                        "compiled before the first request, logged with its time; docs/long_context.md)")
    p.add_argument("--no-batching", action="store_true",
                   help="run one request at a time instead of the continuous batch")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: 'demo', or the model directory's name)")
    p.add_argument("--shutdown-timeout", type=_positive("--shutdown-timeout"), default=10,
                   help="seconds running requests may take to finish after SIGTERM before they are cancelled")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port < 2**16:
        raise BadInput(f"--port must be in 0..65535, got {args.port}")
    if args.api_key == "":
        raise BadInput("--api-key is empty")
    name = args.served_model_name or ("demo" if args.model is None else Path(args.model).resolve().name)
    # the HTTP stack (fastapi, uvicorn, pydantic) is imported by this command alone: the others start without it
    from .serve.app import ServeSettings
    from .serve.server import bind, serve
    sock = bind(args.host, args.port)   # before loading: a port in use fails at once
    batching = serve_batching(args)
    llm = load_llm(args, args.eager)
    serve(llm, ServeSettings(served_model_name=name, max_queue=args.max_queue, api_key=args.api_key,
                             shutdown_timeout_s=float(args.shutdown_timeout), batching=batching,
                             max_batch_tokens=args.max_batch_tokens), sock)
    return 0


def serve_batching(args: argparse.Namespace) -> bool:
    """Whether ``kdtree serve`` batches requests (logged once): yes unless --no-batching (at --tp N every rank runs
    the batch's steps)."""
    if args.max_batch_tokens is not None and args.no_batching:
        raise BadInput("--max-batch-tokens applies to continuous batching, which --no-batching turns off; drop it")
    if args.no_batching:
        log.info("requests run one at a time (--no-batching)")
    else:
        budget = args.max_batch_tokens or DEFAULT_TOKEN_BUDGET
        log.info("requests run concurrently: continuous batching, up to %d rows per forward (--max-batch-tokens; "
                 "--no-batching: one at a time)%s", budget, f", every one of the {args.tp} ranks running its steps"
                 if args.tp > 1 else "")
    return not args.no_batching


def add_selfcheck_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selfcheck", help="make a golden bundle from the numpy reference and check the engine on it")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=cmd_selfcheck)


def cmd_selfcheck(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "k2-tiny.golden.safetensors")
        rc = golden_main(["make", "--preset", "k2-tiny", "--seed", str(args.seed), "--tokens", str(args.tokens),
                          "--out", out])
        if rc:
            return rc
        check = ["check", out, "--dtype", args.dtype] + (["--device", args.device] if args.device else [])
        return golden_main(check)


SOURCE_BENCHES = {"kernels": "W4A16 linear and fused MoE at K2 shapes", "mla_attention": "MLA attention kernel",
                  "gemm": "batch-invariant dense GEMM vs cuBLAS"}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    add_bench_spec_parser(bsub)
    for name, what in SOURCE_BENCHES.items():
        # Listed for --help; main() hands the arguments to bench/<name>.py before parsing.
        bsub.add_parser(name.replace("_", "-"), help=f"{what} (GPU; needs the source checkout's bench/)")


def cmd_source_bench(name: str, argv: list[str]) -> int:
    """Runs bench/<name>.py's main(argv) from the source checkout this package was installed from.

    These benchmarks time GPU kernels: without a CUDA device they stop before running (bad input, exit 2)."""
    root = Path(__file__).resolve().parents[1]
    cmd = f"kdtree bench {name.replace('_', '-')}"
    if not (root / "bench" / f"{name}.py").exists():
        raise BadInput(f"{cmd} runs bench/{name}.py of the source checkout; it is not beside this installation "
                       f"({root})")
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(argv):
        raise BadInput(f"{cmd} times GPU kernels and needs a CUDA device; none is available")
    sys.path.insert(0, str(root))
    return int(importlib.import_module(f"bench.{name}").main(argv) or 0)


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write the INT4 (W4A16, compressed-tensors) checkpoint of a BF16 or FP8 one")
    p.add_argument("--model", required=True, help="source checkpoint directory (BF16 / FP16 or FP8 block-quantized)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=32,
                   help="INT4 group size of the routed experts (default 32, as the K2 releases)")
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(args.model, args.out, group_size=args.group_size, progress=True)
    print(f"wrote {out} (routed experts W4A16, group {args.group_size})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kdtree", description="Kimi K2 inference with DFlash + DDTree speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_golden_parser(sub)
    add_selfcheck_parser(sub)
    add_bench_parser(sub)
    add_quantize_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if len(argv) >= 2 and argv[0] == "bench" and argv[1].replace("-", "_") in SOURCE_BENCHES:
        # Every argument after the benchmark's name is its own (including --help).
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
        try:
            return cmd_source_bench(argv[1].replace("-", "_"), argv[2:])
        except BadInput as e:
            print(error_line(e), file=sys.stderr)
            return EXIT_BAD_INPUT
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose --help lists the arguments
        words = [w for w in (args.command, getattr(args, "bench", None)) if w]
        Parser(prog=" ".join(["kdtree", *words])).error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except BAD_INPUT_ERRORS as e:
        print(error_line(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except RankFailure as e:
        print(error_line(e), file=sys.stderr)
        return EXIT_RANK_FAILED


if __name__ == "__main__":
    sys.exit(main())
