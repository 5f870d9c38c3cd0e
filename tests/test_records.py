"""kdtree_engine/records.py: the commit of a checkout (with -dirty, "unknown" without git or off a checkout's
top), the command line, the run line under a record's title, and triton's version from its package metadata."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import pytest

from kdtree_engine import records


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_of_a_checkout_clean_dirty_and_below_its_top(tmp_path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert records.git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files are not the code that ran\n")
    assert records.git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert records.git_commit(tmp_path) == head + "-dirty"
    (tmp_path / "pkg").mkdir()
    assert records.git_commit(tmp_path / "pkg") == records.UNKNOWN  # a copy inside another repository


def test_git_commit_unknown_without_git_or_repository(tmp_path, monkeypatch) -> None:
    assert records.git_commit(tmp_path) == records.UNKNOWN
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable on the path
    assert records.git_commit(records.REPO_ROOT) == records.UNKNOWN


def test_command_line_in_process_and_as_typed(monkeypatch) -> None:
    assert records.command_line(["--out", "a b"], "python3 bench/round.py") == "python3 bench/round.py --out 'a b'"
    monkeypatch.setattr("sys.argv", ["bench/k2_step.py", "--tiny"])
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    assert records.command_line() == "python3 bench/k2_step.py --tiny"


def test_run_line_goes_under_the_title() -> None:
    meta = {"commit": "abc", "python": "3.12", "torch": "2.11", "triton": "3.6", "device": "NVIDIA H200",
            "command": "kdtree bench spec", "utc": "2026-01-01T00:00:00Z"}
    line = records.metadata_line(meta)
    assert line == ("Run: commit `abc`, Python 3.12, torch 2.11, triton 3.6, NVIDIA H200, 2026-01-01T00:00:00Z; "
                    "command `kdtree bench spec`")
    assert records.with_metadata("# Title\n\nbody\n", meta) == f"# Title\n\n{line}\n\nbody\n"
    assert records.with_metadata("# Title\nbody", meta) == f"# Title\n\n{line}\n\nbody"
    assert records.with_metadata("| a |", meta) == f"{line}\n\n| a |"


def test_record_commit_from_the_environment(monkeypatch) -> None:
    """KDTREE_RECORD_COMMIT names the commit of a run on a copy whose git metadata is stale; a bad value is an error
    that names the variable; unset, the commit is git's."""
    monkeypatch.setenv("KDTREE_RECORD_COMMIT", "6671e3b")
    meta = records.run_metadata(command="x")
    assert meta["commit"] == "6671e3b" and meta["commit_from"] == "KDTREE_RECORD_COMMIT"
    monkeypatch.setenv("KDTREE_RECORD_COMMIT", "not a commit")
    with pytest.raises(ValueError, match="KDTREE_RECORD_COMMIT"):
        records.run_metadata(command="x")
    monkeypatch.delenv("KDTREE_RECORD_COMMIT")
    meta = records.run_metadata(command="x")
    assert meta["commit_from"] == "git" and meta["commit"] == records.git_commit()


def test_triton_version_from_the_package_metadata(monkeypatch) -> None:
    """The triton version is read without importing triton (optional on the CPU): the installed one where it is
    (its module's own __version__ as the oracle), "not installed" where its distribution is absent."""
    triton = pytest.importorskip("triton")
    assert records.package_version("triton") == triton.__version__
    assert records.run_metadata(command="x")["triton"] == triton.__version__
    assert records.package_version("kdtree-engine-no-such-distribution") == records.NOT_INSTALLED == "not installed"
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "triton":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    meta = records.run_metadata(command="x")
    assert meta["triton"] == "not installed" and "triton not installed," in records.metadata_line(meta)
