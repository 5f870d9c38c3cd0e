"""What every benchmark record carries about the run that wrote it: the git commit (``-dirty`` when tracked files
differ from it), Python / torch / triton versions (triton's read from its package metadata, "not installed" where
absent: the CPU runs without it), the device name, the exact command and the UTC time.

`run_metadata` builds the dict once per record; `metadata_line` is its one-line Markdown form and `with_metadata`
puts that line under a record's title. Used by ``kdtree bench spec`` and by bench/common.py (bench/ cannot be
imported by the package, so the helper lives here)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from .env import read_env

# The checkout this package runs from: its commit is the code that produced the record.
REPO_ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "unknown"
NOT_INSTALLED = "not installed"


def git_commit(root: str | Path = REPO_ROOT) -> str:
    """The commit checked out at ``root`` with "-dirty" when tracked files differ from it; "unknown" when git is
    absent, fails, or ``root`` is not the top of a git work tree (an installed copy inside some other repository
    must not report that repository's commit)."""
    root = Path(root).resolve()

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True)
        return done.stdout.strip()

    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        if Path(top).resolve() != root:
            return UNKNOWN
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, ValueError):
        return UNKNOWN
    return commit + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def device_name(device: Any = None) -> str:
    """The GPU's name for a CUDA device (the current one when ``device`` is None and CUDA is available), else the
    CPU model."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_model()


def command_line(argv: Sequence[str] | None = None, program: str | None = None) -> str:
    """The command, shell-quoted: this process's own (the interpreter's name and ``sys.argv``) when ``argv`` is
    None, else ``program`` followed by ``argv`` (a script's ``main(argv)`` called in-process, as tests do)."""
    here = [os.path.basename(sys.executable) or "python3", sys.argv[0] if sys.argv and sys.argv[0] else "-c"]
    if argv is None:
        return shlex.join(here + sys.argv[1:])
    return shlex.join((shlex.split(program) if program is not None else here) + [str(a) for a in argv])


def package_version(name: str) -> str:
    """The installed version of distribution ``name`` from its metadata (the package is not imported: triton is
    optional on the CPU), or "not installed"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def run_metadata(command: str | None = None, device: Any = None) -> dict[str, str]:
    """The run's provenance: commit, versions, device name, ``command`` (default `command_line()`) and UTC time.
    The commit is git's, or KDTREE_RECORD_COMMIT's where set (a run on a copy of the work tree whose git metadata
    is not the code's); ``commit_from`` says which."""
    given = read_env().record_commit
    return {
        "commit": given or git_commit(),
        "commit_from": "KDTREE_RECORD_COMMIT" if given else "git",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "device": device_name(device),
        "command": command if command is not None else command_line(),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def metadata_line(meta: dict[str, str]) -> str:
    return (f"Run: commit `{meta['commit']}`, Python {meta['python']}, torch {meta['torch']}, "
            f"triton {meta['triton']}, {meta['device']}, {meta['utc']}; command `{meta['command']}`")


def with_metadata(markdown: str, meta: dict[str, str]) -> str:
    """``markdown`` with the run line after its title (its first line when that is a heading), else on top."""
    lines = markdown.split("\n")
    if not (lines and lines[0].startswith("#")):
        return "\n".join([metadata_line(meta), ""] + lines)
    rest = lines[1:]
    if rest and not rest[0].strip():
        rest = rest[1:]
    return "\n".join([lines[0], "", metadata_line(meta), ""] + rest)
