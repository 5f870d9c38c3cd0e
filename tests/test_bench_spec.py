"""``kdtree bench spec`` on a tiny random target + drafter; default prompts come from held-out files only."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from record_checks import check_run_metadata

from kdtree_engine import bench_spec, reference
from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter, save_drafter
from kdtree_engine.train.data import is_heldout, list_sources, stdlib_root
from kdtree_engine.weights import save_checkpoint

CFG = preset("k2-tiny")
DEMO = Path(bench_spec.__file__).parent / "assets" / "demo"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    weights = {k: torch.from_numpy(v) for k, v in reference.random_weights(CFG, 0).items()}
    save_checkpoint(root / "model", CFG, weights, layout="k2")
    dcfg = DraftConfig(hidden_size=CFG.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=CFG.vocab_size - 1,
                       target_layer_ids=(0, 2), num_target_layers=CFG.num_hidden_layers, vocab_size=CFG.vocab_size)
    save_drafter(root / "draft", DFlashDrafter.random(dcfg, seed=1))
    return root / "model", root / "draft"


def _run_tiny(dirs, tmp_path, *args: str) -> Path:
    """bench_spec on the tiny pair over two id prompts on the CPU (one thread, restored after); its output folder."""
    model, draft = dirs
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 7, 11, 13, 17], [3, 1, 4, 1, 5, 9, 2, 6]]))
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        rc = bench_spec.main(["--model", str(model), "--draft", str(draft), "--prompts", str(prompts),
                              "--device", "cpu", "--threads", "1", "--out", str(out), *args])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return out


def test_bench_spec_tiny(dirs, tmp_path, capsys) -> None:
    png = tmp_path / "spec.png"
    out = _run_tiny(dirs, tmp_path, "--budgets", "2,4", "--max-tokens", "16", "--repeats", "2", "--plot", str(png))
    table = capsys.readouterr().out
    assert "ddtree-4" in table.splitlines()[-1]
    assert f"wrote {out / 'spec-cpu.json'}, {out / 'spec-cpu.md'}, {png}" in table.splitlines()
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # matplotlib: the [plot] extra, in the test extra
    report = json.loads((out / "spec-cpu.json").read_text())
    assert (out / "spec-cpu.md").read_text().startswith("# Speculative decoding benchmark (cpu)")
    names = [r["setting"] for r in report["results"]]
    assert names == ["none", "dflash", "dflash-2", "ddtree-2", "ddtree-4"]  # block 4: chain cut below 3 drafts
    cut = report["results"][2]
    assert cut["budget"] == 2 and len(cut["accept_len_hist"]) <= 3 and cut["draft_tokens"] <= 2 * cut["rounds"]
    assert [(v["budget"], v["chain_setting"]) for v in report["tree_vs_chain"]] == [(2, "dflash-2"), (4, "dflash")]
    assert "DDTree against the DFlash chain" in (out / "spec-cpu.md").read_text()
    assert len(report["prompts"]) == 2
    for rec in report["results"]:
        assert rec["lossless"] is True, rec["setting"]
        assert rec["tau"] >= 1.0 and rec["tokens_per_s"] > 0 and rec["speedup"] > 0
        assert len(rec["runs"]) == 2 and all(r["generated_tokens"] == 16 for r in rec["runs"])
        assert sum(rec["accept_len_hist"]) == rec["rounds"]
        # the histogram and tau agree: pooled tau = mean accepted length over all rounds
        mean_len = sum((i + 1) * c for i, c in enumerate(rec["accept_len_hist"])) / rec["rounds"]
        assert mean_len == pytest.approx(rec["tau_micro"])
    assert report["config"]["repeats"] == 2
    assert report["results"][0]["tau"] == 1.0 and report["results"][0]["speedup"] == 1.0
    for key in ("torch", "device", "threads"):
        assert key in report["env"]
    assert "--budgets 2,4" in report["command"] or report["options"]["budgets"] == [2, 4]
    check_run_metadata(report["meta"], report["command"], (out / "spec-cpu.md").read_text())


def test_bench_spec_reports_the_auto_choices(dirs, tmp_path) -> None:
    """--budgets auto: the record carries the budgets chosen per round over all prompts (the runs' own counts
    summed) and their mean, and the markdown says them."""
    out = _run_tiny(dirs, tmp_path, "--budgets", "auto", "--methods", "ddtree", "--max-tokens", "12")
    report = json.loads((out / "spec-cpu.json").read_text())
    auto = next(r for r in report["results"] if r["budget"] == "auto")
    summed: dict[int, int] = {}
    for run in auto["runs"]:
        for b, n in run["budget_chosen"].items():
            summed[int(b)] = summed.get(int(b), 0) + n
    assert {int(b): n for b, n in auto["budget_chosen"].items()} == summed
    assert 0 < sum(summed.values()) <= auto["rounds"]   # a round with no draft left (the request's end) chooses none
    assert auto["budget_mean"] == pytest.approx(sum(b * n for b, n in summed.items()) / sum(summed.values()))
    assert "ddtree-auto: budgets chosen (rounds over all prompts) " in (out / "spec-cpu.md").read_text()
    assert all("budget_chosen" not in r for r in report["results"] if r["budget"] != "auto")


def test_bench_spec_registers_under_bench(dirs) -> None:
    parser = argparse.ArgumentParser(prog="kdtree")
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    bench_spec.add_bench_spec_parser(bench)
    args = parser.parse_args(["bench", "spec", "--budgets", "4,8", "--methods", "none,ddtree"])
    assert args.func is bench_spec.cmd_bench_spec and args.budgets == [4, 8] and args.methods == ["none", "ddtree"]
    assert bench_spec.settings_for(args.methods, args.budgets) == [("none", None), ("ddtree", 4), ("ddtree", 8)]


def test_bad_prompts_file_exits_2(dirs, tmp_path, capsys) -> None:
    model, draft = dirs
    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a list"}')
    assert bench_spec.main(["--model", str(model), "--draft", str(draft), "--prompts", str(bad),
                            "--out", str(tmp_path)]) == 2
    assert "p.json" in capsys.readouterr().err
    text = tmp_path / "p.txt"
    text.write_text("hello\n")
    assert bench_spec.main(["--model", str(model), "--draft", str(draft), "--prompts", str(text),
                            "--out", str(tmp_path)]) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(dirs, tmp_path, capsys, monkeypatch) -> None:
    import builtins
    real_import = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    model, draft = dirs
    assert bench_spec.main(["--model", str(model), "--draft", str(draft), "--plot", str(tmp_path / "x.png"),
                            "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kdtree bench spec: error: --plot needs matplotlib"), err
    assert 'pip install "kdtree-engine[plot]"' in err and 'pip install -e ".[plot]"' in err, err
    assert not (tmp_path / "x.png").exists() and not list(tmp_path.glob("spec-*"))  # refused before the run
    with pytest.raises(RuntimeError, match=re.escape("[plot] extra")):
        bench_spec.plot({}, tmp_path / "y.png")


ROOT = Path(__file__).resolve().parents[1]
# a meta-path finder that refuses matplotlib, as where the [plot] extra is not installed
NO_MATPLOTLIB = ("import importlib.abc, sys\n"
                 "class NoMpl(importlib.abc.MetaPathFinder):\n"
                 "    def find_spec(self, name, path, target=None):\n"
                 "        if name.split('.')[0] == 'matplotlib':\n"
                 "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                 "sys.meta_path.insert(0, NoMpl())\n")


def _kdtree(cwd: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """`kdtree ARGS` in a subprocess from ``cwd``, on this checkout's package."""
    code = prelude + "import sys\nfrom kdtree_engine.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_default_out_is_a_fresh_run_folder(dirs, tmp_path) -> None:
    """`kdtree bench spec` without --out: the records go to ./kdtree-bench/<UTC start time>/, the paths are printed,
    nothing lands under ./bench/results."""
    model, draft = dirs
    (tmp_path / "prompts.json").write_text(json.dumps([[5, 7, 11, 13, 17]]))
    before = datetime.now(timezone.utc).replace(microsecond=0)
    done = _kdtree(tmp_path, "bench", "spec", "--model", str(model), "--draft", str(draft), "--prompts",
                   "prompts.json", "--device", "cpu", "--threads", "1", "--methods", "none,ddtree", "--budgets", "2",
                   "--max-tokens", "4", "--no-warmup")
    after = datetime.now(timezone.utc)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "kdtree-bench").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d{6}Z", run.name), run.name
    started = datetime.strptime(run.name, "%Y-%m-%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    assert before <= started <= after
    assert sorted(p.name for p in run.iterdir()) == ["spec-cpu.json", "spec-cpu.md"]
    rel = Path("kdtree-bench") / run.name
    assert f"wrote {rel / 'spec-cpu.json'}, {rel / 'spec-cpu.md'}" in done.stdout.splitlines(), done.stdout
    assert json.loads((run / "spec-cpu.json").read_text())["results"][0]["setting"] == "none"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kdtree-bench", "prompts.json"]  # no ./bench/results


def test_plot_without_the_extra_names_it(dirs, tmp_path) -> None:
    """`kdtree bench spec --plot` where matplotlib is missing: one error line naming the [plot] extra, exit 2,
    before any run (nothing written)."""
    model, draft = dirs
    done = _kdtree(tmp_path, "bench", "spec", "--model", str(model), "--draft", str(draft), "--device", "cpu",
                   "--plot", "x.png", prelude=NO_MATPLOTLIB)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "error: --plot needs matplotlib" in lines[0], lines
    assert 'pip install "kdtree-engine[plot]"' in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_fresh_run_dir_never_reuses_a_folder(tmp_path) -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    made = [bench_spec.fresh_run_dir(tmp_path / "runs", t) for _ in range(3)]
    assert [p.name for p in made] == ["2026-01-02T030405Z", "2026-01-02T030405Z-2", "2026-01-02T030405Z-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)


def test_text_prompts_file_split_on_dashes(tmp_path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("def a():\n    pass\n---\n\n---   \nclass B:\n    x = 1\n")
    assert bench_spec.read_prompts_file(f) == ["def a():\n    pass", "class B:\n    x = 1"]


def test_accept_hist_from_per_depth() -> None:
    # 5 rounds: accepted drafts 0, 1, 1, 3, 0 -> per_depth [3, 1, 1]
    assert bench_spec.accept_hist(5, [3, 1, 1]) == [2, 2, 0, 1]
    assert bench_spec.accept_hist(4, [0, 0, 0]) == [4]


def test_gpu_tag() -> None:
    assert bench_spec.gpu_tag("NVIDIA H200") == "h200"
    assert bench_spec.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert bench_spec.gpu_tag("NVIDIA GeForce RTX 4090") == "4090"


def test_default_prompts_come_from_heldout_files_only() -> None:
    from kdtree_engine.engine import load_tokenizer

    tok = load_tokenizer(DEMO)
    root = stdlib_root()
    prompts = bench_spec.default_prompts(tok, 6, 48, root=root)
    assert len(prompts) == 6
    sources = set(list_sources(root))
    assert len({p.source for p in prompts}) == 6
    for p in prompts:
        assert p.source in sources and is_heldout(p.source), p.source
        assert len(p.ids) == 48
        text = (root / p.source).read_text(encoding="utf-8")
        at = text.find(p.text)
        assert at >= 0 and (at == 0 or text[at - 1] == "\n"), p.source  # starts at a line boundary


def test_near_copies_flag_sets_the_prompt_rule(monkeypatch, tmp_path, capsys) -> None:
    """--near-copies drop (the default) selects prompts under the near-copy rule, keep without it."""
    from kdtree_engine.train.near_dup import NearDupRule
    seen = []

    def stop(tokenizer, num, tokens, root=None, *, near_dup=NearDupRule(), index=None):
        seen.append(near_dup)
        raise ValueError("prompts chosen")   # ends the run before any generation (exit 2)

    monkeypatch.setattr(bench_spec, "default_prompts", stop)
    for flag in ([], ["--near-copies", "keep"], ["--near-copies", "drop"]):
        assert bench_spec.main(["--device", "cpu", "--out", str(tmp_path), *flag]) == 2
        assert "prompts chosen" in capsys.readouterr().err
    assert seen == [NearDupRule(), None, NearDupRule()]
