"""The `kdtree` command: JSON contract, streaming, spec flags, exit codes for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.cli import main
from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter, save_drafter
from kdtree_engine.weights import save_checkpoint

CFG = preset("k2-tiny")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    weights = {k: torch.from_numpy(v) for k, v in reference.random_weights(CFG, 0).items()}
    save_checkpoint(d, CFG, weights, layout="k2")
    return d


def draft_cfg(**kw) -> DraftConfig:
    base = dict(hidden_size=CFG.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=CFG.vocab_size - 1,
                target_layer_ids=(0, 2), num_target_layers=CFG.num_hidden_layers, vocab_size=CFG.vocab_size)
    return DraftConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("draft") / "d"
    save_drafter(d, DFlashDrafter.random(draft_cfg(), seed=1))
    return d


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "stdout must hold exactly one JSON object"
    return json.loads(out)


def test_generate_json_contract_and_reference_tokens(capsys, model_dir) -> None:
    prompt = [5, 7, 11, 13]
    obj = run_json(capsys, ["generate", "--model", str(model_dir), "--prompt-ids", "5,7,11,13",
                            "--max-tokens", "12", "--ignore-eos", "--json"])
    assert set(obj) == {"token_ids", "text", "finish_reason", "stats"}
    assert obj["text"] is None and obj["finish_reason"] == "length"
    for key in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "tokens_per_s"):
        assert key in obj["stats"]
    assert obj["stats"]["prompt_tokens"] == 4 and obj["stats"]["generated_tokens"] == 12
    weights = reference.random_weights(CFG, 0)
    assert obj["token_ids"] == reference.greedy(CFG, weights, prompt, 12)


def test_spec_flags_give_the_same_tokens(capsys, model_dir, draft_dir) -> None:
    base = ["generate", "--model", str(model_dir), "--prompt-ids", "3,1,4,1,5", "--max-tokens", "20",
            "--ignore-eos", "--json"]
    plain = run_json(capsys, base)
    for extra in (["--draft", str(draft_dir), "--spec", "dflash"],
                  ["--draft", str(draft_dir), "--spec", "dflash", "--budget", "2"],
                  ["--draft", str(draft_dir), "--spec", "ddtree", "--budget", "6"],
                  ["--draft", str(draft_dir), "--spec", "ddtree", "--budget", "auto"],
                  ["--draft", str(draft_dir), "--spec", "ddtree", "--budget", "6", "--eager"]):
        obj = run_json(capsys, base + extra)
        assert obj["token_ids"] == plain["token_ids"]
        assert obj["stats"]["rounds"] >= 1 and obj["stats"]["tau"] >= 1.0
        assert len(obj["stats"]["accepted_per_depth"]) == 3


def test_streaming_prints_tokens_and_stats(capsys, model_dir) -> None:
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "9,8", "--max-tokens", "5",
                 "--ignore-eos"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 5
    assert "tok/s" in cap.err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "/nonexistent/dir", "--prompt-ids", "1"], "/nonexistent/dir"),
    (["--prompt-ids", "1,2", "--max-tokens", "-1"], "max_tokens"),
    (["--prompt-ids", "1,2", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "1,99999"], "99999"),
    (["hello"], "tokenizer"),
    (["--prompt-ids", "1", "--spec", "ddtree"], "--draft"),
    (["--prompt-ids", "1", "--budget", "4"], "--budget"),
    (["--prompt-ids", "1", "--spec", "dflash", "--budget", "auto", "--draft", "DRAFT"], "--budget auto"),
    (["--prompt-ids", "1", "--spec", "dflash", "--budget", "9", "--draft", "DRAFT"], "--budget 9"),
])
def test_bad_input_exits_2_naming_it(capsys, model_dir, draft_dir, argv, needle) -> None:
    if "--model" not in argv:
        argv = ["--model", str(model_dir)] + argv
    argv = [str(draft_dir) if a == "DRAFT" else a for a in argv]
    assert main(["generate"] + argv) == 2
    assert needle in capsys.readouterr().err


def test_prompt_longer_than_max_positions_exits_2(capsys, tmp_path) -> None:
    cfg = CFG.replace(max_position_embeddings=16)
    weights = {k: torch.from_numpy(v) for k, v in reference.random_weights(cfg, 0).items()}
    save_checkpoint(tmp_path / "m", cfg, weights)
    ids = ",".join(["1"] * 20)
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", ids]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err


def test_corrupt_checkpoint_exits_2(capsys, model_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:1000])
    assert main(["generate", "--model", str(bad), "--prompt-ids", "1"]) == 2
    assert "model.safetensors" in capsys.readouterr().err


def test_mismatched_drafter_exits_2(capsys, model_dir, tmp_path) -> None:
    save_drafter(tmp_path / "wide", DFlashDrafter.random(draft_cfg(hidden_size=CFG.hidden_size * 2), seed=0))
    assert main(["generate", "--model", str(model_dir), "--draft", str(tmp_path / "wide"),
                 "--prompt-ids", "1"]) == 2
    assert "hidden" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--dtype", "float8"), ("--budget", "x"), ("--budget", "0")])
def test_unknown_flag_value_exits_2(model_dir, flag, value) -> None:
    r = subprocess.run([sys.executable, "-m", "kdtree_engine.cli", "generate", "--model", str(model_dir),
                        "--prompt-ids", "1", flag, value], capture_output=True, text=True)
    assert r.returncode == 2 and flag in r.stderr


def test_embedded_demo_is_the_default(capsys) -> None:
    obj = run_json(capsys, ["generate", "def quicksort(items):", "--max-tokens", "12", "--ignore-eos", "--json"])
    s = obj["stats"]
    assert s["spec"] == "ddtree" and s["generated_tokens"] == 12
    assert s["same_tokens_as_plain"] is True and s["speedup"] > 0 and s["tau"] >= 1.0
    assert isinstance(obj["text"], str) and obj["text"]


def test_sampled_compare_reports_no_token_comparison(capsys) -> None:
    """Sampled text equals plain decoding's in distribution only: --compare gives the speedup, not a
    token comparison (null in JSON, 'n/a' in the stats line)."""
    argv = ["generate", "def quicksort(items):", "--max-tokens", "8", "--ignore-eos", "--temperature", "0.7",
            "--seed", "3"]
    obj = run_json(capsys, argv + ["--json"])
    assert obj["stats"]["same_tokens_as_plain"] is None and obj["stats"]["speedup"] > 0
    assert main(argv) == 0
    assert "same tokens as plain: n/a" in capsys.readouterr().err


class FakeLLM:
    """Records the generations --compare asks for (no model); the speculative runs get faster each time."""

    def __init__(self, device: str, tokens_per_s=(100.0, 200.0, 150.0), plain_tokens_per_s=(80.0, 100.0, 90.0),
                 n_tokens: int = 8) -> None:
        self.device = torch.device(device)
        self.target, self.eager, self.calls = object(), None, []
        self.spec_speeds, self.plain_speeds, self.n_tokens = list(tokens_per_s), list(plain_tokens_per_s), n_tokens

    def result(self, speed: float):
        from kdtree_engine.speculative.decode import GenerationResult

        return GenerationResult(list(range(self.n_tokens)), "length",
                                {"tokens_per_s": speed, "generated_tokens": self.n_tokens})

    def generate(self, ids, params, on_tokens=None):
        self.calls.append(("spec", list(ids), params))
        return [self.result(self.spec_speeds.pop(0))]

    def plain(self, ids, params):
        self.calls.append(("plain", list(ids), params))
        return self.result(self.plain_speeds.pop(0) if len(self.calls) > 1 else 1.0)


def test_compare_warms_up_then_interleaves_timed_runs(monkeypatch) -> None:
    """After the caller's untimed speculative run: one untimed plain run, then the timed runs alternate (plain
    first, then speculative first, ...); the fastest of each is compared, the per-pair speedups give the spread."""
    from kdtree_engine import cli
    from kdtree_engine.sampling import SamplingParams

    llm = FakeLLM("cpu")
    monkeypatch.setattr(cli, "plain_decode", lambda l, ids, p: l.plain(ids, p))
    params = SamplingParams(max_tokens=8)
    best, stats = cli.compare_with_plain(llm, [4, 5, 6], params, 3)
    assert [c[0] for c in llm.calls] == ["plain", "plain", "spec", "spec", "plain", "plain", "spec"]
    assert all(c[1] == [4, 5, 6] and c[2] == params for c in llm.calls)
    assert best.stats["tokens_per_s"] == 200.0 and stats["baseline_tokens_per_s"] == 100.0
    assert stats["speedup"] == pytest.approx(2.0) and stats["compare_runs"] == 3
    # pairs (spec, plain) in run order: 100/80, 200/100, 150/90
    assert stats["speedup_min"] == pytest.approx(1.25) and stats["speedup_max"] == pytest.approx(2.0)
    assert stats["same_tokens_as_plain"] is True and stats["compare_warmed_up"] is True


def test_compare_of_a_request_without_decode_steps_has_no_speedup(monkeypatch) -> None:
    from kdtree_engine import cli
    from kdtree_engine.sampling import SamplingParams

    llm = FakeLLM("cpu", tokens_per_s=(0.0,) * 3, plain_tokens_per_s=(0.0,) * 3, n_tokens=0)
    monkeypatch.setattr(cli, "plain_decode", lambda l, ids, p: l.plain(ids, p))
    _, stats = cli.compare_with_plain(llm, [1], SamplingParams(max_tokens=0), 3)
    assert stats["speedup"] is None and stats["speedup_min"] is None
    line = cli.format_stats("length", {**stats, "prefill_s": 0.0, "decode_s": 0.0})
    assert "nothing to compare" in line and "speedup 0.00x" not in line


def test_compare_summary_names_runs_and_spread(capsys, model_dir, draft_dir) -> None:
    """--compare: the summary names the timed runs, the warm-up and the spread (JSON: the same fields)."""
    argv = ["generate", "--model", str(model_dir), "--draft", str(draft_dir), "--spec", "ddtree", "--budget", "3",
            "--prompt-ids", "2,7,1,8", "--max-tokens", "6", "--ignore-eos", "--compare"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "fastest of 3 timed runs of each, interleaved, after an untimed warm-up of each" in err
    assert "per-pair speedups" in err and "same tokens as plain: yes" in err
    obj = run_json(capsys, argv + ["--json"])
    s = obj["stats"]
    assert s["compare_warmed_up"] is True and s["same_tokens_as_plain"] is True and s["compare_runs"] == 3
    assert s["speedup_min"] <= s["speedup_max"]
    assert s["speedup"] == pytest.approx(s["tokens_per_s"] / s["baseline_tokens_per_s"])


def test_summary_of_a_comparison() -> None:
    from kdtree_engine.cli import format_stats

    s = {"generated_tokens": 8, "prefill_s": 0.01, "decode_s": 0.02, "tokens_per_s": 350.0, "spec": "none",
         "baseline_tokens_per_s": 175.0, "speedup": 2.0, "speedup_min": 1.5, "speedup_max": 2.25,
         "same_tokens_as_plain": True, "compare_warmed_up": True, "compare_runs": 3}
    line = format_stats("length", s)
    assert ("plain decoding 175.0 tok/s, speedup 2.00x (fastest of 3 timed runs of each, interleaved, after an "
            "untimed warm-up of each; per-pair speedups 1.50-2.25x; one prompt: `kdtree bench spec` measures "
            "several), same tokens as plain: yes") in line


def test_no_circle_between_cli_and_bench_spec() -> None:
    """bench_spec and golden stand without the CLI module (the CLI imports them, not the other way)."""
    code = ("import sys, kdtree_engine.bench_spec, kdtree_engine.golden, kdtree_engine.show_tree; "
            "sys.exit('kdtree_engine.cli' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
