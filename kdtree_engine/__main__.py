"""``python -m kdtree_engine ...``: the ``kdtree`` command; under torchrun (``torchrun --nproc-per-node N -m
kdtree_engine generate ...``) every process joins the group from torchrun's variables, rank 0 runs the command
and prints, the other ranks build the same engine and follow rank 0's requests (docs/parallel.md)."""

from __future__ import annotations

import atexit
import sys
from typing import Sequence

from .cli import build_parser, error_line, llm_kwargs, main
from .engine import LLM, resolve_device
from .exit_codes import BAD_INPUT_ERRORS, EXIT_BAD_INPUT, EXIT_RANK_FAILED
from .parallel.group import join, leave, rank_device, torchrun_env
from .parallel.launch import collective_error, quiet


def torchrun_main(argv: Sequence[str]) -> int:
    """One rank of a torchrun launch (WORLD_SIZE > 1): only ``generate`` runs on several ranks."""
    rdv, rank, local = torchrun_env()  # type: ignore[misc]
    args, _ = build_parser().parse_known_args(argv)
    if getattr(args, "command", None) != "generate":
        print("kdtree: error: under torchrun only `generate` runs (with one rank per device)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.tp not in (1, rdv.world_size):
        print(f"kdtree: error: --tp {args.tp} but torchrun started {rdv.world_size} ranks", file=sys.stderr)
        return EXIT_BAD_INPUT
    argv = [*argv, "--tp", str(rdv.world_size)]
    try:
        device = resolve_device(args.device)
    except BAD_INPUT_ERRORS as e:
        print(error_line(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    comm = join(rdv, rank, rank_device(device, local))
    atexit.register(leave)   # after rank 0's engine has stopped the others (atexit runs the last registered first)
    if rank == 0:
        return main(argv)
    quiet()
    try:
        LLM(**{**llm_kwargs(args, args.eager or args.show_tree), "tp": rdv.world_size}, progress=False, comm=comm).serve()
    except RuntimeError as e:
        if collective_error(e):   # rank 0 is gone: it (or torchrun) reports why
            return EXIT_RANK_FAILED
        raise
    return 0


def entry() -> int:
    env = torchrun_env()
    if env is None or env[0].world_size == 1:
        return main()
    return torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(entry())
