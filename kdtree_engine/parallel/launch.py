"""Starting the ranks of a tensor-parallel engine from one process: the calling process is rank 0 (it talks to
the user), ranks 1..N-1 are spawned workers that build the same engine shard by shard and then follow rank 0's
requests (serve.py). A worker that dies takes the engine down: rank 0 watches its workers and exits with one
line; a worker whose rank 0 is gone exits too; a collective that waits past the group's timeout fails."""

from __future__ import annotations

import logging
import multiprocessing as std_mp
import os
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import Communicator, DistCommunicator
from .group import DEFAULT_TIMEOUT_S, Rendezvous, free_port, join, leave, rank_device

EXIT_RANK_DIED = 3  # rank 0's exit code when a worker died under it
PARENT_POLL_S = 1.0


class Workers:
    """The spawned ranks 1..N-1 and the watcher that ends rank 0 when one of them dies before ``close``."""

    def __init__(self, procs: list[std_mp.process.BaseProcess]) -> None:
        self.procs = procs
        self.closing = False
        self.watcher = threading.Thread(target=self._watch, name="kdtree-tp-watch", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        pending = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while pending:
            for s in wait(list(pending)):
                rank = pending.pop(s)
                proc = self.procs[rank - 1]
                proc.join()
                if self.closing:
                    continue
                sys.stderr.write(f"kdtree: error: tensor-parallel rank {rank} exited with code {proc.exitcode}; "
                                 "stopping every rank\n")
                sys.stderr.flush()
                self.kill()
                os._exit(EXIT_RANK_DIED)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the workers after rank 0 sent them STOP (killed past ``timeout_s``)."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        for p in self.procs:
            p.join()


def watch_parent() -> None:
    """A worker exits when the process that started it is gone (its rank 0 died)."""
    parent = os.getppid()

    def poll() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(EXIT_RANK_DIED)

    threading.Thread(target=poll, name="kdtree-tp-parent", daemon=True).start()


def quiet() -> None:
    """A rank > 0 says nothing but warnings and errors: rank 0 talks to the user."""
    logging.getLogger("kdtree_engine").setLevel(logging.WARNING)
    sys.stdout = open(os.devnull, "w")


def worker_entry(index: int, rdv: Rendezvous, device: str, body: Callable[..., Any], args: tuple) -> None:
    """Spawned rank index + 1: silent (warnings and errors only), joins the group, runs ``body(comm, *args)``."""
    watch_parent()
    quiet()
    rank = index + 1
    comm = join(rdv, rank, rank_device(torch.device(device), rank))
    try:
        body(comm, *args)
    finally:
        leave()


def spawn_workers(rdv: Rendezvous, device: torch.device, body: Callable[..., Any], args: tuple) -> Workers:
    """Start ranks 1..N-1 running ``body(comm, *args)`` (importable: it is pickled to the spawned process)."""
    ctx = mp.start_processes(worker_entry, args=(rdv, device.type, body, args), nprocs=rdv.world_size - 1,
                             join=False, start_method="spawn")
    return Workers(list(ctx.processes))


def start_ranks(tp: int, device: torch.device, body: Callable[..., Any], args: tuple,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Communicator, Workers | None, torch.device]:
    """Rank 0 of a ``tp``-rank engine: (its communicator, the spawned workers or None, its device). A process group
    already joined (torchrun: ``python -m kdtree_engine``) is used as it is; otherwise ranks 1..tp-1 are spawned
    on this host (``body(comm, *args)`` each) and meet this process at a free local port."""
    if dist.is_initialized():
        comm = DistCommunicator()
        if comm.world_size != tp or comm.rank != 0:
            raise ValueError(f"tp={tp} but this process is {comm.describe()} of the launcher's group")
        return comm, None, rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    rdv = Rendezvous("127.0.0.1", free_port(), tp, timeout_s)
    workers = spawn_workers(rdv, device, body, args)
    dev = rank_device(device, 0)
    return join(rdv, 0, dev), workers, dev
