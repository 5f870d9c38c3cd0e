"""Runs the app on uvicorn: binds the socket first (a port in use is bad input, before the model loads), serves,
and shuts down gracefully on SIGTERM / SIGINT.

Shutdown: the worker's queue closes (new requests: 503), uvicorn stops accepting, lets running responses finish for ``shutdown_timeout_s`` and then cancels
them; the app's lifespan then stops the worker (what still waits or runs is cancelled at its next round).
uvicorn re-raises the signal it caught once it is done; the handler installed here receives it, so the process
exits with status 0 instead of dying by the signal.
"""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from ..errors import BadInput
from .app import ServeSettings, build_app
from .worker import Worker

log = logging.getLogger("kdtree_engine.serve")

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening: clients are refused until the server runs)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise BadInput(f"--host {host!r} is not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise BadInput(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server that also closes the worker's queue when the shutdown signal arrives: requests sent on
    open connections during the grace period get 503, /health reports the shutdown."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.worker.close()
        super().handle_exit(sig, frame)


def after_shutdown(signum: int, frame: FrameType | None) -> None:
    log.info("signal %s: shut down", signal.Signals(signum).name)


def serve(llm: Any, settings: ServeSettings, sock: socket.socket) -> None:
    """Serve until SIGTERM / SIGINT; returns after a graceful shutdown."""
    app = build_app(llm, settings)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
                            lifespan="on")
    server = Server(config, app.state.worker)
    previous = {s: signal.signal(s, after_shutdown) for s in SHUTDOWN_SIGNALS}
    # tests and scripts read the port from this line (--port 0 picks a free one)
    log.info("serving %r on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models; "
             "/health, /metrics)", settings.served_model_name, host, port)
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
