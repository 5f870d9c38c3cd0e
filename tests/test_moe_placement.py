"""Where the MoE's shared expert runs on CUDA (kernels/dispatch.py shared_placement): a side stream for small shared
experts, before the routed experts for large ones, an override by KDTREE_MOE_SHARED; a bad value is refused
by name. (The placements order the same kernels; on the GPU the demo's round and spec benches decoded
losslessly with the shared expert beside and before the routed experts: bench/results/round-h200*.md,
spec-h200*.md.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kdtree_engine.kernels import dispatch as dispatch


def test_default_placement_follows_the_shared_expert_bytes(monkeypatch):
    monkeypatch.setattr(dispatch, "_SHARED", None)
    assert dispatch.shared_placement(300 << 10) == "side"                        # the demo: 0.3 MB
    assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES - 1) == "side"
    assert dispatch.shared_placement(dispatch.SHARED_SIDE_BYTES) == "before"
    assert dispatch.shared_placement(3 * 7168 * 2048 * 2) == "before"           # K2: 88 MB


@pytest.mark.parametrize("forced", dispatch.SHARED_PLACEMENTS)
def test_forced_placement_wins(monkeypatch, forced):
    monkeypatch.setattr(dispatch, "_SHARED", forced)
    assert dispatch.shared_placement(1) == forced
    assert dispatch.shared_placement(1 << 40) == forced


def test_bad_placement_is_refused_by_name():
    env = dict(os.environ, KDTREE_MOE_SHARED="sideways")
    r = subprocess.run([sys.executable, "-c", "import kdtree_engine.kernels.dispatch"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "KDTREE_MOE_SHARED" in r.stderr and "sideways" in r.stderr

