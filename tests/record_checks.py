"""The provenance every benchmark record carries (kdtree_engine/records.py), checked the same way for each writer."""

from __future__ import annotations

import platform
import re

import torch
import triton

from kdtree_engine.records import cpu_model, git_commit


def check_run_metadata(meta: dict, command: str, md: str | None = None) -> None:
    """A record's provenance: commit (or "unknown" off a git checkout), this interpreter's versions, the CPU's
    name (the tiny runs are on the CPU), the exact command, a UTC time; the Markdown shows the same line."""
    assert meta["commit"] == git_commit() and re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", meta["commit"])
    assert (meta["python"], meta["torch"], meta["triton"]) == (platform.python_version(), torch.__version__,
                                                               triton.__version__)
    assert meta["device"] == cpu_model() and meta["device"]
    assert meta["command"] == command
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["utc"])
    if md is not None:
        title, blank, run = md.split("\n")[:3]
        assert title.startswith("# ") and blank == ""
        assert run.startswith(f"Run: commit `{meta['commit']}`, Python {meta['python']}, torch {meta['torch']}, "
                              f"triton {meta['triton']}, {meta['device']}, {meta['utc']}; command `{command}`")
