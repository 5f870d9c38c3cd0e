"""What a new user meets first: the demo's comparison and threads, one-line errors with exit 2 instead of
tracebacks, the context-limit warning, the API reaching the demo, and the output's hygiene.

The CLI runs as a subprocess where the exit code and stderr are the contract (a fresh process: its once-per-run
logs and thread setting are its own).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.cli import as_flags
from kdtree_engine.config import preset
from kdtree_engine.engine import DEMO_BUDGET, LLM, PARAMS_PER_THREAD, resolve_threads
from kdtree_engine.errors import BadInput, SpecError
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.config import MAX_BUDGET, SpecConfig
from kdtree_engine.weights import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def quicksort(items):"
CFG = preset("k2-tiny")
CONTEXT = 16


def kdtree(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kdtree_engine.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    """stderr without the loading progress bar (carriage-return updates of one line)."""
    return [line for line in stderr.splitlines() if line.strip() and "loading weights" not in line]


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    errors = [line for line in lines if line.startswith("kdtree: error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    cfg = CFG.replace(max_position_embeddings=CONTEXT)
    d = tmp_path_factory.mktemp("short") / "m"
    weights = {k: torch.from_numpy(v) for k, v in reference.random_weights(cfg, 0).items()}
    save_checkpoint(d, cfg, weights)
    return d


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ---- 1. threads by the model's size, and the comparison -----------------------------------------------------

def test_threads_follow_the_model_size() -> None:
    cpu = torch.device("cpu")
    assert resolve_threads(None, 10**7, cpu) is None  # torch's setting left alone
    n, why = resolve_threads("auto", 10_000_000, cpu)
    assert n == 1 and "10.0M parameters" in why
    n, _ = resolve_threads("auto", 1000 * PARAMS_PER_THREAD, cpu)
    assert n == len(os.sched_getaffinity(0))  # as many as the CPUs, no more
    assert resolve_threads("auto", 1000 * PARAMS_PER_THREAD, torch.device("cuda")) is None
    assert resolve_threads(3, 10, cpu) == (3, "asked for")
    with pytest.raises(BadInput, match="threads=0"):
        resolve_threads(0, 10, cpu)


def test_demo_says_which_threads_and_the_comparison_it_measured() -> None:
    r = kdtree("generate", PROMPT, "--max-tokens", "8", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "torch threads 1 (automatic:" in r.stderr
    assert "fastest of 3 timed runs of each, interleaved, after an untimed warm-up of each" in r.stderr
    assert "per-pair speedups" in r.stderr and "same tokens as plain: yes" in r.stderr
    assert r.stdout.startswith(PROMPT)


def test_threads_flag_sets_them_and_rejects_zero() -> None:
    r = kdtree("generate", PROMPT, "--max-tokens", "2", "--no-compare", "--threads", "2")
    assert r.returncode == 0 and "torch threads 2 (asked for)" in r.stderr, r.stderr
    assert_one_line_error(kdtree("generate", PROMPT, "--threads", "0"), "--threads", "--help")


# ---- 4. bounded budget, a device that is not there ---------------------------------------------------------------

def test_budget_bound_lives_in_spec_config() -> None:
    assert SpecConfig("ddtree", MAX_BUDGET).resolve(16, 4096).budget == MAX_BUDGET
    with pytest.raises(SpecError, match=f"budget={MAX_BUDGET + 1} .*{MAX_BUDGET} nodes"):
        SpecConfig("ddtree", MAX_BUDGET + 1).resolve(16, 4096)


def test_huge_budget_is_one_line_exit_2() -> None:
    r = kdtree("generate", PROMPT, "--budget", "100000", timeout=120)
    assert_one_line_error(r, "--budget 100000", str(MAX_BUDGET))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_exit_2() -> None:
    assert_one_line_error(kdtree("generate", PROMPT, "--device", "cuda"), "--device cuda", "no CUDA device")
    with pytest.raises(BadInput, match="device='cuda'"):
        LLM(device="cuda")


# ---- 5. the context limit, zero tokens ---------------------------------------------------------------------------

def test_max_tokens_past_the_context_warns_and_ends_by_length(short_context_model) -> None:
    r = kdtree("generate", "--model", str(short_context_model), "--prompt-ids", "1,2,3", "--max-tokens", "100000",
               "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["finish_reason"] == "length" and len(obj["token_ids"]) == CONTEXT - 3
    warning = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1 and f"max_tokens=100000 is cut to {CONTEXT - 3}" in warning[0], r.stderr


def test_zero_tokens_compare_says_nothing_to_compare() -> None:
    r = kdtree("generate", PROMPT, "--max-tokens", "0")
    assert r.returncode == 0, r.stderr
    assert "nothing to compare" in r.stderr and "speedup 0.00x" not in r.stderr
    r = kdtree("generate", PROMPT, "--max-tokens", "0", "--json")
    stats = json.loads(r.stdout)["stats"]
    assert stats["generated_tokens"] == 0 and stats["speedup"] is None


# ---- 8. the API reaches the demo; its errors name arguments ------------------------------------------------------

@pytest.mark.parametrize("model", [None, "demo"])
def test_api_default_is_the_demo_with_its_drafter(model, keep_threads) -> None:
    llm = LLM() if model is None else LLM(model, progress=False)
    assert llm.drafter is not None and llm.spec == SpecConfig("ddtree", DEMO_BUDGET)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.stats["spec"] == "ddtree" and out.stats["budget"] == DEMO_BUDGET
    # the text is the generated ids' decoding only: the prompt is not in it
    assert out.text == llm.decode(out.token_ids) and not out.text.startswith(PROMPT)
    plain = LLM(model, spec="none", progress=False).generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    assert plain[0].token_ids == out.token_ids


def test_api_errors_name_arguments_and_the_cli_shows_flags(short_context_model) -> None:
    with pytest.raises(SpecError) as e:
        LLM(short_context_model, spec="ddtree")
    assert "spec=ddtree" in str(e.value) and "draft=DIR" in str(e.value) and "--" not in str(e.value)
    line = assert_one_line_error(kdtree("generate", "--model", str(short_context_model), "--prompt-ids", "1",
                                        "--spec", "ddtree"))
    assert line == f"kdtree: error: {as_flags(str(e.value))}"
    assert "--spec ddtree needs a drafter: pass --draft DIR" in line


def test_argument_names_become_flags() -> None:
    assert as_flags("budget=auto applies to spec=ddtree only") == "--budget auto applies to --spec ddtree only"
    assert as_flags("device='cuda' was asked for (device='cpu' runs)") == "--device cuda was asked for (--device cpu runs)"
    assert as_flags("budget=300 is above 256") == "--budget 300 is above 256"
    assert as_flags("sampling field 'max_tokens'") == "sampling field 'max_tokens'"


# ---- 9. output hygiene ---------------------------------------------------------------------------------------

def test_a_plain_run_logs_one_line_for_the_load_and_prints_one_for_the_result() -> None:
    r = kdtree("generate", PROMPT, "--max-tokens", "4", "--ignore-eos", "--no-compare")
    assert r.returncode == 0, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("INFO kdtree_engine: loaded the embedded demo")
    assert lines[1].startswith("[4 tokens, finish length")
    assert "cuda" not in r.stderr.lower()


def test_verbose_shows_the_automatic_choices() -> None:
    r = kdtree("-v", "generate", PROMPT, "--max-tokens", "4", "--no-compare")
    assert r.returncode == 0, r.stderr
    debug = [line for line in r.stderr.splitlines() if line.startswith("DEBUG kdtree_engine")]
    assert any("kernels on cpu" in line for line in debug) and any("device: cpu" in line for line in debug)


def test_log_once_is_debug(caplog) -> None:
    from kdtree_engine.logs import log_once

    with caplog.at_level(logging.DEBUG, logger="kdtree_engine"):
        log_once("test:first-hour:debug", "an automatic choice")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.DEBUG, "an automatic choice")]


@pytest.mark.parametrize("argv,needle", [
    (["generate", PROMPT, "--dtype", "float8"], "--dtype"),
    (["generate", PROMPT, "--no-such-flag"], "--no-such-flag"),
    (["bench", "spec", "--budgets"], "--budgets"),
    ([], "command"),
])
def test_argparse_errors_are_one_line_pointing_to_help(argv, needle) -> None:
    r = kdtree(*argv)
    line = assert_one_line_error(r, needle, "--help` lists the arguments")
    assert "usage:" not in r.stderr and line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["kernels", "mla-attention", "gemm"])
def test_gpu_benches_on_a_cpu_exit_2_in_one_line(bench) -> None:
    assert_one_line_error(kdtree("bench", bench), f"kdtree bench {bench}", "needs a CUDA device")


def test_golden_errors_share_the_prefix(tmp_path) -> None:
    assert_one_line_error(kdtree("golden", "check", str(tmp_path / "missing.safetensors")), "missing.safetensors")
