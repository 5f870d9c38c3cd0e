"""Run Triton kernels under TRITON_INTERPRET=1 in a child process.

Triton decides at decoration time (module import) whether a @triton.jit function is compiled or
interpreted, and the pytest process may already have imported the kernel modules for CUDA (tests/gpu)
or without the flag. So the interpreted cases run in a fresh child with the flag set, and only their
numbers come back. The child also poisons every buffer the kernels allocate (torch.empty /
torch.empty_like return NaN-filled floats and -77777-filled ints), so an unwritten element shows up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# script -> case names, filled at import by each test module; the first fixture that needs results
# starts a child for every registered module at once, so they run concurrently.
_REGISTERED: dict[str, list[str]] = {}
_RUNNING: dict[str, subprocess.Popen] = {}


def register(script: Path, names: list[str]) -> None:
    _REGISTERED[str(script)] = list(names)


def _start(script: str, names: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.Popen([sys.executable, script, "--interp-cases", *names], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_cases(script: Path, names: list[str], timeout: float = 600) -> dict:
    register(script, names)
    for s, n in _REGISTERED.items():
        if s not in _RUNNING:
            _RUNNING[s] = _start(s, n)
    proc = _RUNNING[str(script)]
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    results = {}
    for line in stdout.splitlines():
        if line.startswith("CASE "):
            rec = json.loads(line[5:])
            results[rec["name"]] = rec
    if proc.returncode != 0 and not results:
        raise RuntimeError(f"interpreter child failed (rc={proc.returncode}):\n{stderr[-4000:]}")
    for n in names:
        results.setdefault(n, {"name": n, "error": f"no result; child stderr:\n{stderr[-4000:]}"})
    return results


def child_main(cases: dict, run_one, argv: list[str]) -> None:
    """In the child: poison allocations, run each named case, print one JSON line per case."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def _poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64, torch.int16):
            t.fill_(-77777)
        return t

    torch.empty = lambda *a, **k: _poison(orig_empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(orig_empty_like(*a, **k))
    import traceback

    for name in argv:
        try:
            rec = run_one(name, cases[name])
        except Exception:  # reported to the parent, which fails that case
            rec = {"error": traceback.format_exc()[-3000:]}
        rec["name"] = name
        print("CASE " + json.dumps(rec), flush=True)


def results_fixture(script: Path, names: list[str]):
    """Registers the module's cases and returns a module-scoped fixture holding their results."""
    import pytest

    register(script, names)

    @pytest.fixture(scope="module")
    def interp_results() -> dict:
        return run_cases(script, names)

    return interp_results


def check_ran(rec: dict) -> None:
    """The case ran in the child and wrote every output element (NaN/-77777-poisoned buffers)."""
    assert "error" not in rec, rec["error"]
    assert rec.get("nonfinite", 0) == 0, "unwritten (NaN-poisoned) or non-finite outputs"


def assert_ulps(rec: dict, what: str, limits: dict[str, float]) -> None:
    """The case ran, its outputs have the torch path's dtype and shape (rec["meta"]), each rec[key] of
    `limits` (ulps from the oracle) is within its limit, and no row-invariance check failed (rec["bad"])."""
    check_ran(rec)
    assert rec["meta"], f"dtype or shape differs from {what}"
    for key, lim in limits.items():
        assert rec[key] <= lim, f"{key} {rec[key]:.3g} > {lim} (seed {rec['seed']})"
    assert not rec.get("bad"), f"{rec['bad']} (seed {rec['seed']})"


def output_record(y, ref, meta_ok: bool) -> dict:
    """What an accuracy case reports: metadata check, non-finite count, relative error vs the oracle."""
    yd, rd = y.double(), ref.double()
    return {"ok_meta": bool(meta_ok), "nonfinite": int((~yd.isfinite()).sum()),
            "rel": float((yd - rd).norm() / rd.norm())}


def assert_close(rec: dict, tol: float) -> None:
    """The case ran, its output has the right dtype/shape and is within tol of the oracle."""
    check_ran(rec)
    assert rec["ok_meta"]
    assert rec["rel"] < tol, f"relative error {rec['rel']:.3g} >= {tol} (seed {rec['seed']})"
