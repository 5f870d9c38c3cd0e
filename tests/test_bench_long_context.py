"""bench/long_context.py at its smallest configuration on the CPU (a tiny K2-shaped rank, the demo): the records are
written with the run's metadata and their fields agree with each other and with FLOP and byte counts derived here
from the configuration (independent of the bench's own counting). No timing is asserted."""

from __future__ import annotations

import gc
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

from bench import long_context  # noqa: E402
from bench.k2_model import tiny_config  # noqa: E402
from kdtree_engine.config import ModelConfig  # noqa: E402
from kdtree_engine.warmup import warmup_lengths  # noqa: E402

ARGS = ["--tiny", "--device", "cpu"]
STEP_ARGS = ["--tiny", "--device", "cpu", "--parts", "steps", "--layers", "3", "--contexts", "32", "--nodes", "1",
             "--label", "steps"]


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield
    gc.unfreeze()   # the warm-up freezes what start-up made; the other tests' objects stay collectable


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    return out, long_context.main([*ARGS, "--out", str(out)])


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def linear_flops_per_token(cfg: ModelConfig, world: int) -> int:
    """2 x the rank's linear weights a token goes through (kv_b apart: the attention counts it), from the config."""
    H, N = cfg.hidden_size, cfg.num_attention_heads // world
    P, R, V, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    attn = H * cfg.q_lora_rank + cfg.q_lora_rank * N * (P + R) + H * (C + R) + N * V * H
    total = 0
    for i in range(cfg.num_hidden_layers):
        mlp = (3 * H * cfg.moe_intermediate_size * cfg.n_shared_experts if cfg.is_moe_layer(i)
               else 3 * H * cfg.intermediate_size) // world
        total += attn + mlp
    return 2 * total


def test_writes_records(report):
    out, rep = report
    data = json.loads((out / "long_context-cpu.json").read_text())
    md = (out / "long_context-cpu.md").read_text()
    check_run_metadata(data["meta"], shlex.join(["python3", "bench/long_context.py", *ARGS, "--out", str(out)]), md)
    assert data["tiny"] is True and data["parts"] == list(long_context.PARTS)
    assert "Prefill" in md and "Steps" in md and "Demo TTFT" in md and "warm-up" in md


def test_prefill_rows(report):
    _, rep = report
    cfg, k2 = tiny_config(), rep["k2"]
    assert (k2["layers"], k2["world"], k2["local_experts"]) == (cfg.num_hidden_layers, 8, cfg.n_routed_experts // 8)
    rows = rep["prefill"]
    assert [(r["model"], r["prompt_tokens"]) for r in rows] == [(m, T) for m in ("k2-rank", "demo") for T in (48, 160)]
    for r in rows:
        T = r["prompt_tokens"]
        assert r["prefill_chunk"] == rep["chunk"] == 64 and r["prefill_chunks"] == -(-T // 64)
        assert r["prefill_s"] > 0 and r["ttft_s"] >= r["prefill_s"] and r["x_matmul_peak"] is None   # no peak: CPU
        assert close(r["tokens_per_s"], T / r["prefill_s"]) and r["flops_total"] == sum(r["flops"].values())
        assert close(r["tflops"], r["flops_total"] / r["prefill_s"] / 1e12)
        assert "projected_61_layers_ttft_s" not in r   # every layer built
    k2_rows = [r for r in rows if r["model"] == "k2-rank"]
    N, P, R, V, C = (cfg.num_attention_heads // 8, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                     cfg.kv_lora_rank)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    for r in k2_rows:
        T, f = r["prompt_tokens"], r["flops"]
        assert f["linears"] == T * linear_flops_per_token(cfg, 8)
        assert f["router"] == 2 * T * cfg.hidden_size * cfg.n_routed_experts * moe_layers
        # uniform routes: top-k x local / all experts routes a token, 3 products of H x I each
        assert close(f["routed_experts"], 2 * T * cfg.num_experts_per_tok / 8 * 3 * cfg.hidden_size
                     * cfg.moe_intermediate_size * moe_layers)
    one = k2_rows[0]   # 48 tokens: one chunk, the naive form over the causal pairs
    pairs = 48 * 49 // 2
    assert one["flops"]["attention"] == cfg.num_hidden_layers * (2 * 48 * C * N * (P + V) + 2 * pairs * N * (P + R + V))
    # three chunks: at least the naive-form scores of every causal pair, at most both forms' work
    pairs = 160 * 161 // 2
    lo = cfg.num_hidden_layers * 2 * pairs * N * (P + R + V)
    assert lo < k2_rows[1]["flops"]["attention"] < 4 * lo


def test_step_rows(report):
    _, rep = report
    cfg = tiny_config()
    rows = rep["steps"]
    assert [(r["context"], r["T"], r["kind"]) for r in rows] == [(64, 1, "decode"), (64, 4, "verify")]
    for r in rows:
        assert r["bytes_total"] == sum(r["bytes"].values())
        # float32 latents on the CPU: (context + nodes) x layers x 576 values x 4 bytes
        assert r["bytes"]["latent_cache"] == (r["context"] + r["T"]) * cfg.num_hidden_layers * cfg.kv_cache_dim * 4
        assert close(r["roofline_ms"], r["bytes_total"] / rep["copy_Bps"] * 1e3)
        assert close(r["x_roofline"], r["ms"] / r["roofline_ms"]) and r["graph"] is False
        assert 0 <= r["touched_experts_per_layer"] <= rep["k2"]["local_experts"]
    assert rows[0]["bytes"]["weights"] == rows[1]["bytes"]["weights"] > 0


def test_demo_ttft(report):
    _, rep = report
    w, d = rep["demo_warm_up"], rep["demo_ttft"]
    assert w["prompt_lengths"] == len(warmup_lengths(w["longest"])) and w["longest"] <= w["chunk"] == 40
    assert w["decode_requests"] == 2 and w["compiled"] in (None, 0) and d["compiled_during"] in (None, 0)   # CPU: torch
    r = d["random"]
    assert r["prompts"] == 3 and r["lengths"] == [16, 40] and 16 <= r["max_prompt_tokens"] <= 40
    assert r["ttft_ms_max"] >= r["ttft_ms_p90"] >= r["ttft_ms_median"] > 0
    assert close(r["max_over_median"], r["ttft_ms_max"] / r["ttft_ms_median"])
    met = d["ttft_ms_median"] < d["goal"]["ttft_ms"] and r["max_over_median"] <= d["goal"]["max_over_median"]
    assert d["goal"]["met"] is met and d["runs"] == 2 and d["prompt_tokens"] == 100


def test_fewer_layers_are_projected(tmp_path):
    rep = long_context.main([*STEP_ARGS, "--out", str(tmp_path)])
    assert (tmp_path / "long_context-steps-cpu.json").is_file() and rep["prefill"] == [] and "demo_ttft" not in rep
    (row,) = rep["steps"]
    assert rep["k2"]["layers"] == 3 and close(row["projected_61_layers_ms"], row["ms"] * 4 / 3)


@pytest.mark.parametrize("bad", [["--parts", "nope"], ["--demo-lengths", "9,3"], ["--layers", "1"], ["--reps", "-1"]])
def test_bad_arguments_fail_with_one_line(bad, capsys):
    with pytest.raises(SystemExit) as e:
        long_context.parse_args(bad)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()[-1]) > 0
