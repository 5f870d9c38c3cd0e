"""CPU smoke tests of bench/k2_step.py and bench/round.py at tiny sizes (they run, write their JSON and
Markdown with the run's metadata, and the numbers are finite) and of bench/launch_census.py on the demo. No timing
is asserted."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from record_checks import check_run_metadata

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import k2_step, round as round_bench  # noqa: E402


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


K2_ARGS = ["--tiny", "--device", "cpu", "--nodes", "1,4,8", "--reps", "2", "--tau", "3"]


@pytest.fixture(scope="module")
def k2_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("k2_step")
    rep = k2_step.main([*K2_ARGS, "--out", str(out)])
    return out, rep


def test_k2_step_writes_files(k2_report):
    out, rep = k2_report
    data = json.loads((out / "k2_step-cpu.json").read_text())
    md = (out / "k2_step-cpu.md").read_text()
    assert data["tiny"] is True and data["nodes"] == [1, 4, 8]
    assert "k2_step.py" in data["command"] or "--tiny" in data["command"]
    for key in ("copy_Bps", "matmul_flops", "static_bytes", "assumptions", "assumptions_text", "steps", "projection"):
        assert key in data
    assert finite(data["copy_Bps"]) and data["copy_Bps"] > 0
    assert "Projection" in md and "all-reduce" in md
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/k2_step.py", *K2_ARGS, "--out", str(out)]), md)


def test_k2_step_fields_finite(k2_report):
    _, rep = k2_report
    steps = rep["steps"]
    assert [s["T"] for s in steps] == [1, 4, 8]
    cfg = rep["config"]
    for s in steps:
        assert "error" not in s and "skipped" not in s, s
        assert s["kind"] == ("decode" if s["T"] == 1 else "verify")
        assert s["finite"] is True
        assert s["path"] == "static" and finite(s["index_us"])  # the engine's device-round forward by default
        for k in ("attn_us", "moe_us", "layer_us", "layer_roofline_us", "layer_x_copy", "layer_x_roof",
                  "attn_x_copy", "moe_x_copy"):
            assert finite(s[k]) and s[k] > 0, k
        # distinct experts: between top-k (one token) and all experts, counted per layer
        assert len(s["touched_experts"]) == rep["layers_timed"]
        assert all(cfg["num_experts_per_tok"] <= t <= min(cfg["n_routed_experts"], s["T"] * cfg["num_experts_per_tok"])
                   for t in s["touched_experts"])
        b = s["bytes"]
        assert b["layer"] == pytest.approx(b["attention"] + b["moe"])
        assert b["routed_experts"] == pytest.approx(s["touched_experts_mean"] * rep["static_bytes"]["expert_bytes"])
        rk = s["rank"]
        for k in ("attn_us", "moe_us", "dense_mlp_us", "lm_head_us", "experts_busiest_mean"):
            assert finite(rk[k]), k
        p = s["projection"]
        for k in ("compute_us", "comm_us", "step_ms", "step_floor_ms", "round_ms", "tokens_per_s", "breakeven_tau"):
            assert finite(p[k]) and p[k] > 0, k
    plain = steps[0]["projection"]
    assert plain["tokens_per_s"] == pytest.approx(1e3 / plain["step_ms"])
    tree = steps[1]["projection"]
    assert tree["tokens_per_s"] == pytest.approx(3 * 1e3 / (tree["step_ms"] + rep["assumptions"]["draft_ms"]))
    assert len(rep["projection"]) == 3


def test_k2_step_random_tree():
    mask, depth = k2_step.random_tree(9, seed=1)
    assert mask.diagonal().all() and mask[:, 0].all()
    assert not mask.triu(1).any()  # parents come before children
    assert torch.equal(mask.sum(1) - 1, depth)  # ancestors (self excluded) = depth


ROUND_ARGS = ["--tiny", "--device", "cpu", "--budgets", "4,8", "--modes", "eager,device,graph"]


@pytest.fixture(scope="module")
def round_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("round")
    rep = round_bench.main([*ROUND_ARGS, "--out", str(out)])
    return out, rep


def test_round_writes_files(round_report):
    out, rep = round_report
    data = json.loads((out / "round-cpu.json").read_text())
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/round.py", *ROUND_ARGS, "--out", str(out)]),
                       (out / "round-cpu.md").read_text())
    assert [r["setting"] for r in data["results"]] == ["none", "dflash", "ddtree-4", "ddtree-8"]
    assert data["modes"]["graph"].startswith("n/a")


def test_round_fields_finite(round_report):
    _, rep = round_report
    for r in rep["results"]:
        e = r["eager"]
        for k in ("rounds_per_s", "tokens_per_s", "ms_per_round", "speedup"):
            assert finite(e[k]) and e[k] > 0, (r["setting"], k)
        assert finite(r["tau"]) and r["tau"] >= 1.0
        assert r["graph"].startswith("n/a")
        dv = r["device"]  # device-resident rounds, run eagerly
        for k in ("rounds_per_s", "tokens_per_s", "ms_per_round"):
            assert finite(dv[k]) and dv[k] > 0, (r["setting"], k)
        assert dv["lossless"] is True and dv["rounds"] == r["eager"]["rounds"]
        assert r["kernels"]["outside_kernels_frac"] is None  # CPU: no kernel profile
        assert r["lossless"] is True
        assert all(finite(v) for v in r["stage_ms_per_round"].values())
    assert rep["results"][0]["tau"] == 1.0


def test_device_busy_union():
    def ev(dev, s, e, name="k"):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=s, end=e), name=name)

    prof = SimpleNamespace(events=lambda: [ev("DeviceType.CUDA", 0, 10, "a"), ev("DeviceType.CUDA", 5, 12, "b"),
                                           ev("DeviceType.CPU", 0, 100, "a"), ev("DeviceType.CUDA", 20, 25, "a")])
    got = round_bench.device_busy(prof)
    assert got["busy_us"] == 17 and got["events"] == 3
    assert got["by_name"] == {"a": [2, 15.0], "b": [1, 7.0]}
    from bench.common import union_us
    # unsorted, nested, touching and disjoint intervals; none at all
    assert union_us([(5, 8), (0, 10), (10, 12), (20, 21)]) == 13
    assert union_us([]) == 0


def test_kernel_table_subtracts_prefill_and_ranks_by_time():
    full = {"by_name": {"a": [12, 30.0], "b": [4, 40.0], "c": [2, 2.0]}}
    pre = {"by_name": {"a": [2, 10.0], "c": [2, 2.0]}}
    rows = round_bench.kernel_table(full, pre, rounds=2, top=5)
    assert rows == [{"kernel": "b", "launches_per_round": 2.0, "us_per_round": 20.0},
                    {"kernel": "a", "launches_per_round": 5.0, "us_per_round": 10.0}]


DEMO = ROOT / "kdtree_engine" / "assets" / "demo"


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_launch_census_counts_every_part(tmp_path):
    """The census of one round (torch paths): every op lands in a part, the layer types are the demo's,
    and a DDTree round adds the drafter and the tree builder to what a plain round runs."""
    from bench import launch_census

    out = tmp_path / "census.json"
    args = ["--methods", "none,ddtree", "--budget", "8", "--top", "3", "--json", str(out)]
    rep = launch_census.main(args)
    written = json.loads(out.read_text())
    check_run_metadata(written.pop("meta"), shlex.join(["python3", "bench/launch_census.py", *args]))
    assert written == json.loads(json.dumps(rep))
    plain, tree = rep["methods"]["none"], rep["methods"]["ddtree-8"]
    for s in (plain, tree):
        assert s["total"] > 0 and sum(s["parts"].values()) == s["total"]
        assert set(s["per_layer_type"]) == {"dense layer", "moe layer"}
        assert sum(n for _, n in s["top_ops"]) == s["total"]
    assert "drafter" not in plain["parts"] and plain["parts"].get("tree", 0) < tree["parts"]["tree"]
    assert tree["parts"]["drafter"] > 0


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_launch_census_of_a_batched_step_leaves_out_the_graph_bodies(tmp_path):
    """The census of a batched step (torch paths): every op lands in a part; none of the target's layers or lm_head
    (the slots' forward, replayed from a graph on CUDA) nor of the drafter's layers (the draft slots' pass) is
    counted; sampled requests' walks and trees are (host-driven rounds); greedy ones run whole rounds in tree slots
    (one replay, no op the host launches)."""
    from bench import launch_census

    out = tmp_path / "census.json"
    args = ["--batch", "1,3", "--budget", "4", "--top", "3", "--json", str(out), "--sampled"]
    rep = launch_census.main(args)
    written = json.loads(out.read_text())
    check_run_metadata(written.pop("meta"), shlex.join(["python3", "bench/launch_census.py", *args]))
    assert written == json.loads(json.dumps(rep))
    for n in (1, 3):
        s = rep["batch"][n]
        assert s["total"] > 0 and sum(s["parts"].values()) == s["total"]
        assert not {"target layers", "lm_head", "mla", "norm"} & set(s["parts"])
        assert s["parts"]["accept"] > 0 and s["parts"]["tree"] > 0
        assert not any(op.startswith("drafter:") and op.split(":")[1] in ("mm", "bmm", "addmm")
                       for op, _ in s["top_ops"])
    greedy = launch_census.main(["--batch", "3", "--budget", "4"])
    assert greedy["batch"][3]["total"] == 0


def test_attention_bench_candidates_are_valid_configs():
    """bench/mla_attention.py builds its sweep candidates at import (from the defaults): each one a config that
    MLAConfig accepts, so a change of the defaults cannot break the bench before it runs."""
    from bench import mla_attention as mb
    from kdtree_engine.kernels.mla_attention import MLAConfig

    lists = [mb.SWEEP, mb.DECODE_SWEEP, mb.CHUNK_SWEEP, mb.ROWS_SWEEP, mb.VSPLIT_SWEEP, mb.WIDE_SWEEP, mb.SMALL_SWEEP]
    assert all(isinstance(c, MLAConfig) for cs in lists for c in cs) and all(lists)


# ---- the weight formats' benches (bench/moe_formats.py, bench/moonlight.py) at tiny sizes -------------------

FORMATS_ARGS = ["--tiny", "--device", "cpu", "--tokens", "1,4", "--rows", "1,2", "--reps", "1"]


def test_moe_formats_bench_runs(tmp_path):
    from bench import moe_formats

    rep = moe_formats.main([*FORMATS_ARGS, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moe_formats-cpu.json").read_text())
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/moe_formats.py", *FORMATS_ARGS, "--out",
                                                 str(tmp_path)]), (tmp_path / "moe_formats-cpu.md").read_text())
    assert [(r["format"], r["T"]) for r in rep["moe"]] == [("float32", 1), ("float32", 4), ("fp8", 1), ("fp8", 4)]
    k = rep["moe"][0]["touched_experts"]
    for r in rep["moe"]:
        assert finite(r["us"]) and finite(r["x_copy"]) and r["x_copy"] > 0 and r["backend"] == "torch"
        assert k <= r["touched_experts"] <= 16
    fp8 = {r["T"]: r["bytes"] / r["touched_experts"] for r in rep["moe"] if r["format"] == "fp8"}
    dense = {r["T"]: r["bytes"] / r["touched_experts"] for r in rep["moe"] if r["format"] == "float32"}
    assert all(fp8[t] < dense[t] / 3 for t in fp8)   # one byte a weight (plus scales) against four
    assert {r["linear"] for r in rep["dense"]} >= {"q_a_proj", "kv_b_proj", "o_proj"}
    for r in rep["dense"]:
        for key in ("w8a16_us", "f_linear_us", "bi_gemm_us", "speedup_vs_f_linear", "x_copy"):
            assert finite(r[key]) and r[key] > 0, key
        assert 0 <= r["rel_err_vs_bf16"] < 1e-5   # float32 on the CPU: the same math


MOONLIGHT_ARGS = ["--tiny", "--device", "cpu", "--nodes", "1,4", "--reps", "1"]


def test_moonlight_bench_runs(tmp_path):
    from bench import moonlight

    rep = moonlight.main([*MOONLIGHT_ARGS, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moonlight-cpu.json").read_text())
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/moonlight.py", *MOONLIGHT_ARGS, "--out",
                                                 str(tmp_path)]), (tmp_path / "moonlight-cpu.md").read_text())
    assert [(r["format"], r["T"], r["kind"]) for r in rep["steps"]] == [
        ("bf16", 1, "decode"), ("bf16", 4, "verify"), ("int4", 1, "decode"), ("int4", 4, "verify")]
    top_k = rep["config"]["num_experts_per_tok"]
    for r in rep["steps"]:
        for key in ("us", "bytes", "roofline_us", "x_roof"):
            assert finite(r[key]) and r[key] > 0, key
        assert top_k <= r["touched_experts_per_layer"] <= rep["config"]["n_routed_experts"]
    b = {(r["format"], r["T"]): r["bytes"] for r in rep["steps"]}
    assert b[("int4", 1)] < b[("bf16", 1)]   # INT4 experts read fewer bytes


def test_moonlight_preset_is_the_published_config(tmp_path):
    """The preset equals the engine's reading of Moonlight-16B-A3B's config.json (its fields as published)."""
    from kdtree_engine.config import ModelConfig, preset

    published = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "bos_token_id": 163584,
        "eos_token_id": 163586, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840,
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert ModelConfig.from_pretrained(tmp_path) == preset("moonlight-16b")


def test_batch_bench_runs_on_the_cpu(tmp_path):
    """bench/batch.py at its smallest: the K2 one-rank build at k2-tiny dims, two concurrencies, both methods."""
    from bench import batch as batch_bench
    args = ["--model", "k2", "--tiny", "--device", "cpu", "--concurrency", "1,3", "--max-tokens", "4",
            "--prompt-tokens", "8", "--repeats", "2", "--out", str(tmp_path)]
    rep = batch_bench.main(args)
    data = json.loads((tmp_path / "batch-k2-tiny-cpu.json").read_text())
    assert [(r["concurrency"], r["method"]) for r in data["rows"]] == [(1, "plain"), (1, "ddtree-auto"),
                                                                     (3, "plain"), (3, "ddtree-auto")]
    for r in rep["rows"]:
        assert r["tokens"] == 4 * r["concurrency"] and finite(r["tokens_per_s"]) and r["forwards"] >= 4
        assert r["method"] == "plain" or sum(r["budget_chosen"].values()) > 0
        runs = r["tokens_per_s_runs"]   # two measured runs; the row is the lower of them (the median of two)
        assert len(runs) == 2 and r["tokens_per_s"] == min(runs)
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/batch.py", *args]),
                       (tmp_path / "batch-k2-tiny-cpu.md").read_text())


def test_batch_bench_runs_over_two_ranks(tmp_path):
    """bench/batch.py --ranks 2: two gloo processes each holding one rank of TP-2 / EP-2 (k2-tiny), rank 0's batches
    followed by the other step for step; plain and fixed trees (the load-aware budget is refused there)."""
    from bench import batch as batch_bench
    args = ["--model", "k2", "--tiny", "--device", "cpu", "--ranks", "2", "--concurrency", "1,3", "--max-tokens", "4",
            "--prompt-tokens", "8", "--methods", "plain,ddtree-16", "--out", str(tmp_path)]
    rep = batch_bench.main(args)
    data = json.loads((tmp_path / "batch-k2-tiny-cpu-x2.json").read_text())
    assert data["ranks"] == 2 and [(r["concurrency"], r["method"]) for r in data["rows"]] == [
        (1, "plain"), (1, "ddtree-16"), (3, "plain"), (3, "ddtree-16")]
    for r in rep["rows"]:
        assert r["tokens"] == 4 * r["concurrency"] and finite(r["tokens_per_s"]) and r["forwards"] >= 4
    assert "over 2 ranks" in (tmp_path / "batch-k2-tiny-cpu-x2.md").read_text()
    with pytest.raises(SystemExit):
        batch_bench.main(["--model", "k2", "--tiny", "--device", "cpu", "--ranks", "2", "--methods", "ddtree-auto",
                          "--out", str(tmp_path)])


def test_batch_graph_bench_runs_on_the_cpu(tmp_path):
    """bench/batch_graph.py at its smallest: the k2-tiny one-rank build, two concurrencies, eager on the CPU."""
    from bench import batch_graph
    args = ["--model", "k2", "--tiny", "--device", "cpu", "--concurrency", "1,2", "--context", "16", "--reps", "1",
            "--out", str(tmp_path)]
    rep = batch_graph.main(args)
    data = json.loads((tmp_path / "batch_graph-k2-tiny-cpu.json").read_text())
    assert [(r["concurrency"], r["rows"]) for r in data["rows"]] == [(1, 1), (2, 2)]
    for r in rep["rows"]:
        assert finite(r["ms"]) and finite(r["tokens_per_s"]) and r["graph"] is False
    assert finite(rep["rows"][1]["x_one_request"])
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/batch_graph.py", *args]),
                       (tmp_path / "batch_graph-k2-tiny-cpu.md").read_text())

