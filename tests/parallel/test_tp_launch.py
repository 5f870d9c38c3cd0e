"""Launching: `kdtree generate --tp 2` prints what --tp 1 prints, torchrun runs the same command, and a rank that
dies takes the engine down with one line and a non-zero exit within a bounded time (every process reaped)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from kdtree_engine.cli import main
from kdtree_engine.exit_codes import EXIT_RANK_FAILED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
ARGS = ["generate", "def fib(n):", "--max-tokens", "12", "--ignore-eos", "--device", "cpu", "--no-compare",
        "--budget", "4", "--threads", "1"]
DEATH_LIMIT_S = 60.0


def run(cmd: list[str], timeout: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_tp2_and_torchrun_print_what_tp1_prints() -> None:
    one = run([sys.executable, "-m", "kdtree_engine", *ARGS, "--tp", "1"])
    assert one.returncode == 0, one.stderr
    two = run([sys.executable, "-m", "kdtree_engine", *ARGS, "--tp", "2"])
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "rank 0 of 2" in two.stderr and "rank 1 of 2" in two.stderr  # rank 0 reports every rank's load
    assert two.stderr.count("INFO kdtree_engine: loaded ") == 1  # the other rank is silent
    tr = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
              str(free_port()), "-m", "kdtree_engine", *ARGS])
    assert tr.returncode == 0, tr.stderr
    assert tr.stdout == one.stdout


DYING = textwrap.dedent("""
    import sys, torch
    from kdtree_engine import LLM, SamplingParams
    llm = LLM(spec="none", device="cpu", tp=2, threads=1, progress=False)
    print(llm.workers.procs[0].pid, flush=True)
    while True:
        llm.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
""")


def test_a_dying_rank_stops_rank_0_with_one_line() -> None:
    proc = subprocess.Popen([sys.executable, "-c", DYING], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=ROOT)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(1.0)  # requests are running
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        rc = proc.wait(timeout=DEATH_LIMIT_S)
        took = time.monotonic() - t0
        err = proc.stderr.read().strip().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert rc == EXIT_RANK_FAILED, (rc, err[-5:])
    line = f"kdtree: error: tensor-parallel rank 1 exited with code {-signal.SIGKILL}; stopping every rank"
    assert [e for e in err if e.startswith("kdtree: error")] == [line], err
    assert not any("Traceback" in e for e in err), err
    print(f"rank 0 exited {took:.1f} s after its worker was killed")


def test_what_the_ranks_cannot_do_is_refused_before_they_start(capsys) -> None:
    assert main(["generate", "--prompt-ids", "1,2", "--tp", "2", "--show-tree", "--device", "cpu"]) == 2
    assert main(["generate", "--prompt-ids", "1,2", "--tp", "2", "--budget", "auto", "--device", "cpu"]) == 2
    err = [e for e in capsys.readouterr().err.splitlines() if e.startswith("kdtree: error")]
    assert err[0].startswith("kdtree: error: --show-tree is not available with --tp > 1")
    assert err[1].startswith("kdtree: error: --budget auto times each round on the host"), err
