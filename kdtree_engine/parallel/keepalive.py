"""Rank 0 keeps idle ranks in the group: every collective fails after the group's timeout (a peer died or hangs),
and the other ranks wait for rank 0's next message in one, so a tensor-parallel engine left idle longer than the
timeout (a server with no requests, an open batch with nothing to run) would lose its ranks. While nothing has
been sent for a fifth of the timeout, rank 0 sends a no-op message (each rank's wait starts again).

Every message rank 0 sends, and the work whose collectives follow it, runs under :meth:`KeepAlive.guard`, so a no-op
never falls between them; the no-op is only sent when the guard is free."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

KEEPALIVE_SHARE = 5   # no-ops at least this many times per collective timeout while idle


class KeepAlive:
    """The guard of rank 0's messages and the thread that sends ``noop()`` every ``timeout_s / KEEPALIVE_SHARE``
    seconds of silence (on ``device``'s CUDA device where there is one)."""

    def __init__(self, noop: Callable[[], None], timeout_s: float, device: torch.device) -> None:
        self.noop, self.interval = noop, timeout_s / KEEPALIVE_SHARE
        self.lock = threading.RLock()
        self.last = time.monotonic()
        self.failed: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(device,), name="kdtree-tp-keepalive", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold while sending a message and running what follows it."""
        with self.lock:
            try:
                yield
            finally:
                self.last = time.monotonic()

    def _run(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)   # a thread's current device is its own
        while not self._stop.wait(self.interval / 4):
            if time.monotonic() - self.last < self.interval or not self.lock.acquire(blocking=False):
                continue
            try:
                if not self._stop.is_set():
                    self.noop()
                    self.last = time.monotonic()
            except BaseException as e:   # the group is gone: the next request meets the same failure and reports it
                self.failed = e
                return
            finally:
                self.lock.release()

    def close(self) -> None:
        """Stop the thread (before the ranks are told to stop)."""
        self._stop.set()
        with self.lock:   # a no-op in flight finishes first
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


@contextlib.contextmanager
def unguarded() -> Iterator[None]:
    """The guard of a process without other ranks to keep."""
    yield


__all__ = ["KEEPALIVE_SHARE", "KeepAlive", "unguarded"]
