"""Starting the ranks of a tensor-parallel engine from one process: the calling process is rank 0 (it talks to
the user), ranks 1..N-1 are spawned workers that build the same engine shard by shard and then follow rank 0's
requests (broadcast.py). A worker that dies takes the engine down: rank 0 watches its workers and exits with one
line; a worker whose rank 0 is gone exits too; a collective that waits past the group's timeout fails."""

from __future__ import annotations

import logging
import multiprocessing as std_mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import BadInput
from ..exit_codes import EXIT_RANK_FAILED
from ..logs import log_once
from .comm import Communicator, DistCommunicator
from .group import DEFAULT_TIMEOUT_S, Rendezvous, free_port, join, leave, rank_device, torchrun_env

REPORT_WAIT_S = 10.0  # after a failed collective, how long rank 0 waits to see which worker died
PARENT_POLL_S = 1.0


class Workers:
    """The spawned ranks 1..N-1 and the watcher that ends rank 0 when one of them dies before ``close``."""

    def __init__(self, procs: list[std_mp.process.BaseProcess]) -> None:
        self.procs = procs
        self.closing = False
        self.lock = threading.Lock()
        self.watcher = threading.Thread(target=self._watch, name="kdtree-tp-watch", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        pending = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while pending:
            for s in wait(list(pending)):
                rank = pending.pop(s)
                self.procs[rank - 1].join()
                if not self.closing:
                    self.stop_all(rank)

    def stop_all(self, rank: int) -> None:
        """Rank ``rank`` died: one line on stderr, the other workers killed, this process ends (first caller only:
        the watcher and a failed collective may both get here)."""
        with self.lock:
            # os.write: no Python buffer or lock between this line and the exit
            os.write(2, f"kdtree: error: tensor-parallel rank {rank} exited with code "
                        f"{self.procs[rank - 1].exitcode}; stopping every rank\n".encode())
            self.kill()
            os._exit(EXIT_RANK_FAILED)

    def report_dead(self, wait_s: float = REPORT_WAIT_S) -> None:
        """After a failed collective: if a worker died (within ``wait_s``), stop everything with its line."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    p.join()
                    self.stop_all(rank)
            time.sleep(0.05)

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
                os._exit(EXIT_RANK_FAILED)

    threading.Thread(target=poll, name="kdtree-tp-parent", daemon=True).start()


def quiet() -> None:
    """A rank > 0 says nothing but warnings and errors: rank 0 talks to the user."""
    logging.getLogger("kdtree_engine").setLevel(logging.WARNING)
    sys.stdout = open(os.devnull, "w")


def worker_entry(index: int, rdv: Rendezvous, device: str, body: Callable[..., Any], args: tuple) -> None:
    """Spawned rank index + 1: silent (warnings and errors only), joins the group, runs ``body(comm, *args)``."""
    # a SIGTERM or Ctrl-C sent to the whole process group is rank 0's to act on (it finishes or cancels its work,
    # then stops the workers); a worker whose rank 0 is gone leaves by itself (watch_parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    quiet()
    rank = index + 1
    comm = join(rdv, rank, rank_device(torch.device(device), rank))
    try:
        body(comm, *args)
    except RuntimeError as e:
        if collective_error(e):   # rank 0 or a peer is gone: rank 0 (or its watcher) says so
            os._exit(EXIT_RANK_FAILED)
        raise
    leave()


def spawn_workers(rdv: Rendezvous, device: torch.device, body: Callable[..., Any], args: tuple) -> Workers:
    """Start ranks 1..N-1 running ``body(comm, *args)`` (importable: it is pickled to the spawned process)."""
    ctx = std_mp.get_context("spawn")
    procs = [ctx.Process(target=worker_entry, args=(i, rdv, device.type, body, args), name=f"kdtree-rank-{i + 1}",
                         daemon=True) for i in range(rdv.world_size - 1)]   # daemon: ended with rank 0
    for p in procs:
        p.start()
    return Workers(procs)


def start_ranks(tp: int, device: torch.device, body: Callable[..., Any], args: tuple,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Communicator, Workers | None, torch.device]:
    """Rank 0 of a ``tp``-rank engine: (its communicator, the spawned workers or None, its device). A process group
    already joined (torchrun: ``python -m kdtree_engine``) is used as it is; otherwise ranks 1..tp-1 are spawned
    on this host (``body(comm, *args)`` each) and meet this process at a free local port."""
    if dist.is_initialized():
        if torchrun_env() is None:
            raise BadInput("a tensor-parallel engine already runs in this process: close() it before starting another")
        comm = DistCommunicator()
        if comm.world_size != tp or comm.rank != 0:
            raise BadInput(f"tp={tp} but this process is {comm.describe()} of the launcher's group")
        log_once(f"tp:joined:{tp}", f"tensor parallel: {tp} ranks, the launcher's group ({comm.backend})")
        return comm, None, rank_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    rdv = Rendezvous("127.0.0.1", free_port(), tp, timeout_s)
    workers = spawn_workers(rdv, device, body, args)
    dev = rank_device(device, 0)
    comm = join(rdv, 0, dev)
    log_once(f"tp:spawned:{tp}", f"tensor parallel: {tp} ranks on this host, ranks 1..{tp - 1} spawned "
             f"({comm.backend}, port {rdv.port}, collective timeout {rdv.timeout_s:.0f} s)")
    return comm, workers, dev


def collective_error(e: BaseException) -> bool:
    """Whether an exception comes from a collective (a peer gone, a timeout) rather than from the model."""
    return isinstance(e, dist.DistError) or any(w in str(e) for w in ("gloo", "NCCL", "Connection reset", "timed out"))
