"""Running a function on N ranks of a process group in spawned processes (every process reaped): gloo on CPU
ranks, or NCCL with rank r on cuda:r (``device_type="cuda"``, the multi-GPU tests)."""

from __future__ import annotations

import pickle
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from kdtree_engine.parallel.group import Rendezvous, free_port, join, leave

TIMEOUT_S = 60.0


def _rank_main(rank: int, rdv: Rendezvous, fn: Callable[..., Any], args: tuple, out_dir: str,
               device_type: str = "cpu") -> None:
    torch.set_num_threads(1)
    try:
        comm = join(rdv, rank, torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank))
        result = fn(comm, *args)
        leave()
    except BaseException:
        (Path(out_dir) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, device_type: str = "cpu",
              timeout_s: float = TIMEOUT_S) -> list[Any]:
    """fn(comm, *args) on ranks 0..world-1 (gloo on the CPU, one thread each; ``device_type="cuda"``: NCCL, rank r
    on cuda:r); their results in rank order."""
    rdv = Rendezvous("127.0.0.1", free_port(), world, timeout_s)
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_rank_main, args=(rdv, fn, args, d, device_type), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join(timeout=600):
                pass
        except Exception:
            errs = [p.read_text() for p in sorted(Path(d).glob("*.err"))]
            raise AssertionError("a rank failed:\n" + "\n".join(errs)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [pickle.loads((Path(d) / f"{r}.pkl").read_bytes()) for r in range(world)]
