"""The real ``kdtree serve`` as a subprocess on 127.0.0.1 (a free port, read from its log): started, waited for,
and always stopped and reaped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120
LISTEN = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)")


class Server:
    def __init__(self, *flags: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kdtree-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "kdtree_engine", "serve", "--port", "0", *flags],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)   # its own group: --tp ranks
        self.url = ""
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            m = LISTEN.search(self.output())
            if m:
                self.url = f"http://127.0.0.1:{m[1]}"
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready in {READY_TIMEOUT_S} s:\n{self.output()}")

    def terminate(self, timeout: float = 60, group: bool = False) -> int:
        """SIGTERM (to the server, or to its whole process group as a service manager or Ctrl-C would), then wait
        for the exit; its return code."""
        if group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def group_alive(self) -> bool:
        """Whether any process of the server's group (its --tp ranks) is still there."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        print(f"--- server log (exit {self.proc.returncode}), last lines ---\n" + self.output()[-4000:])
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
