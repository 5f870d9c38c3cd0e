"""scripts/gpu_suite.sh, dry-run on the CPU: every named suite lists its steps and fits one 10-minute device call,
a wrong name fails with one line and exit 2 before anything runs, every pytest step selects GPU tests that exist
(with markers registered in pyproject.toml), every GPU test file belongs to a part of `tests`, and every bench
option the suite passes is one its script defines."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "scripts" / "gpu_suite.sh"
DEVICE_CALL_S = 570  # a 600-s device call, less the start and the packing of the results
ONE_CALL = [["tests"], ["tests", "bitwise"], ["tests", "rounds"], ["tests", "kernels"], ["bench"], ["quick"],
            ["formats"], ["k2"], ["k2step"], ["batch"], ["multi"], ["long"], ["serving"]] + [
    ["kernel", f] for f in ("w4a16", "moe", "mla", "gemm", "router", "tails", "fp8")]
STEP = re.compile(r"^== (\S+) \(cap (\d+)s\): (.*)$")


def dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUITE), "--dry-run", *args], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}, timeout=60)


def steps(tmp_path: Path, *args: str) -> list[tuple[str, int, list[str]]]:
    done = dry_run(tmp_path, *args)
    assert done.returncode == 0 and not done.stderr, (args, done.stderr)
    found = [STEP.match(line) for line in done.stdout.splitlines()]
    assert found and all(found), (args, done.stdout)
    return [(m[1], int(m[2]), shlex.split(m[3])) for m in found]


def pytest_steps(tmp_path: Path, *args: str) -> list[tuple[list[str], str | None, list[str]]]:
    """(test files, -k expression, -m expressions) of each pytest step."""
    out = []
    for _, _, cmd in steps(tmp_path, *args):
        if cmd[:3] != ["python3", "-m", "pytest"]:
            continue
        files, k, marks, i = [], None, [], 3
        while i < len(cmd):
            if cmd[i] in ("-k", "-m", "-p", "-n"):
                k = cmd[i + 1] if cmd[i] == "-k" else k
                marks += [cmd[i + 1]] if cmd[i] == "-m" else []
                i += 2
                continue
            files += [] if cmd[i].startswith("-") else [cmd[i]]
            i += 1
        out.append((files, k, marks))
    return out


@pytest.mark.parametrize("args", ONE_CALL, ids=" ".join)
def test_each_suite_fits_one_device_call(tmp_path, args) -> None:
    listed = steps(tmp_path, *args)
    names = [name for name, _, _ in listed]
    assert len(set(names)) == len(names), names  # one log per step
    assert sum(cap for _, cap, _ in listed) <= DEVICE_CALL_S, listed
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args", [["nope"], [], ["tests", "all"], ["kernel"], ["kernel", "fp4"], ["bench", "x"],
                                  ["quick", "x"], ["formats", "x"], ["k2", "x"], ["k2step", "x"], ["batch", "x"], ["multi", "x"], ["long", "x"],
                                  ["serving", "x"]], ids=lambda a: " ".join(a) or "none")
def test_a_wrong_name_fails_with_one_line(tmp_path, args) -> None:
    for dry in (True, False):
        cmd = ["bash", str(SUITE), *(["--dry-run"] if dry else []), *args]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
        assert done.returncode == 2 and done.stdout == "", done
        assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("gpu_suite.sh: "), done.stderr
        assert not (tmp_path / "out").exists()  # nothing ran, no results folder


def test_tests_without_a_part_runs_every_part_in_one_run(tmp_path) -> None:
    (one,) = pytest_steps(tmp_path, "tests")
    parts = [s for part in ("bitwise", "rounds", "kernels") for s in pytest_steps(tmp_path, "tests", part)]
    assert sorted(one[0]) == sorted({f for files, _, _ in parts for f in files}) and one[1] is None


def test_every_gpu_test_file_is_in_a_part_of_tests(tmp_path) -> None:
    gpu_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                 if re.search(r"pytest\.mark\.gpu\b", p.read_text())}
    in_parts = {f for files, _, _ in pytest_steps(tmp_path, "tests") for f in files}
    assert gpu_files == in_parts, (sorted(gpu_files - in_parts), sorted(in_parts - gpu_files))


def test_markers_are_registered(tmp_path) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0].strip() for m in ini["markers"]}
    used = set()
    for args in ONE_CALL:
        for _, _, marks in pytest_steps(tmp_path, *args):
            used |= set(re.findall(r"[A-Za-z_]\w*", " ".join(marks))) - {"and", "or", "not"}
    assert used and used <= registered, used - registered


def _k_matches(expr: str | None, nodeid: str) -> bool:
    """pytest's -k on a node id: each word a case-insensitive substring of it (enough for these names)."""
    if not expr:
        return True
    py = re.sub(r"[A-Za-z_]\w*", lambda m: m[0] if m[0] in ("and", "or", "not")
                else repr(m[0].lower() in nodeid.lower()), expr)
    return bool(eval(py))  # noqa: S307 - an expression of literals and and/or/not only


def test_every_pytest_step_selects_gpu_tests(tmp_path) -> None:
    all_steps = [s for args in ONE_CALL for s in pytest_steps(tmp_path, *args)]
    files = sorted({f for step_files, _, _ in all_steps for f in step_files})
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True, timeout=600)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and ids, done.stdout[-2000:] + done.stderr[-2000:]
    for step_files, k, _ in all_steps:
        chosen = [i for i in ids if i.split("::")[0] in step_files and _k_matches(k, i)]
        assert chosen, (step_files, k)


def test_bench_options_exist(tmp_path) -> None:
    for args in ONE_CALL:
        for name, _, cmd in steps(tmp_path, *args):
            if cmd[0] != "python3" or cmd[1:3] == ["-m", "pytest"]:
                continue
            script = ROOT / ("kdtree_engine/bench_spec.py" if cmd[1:3] == ["-m", "kdtree_engine.bench_spec"]
                             else cmd[1])
            source = script.read_text()
            for opt in (a.split("=")[0] for a in cmd if a.startswith("--")):
                assert f'"{opt}"' in source, (name, opt)


def test_spec_bench_steps_write_their_records_under_the_results(tmp_path) -> None:
    """`kdtree bench spec` writes a fresh ./kdtree-bench/<time>/ without --out: every spec step names its folder
    under $OUT/results, so the records travel in results.tar."""
    results = tmp_path / "out" / "results"
    spec_steps = [(name, cmd) for args in ONE_CALL for name, _, cmd in steps(tmp_path, *args)
                  if cmd[1:3] == ["-m", "kdtree_engine.bench_spec"]]
    assert spec_steps
    for name, cmd in spec_steps:
        assert "--out" in cmd, (name, cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        assert out == results or results in out.parents, (name, out)
