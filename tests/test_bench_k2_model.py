"""CPU smoke test of bench/k2_model.py at tiny size: it builds rank 0 of 8 of a tiny K2, runs whole rounds, writes
its JSON and Markdown with the run's metadata, and its byte and link accounting is consistent. No timing is
asserted."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pytest
from record_checks import check_run_metadata

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import k2_model  # noqa: E402

ARGS = ["--tiny", "--device", "cpu", "--nodes", "1,4", "--contexts", "48", "--reps", "1", "--replays", "1"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("k2_model")
    return out, k2_model.main([*ARGS, "--out", str(out)])


def test_writes_records(report):
    out, rep = report
    data = json.loads((out / "k2_model-cpu.json").read_text())
    md = (out / "k2_model-cpu.md").read_text()
    assert data["tiny"] is True and data["world"] == 8
    assert "Tokens/s" in md and "Links" in md
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/k2_model.py", *ARGS, "--out", str(out)]), md)


def test_rounds_and_accounting(report):
    _, rep = report
    rows = rep["rounds"]
    assert [(r["context"], r["T"]) for r in rows] == [(48, 1), (48, 4)]
    cfg = rep["config"]
    for r in rows:
        assert "error" not in r, r
        assert math.isfinite(r["ms"]) and r["ms"] > 0
        assert r["bytes_total"] == sum(r["bytes"].values())
        # two cross-rank sums a layer at least, each a collective of this rank's shard
        assert r["collectives"]["count"] >= 2 * cfg["num_hidden_layers"]
        assert r["links_ms"] > 0 and math.isclose(r["round_8gpu_ms"], r["ms"] + r["links_ms"])
        # this rank holds 2 of 16 experts: it never touches more than it holds
        assert 0 <= r["touched_experts_per_layer"] <= rep["rank_shard"]["experts"]
    plain, tree = rows
    assert "drafter" not in plain["bytes"] and tree["bytes"]["drafter"] > 0
    assert plain["bytes"]["latent_cache"] < tree["bytes"]["latent_cache"]  # (context + nodes) rows


def test_tokens_per_s(report):
    _, rep = report
    rows = {(t["T"], t["tau"]): t["tokens_per_s"] for t in rep["tokens_per_s"]}
    plain = next(r for r in rep["rounds"] if r["T"] == 1)
    assert math.isclose(rows[(1, 1.0)], 1e3 / plain["round_8gpu_ms"])
    # a 4-node tree of a block-4 drafter emits at most 4 tokens a round: only the taus it can reach
    assert {tau for (T, tau) in rows if T == 4} == {t for t in k2_model.TAUS if t <= 4}


def test_links_model():
    links = k2_model.Links(world=8, latency_us=10.0, GBps=100.0)
    assert math.isclose(links.us("all_gather", 10**6), 10.0 + 7 * 10**6 / 100e9 * 1e6)
    assert math.isclose(links.us("all_reduce", 8 * 10**6), 10.0 + 2 * 7 / 8 * 8 * 10**6 / 100e9 * 1e6)


def test_real_ranks_run_the_same_rounds(tmp_path):
    """--ranks 2 on the CPU (gloo): two processes build their shards and run the same rounds, the collectives crossing
    between them (no link model), fewer layers with the drafter's target layers spread over them; rank 0 records."""
    args = [*ARGS, "--ranks", "2", "--layers", "3", "--out", str(tmp_path)]
    rep = k2_model.main(args)
    data = json.loads((tmp_path / "k2_model-cpu-x2.json").read_text())
    assert data["world"] == 2 and data["ranks_run"] == 2 and data["layers"] == 3 and data["links"]["measured"]
    assert data["rank_shard"]["heads"] == data["config"]["num_attention_heads"] // 2
    for r in rep["rounds"]:
        assert "error" not in r and r["ms"] > 0 and r["links_ms"] == 0 and r["round_8gpu_ms"] == r["ms"]
        assert r["collectives"]["count"] >= 2 * 3
    assert "2 ranks on 2 devices" in (tmp_path / "k2_model-cpu-x2.md").read_text()
