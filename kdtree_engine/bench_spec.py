"""``kdtree bench spec``: plain decoding vs DFlash vs DDTree over a range of tree budgets.

For every setting (``none``, ``dflash``, ``ddtree`` at each budget) every prompt is generated once
(``--repeats R``: R passes over all settings, the fastest run kept) after one warm-up generation of that setting, and
the report gives:

* ``tokens_per_s``: decode speed with prefill excluded, sum over prompts of (generated tokens - 1)
  / sum of ``decode_s`` (the first token comes from the prefill); ``tokens_per_s_macro`` is the
  mean of the per-prompt values;
* ``tau``: mean accepted length per round (accepted drafts + the bonus token), macro-averaged over
  prompts (the mean of the per-prompt tau, as the DFlash / DDTree papers report it);
  ``tau_micro`` pools all rounds;
* ``speedup``: ``tokens_per_s`` over plain decoding's (``speedup_macro``: mean of per-prompt ratios);
* stage times (``draft_s``, ``tree_s``, ``verify_s``, ``commit_s`` summed over prompts, and per round);
* ``lossless``: the greedy tokens equal plain decoding's for every prompt (None when sampling:
  sampled tokens are only equal in distribution);
* ``accept_len_hist``: rounds per accepted length, index i = length i + 1.

``dflash`` is the drafter's whole argmax chain (block size - 1 drafts) and, for every budget below
that, the chain cut to the budget (``dflash-8``: 8 drafts, the verify width of ``ddtree-8``): the
report sets each DDTree budget beside the chain of the same width and beside the whole chain.

Plain decoding is always run (it is the reference for speedup and losslessness). Generation ignores
EOS by default so that every prompt produces ``--max-tokens`` tokens (``--stop-at-eos`` to stop).

Default prompts come from held-out standard-library files (the split rule of
:mod:`kdtree_engine.train.data`, never a training file) that are not near-copies of a training file
(:mod:`kdtree_engine.train.near_dup`: at least half of their 8-token shingles in one training file):
files in a fixed order (non-test files first, each group by crc32 of the path), one prompt per file,
starting at the file's first top-level ``def`` / ``class`` line (else the file's start),
``--prompt-tokens`` tokens long. The choice is a function of the stdlib's files alone (no random
draw), so a machine picks the same prompts on every run; another Python version may ship other files.

Output: ``<out>/spec-<device>.json`` and ``.md`` (device ``cpu`` or a short GPU name such as
``h200``), optionally a plot, the paths written and a short table printed last on stdout. Without ``--out`` the
run gets a fresh folder ``./kdtree-bench/<UTC start time>/`` (a run never overwrites an earlier one's records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import re
import shlex
import statistics
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .engine import load_drafter, load_target, load_tokenizer, resolve_device, resolve_dtype
from .errors import BadInput
from .exit_codes import BAD_INPUT_ERRORS, EXIT_BAD_INPUT
from .records import device_name, run_metadata, with_metadata
from .sampling import SamplingParams
from .speculative.decode import generate
from .train.data import is_heldout, is_test_path, list_sources, read_source, split_paths, stdlib_root
from .train.near_dup import Match, NearDupRule, ShingleIndex, is_near_duplicate, train_index

log = logging.getLogger("kdtree_engine.bench_spec")

DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"
DEFAULT_BUDGETS = (4, 8, 16, 32, 64, 128)
DEFAULT_METHODS = ("none", "dflash", "ddtree")
DEFAULT_NUM_PROMPTS = 8
RUNS_DIR = "kdtree-bench"   # the default --out: a fresh folder per run under ./kdtree-bench/
PLOT_INSTALL = 'pip install "kdtree-engine[plot]" (in a checkout: pip install -e ".[plot]")'
WARMUP_TOKENS = 32
_DEF_LINE = re.compile(r"^(?:(?:async\s+)?def\s+\w+\s*\(|class\s+\w+\s*[(:])", re.MULTILINE)
_SEPARATOR = re.compile(r"^---[ \t]*\r?$\n?", re.MULTILINE)


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None
    source: str | None = None  # relpath of the held-out file (default prompts) or the prompts file


# ---- prompts ---------------------------------------------------------------------------------

def default_prompts(tokenizer: Any, num: int, tokens: int, root: str | Path | None = None, *,
                    near_dup: NearDupRule | None = NearDupRule(), index: ShingleIndex | None = None) -> list[Prompt]:
    """``num`` prompts of ``tokens`` tokens from held-out stdlib files (see the module docstring).

    ``near_dup``: the rule that leaves out held-out files copied from a training file (None: keep them);
    ``index``: the training files' shingles when the caller already built them (else built here).
    """
    root = Path(root) if root is not None else stdlib_root()
    train, held = split_paths(list_sources(root))
    assert all(is_heldout(p) for p in held) and not any(is_heldout(p) for p in train)
    order = sorted(held, key=lambda p: (is_test_path(p), zlib.crc32(p.encode("utf-8")), p))
    if near_dup is not None and index is None:
        index = train_index(root, near_dup)
    out: list[Prompt] = []
    left_out: list[tuple[str, Match]] = []
    for rel in order:
        if len(out) >= num:
            break
        text = read_source(root, rel)
        if text is None:
            continue
        if near_dup is not None:
            match = index.closest(text)
            if is_near_duplicate(match, near_dup):
                left_out.append((rel, match))
                continue
        m = _DEF_LINE.search(text)
        body = text[m.start():] if m else text
        # a prefix is enough (~3.5 bytes a token)
        ids = tokenizer.encode(body[: 16 * tokens], special=True, add_special_tokens=True)
        if len(ids) < tokens + 1 and len(body) > 16 * tokens:
            ids = tokenizer.encode(body, special=True, add_special_tokens=True)
        if len(ids) < tokens:
            continue
        ids = ids[:tokens]
        out.append(Prompt(ids=ids, text=tokenizer.decode(ids, skip_special=True), source=rel))
    if near_dup is None:
        log.info("default prompts: held-out files kept even where they near-copy a training file (no check)")
    elif left_out:
        log.info("default prompts: left out %d held-out file(s) that near-copy a training file (containment >= "
                 "%.2f of %d-token shingles): %s", len(left_out), near_dup.max_containment, near_dup.shingle_tokens,
                 ", ".join(f"{r} ({m.containment:.2f} in {m.train_path})" for r, m in left_out))
    if not out:
        raise ValueError(f"no held-out file under {root} gives a prompt of {tokens} tokens")
    if len(out) < num:
        log.warning("only %d held-out files give a prompt of %d tokens (asked for %d)", len(out), tokens, num)
    return out


def read_prompts_file(path: str | Path) -> list[str | list[int]]:
    """A JSON list (strings, or lists of token ids) or text with prompts separated by ``---`` lines."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json" or raw.lstrip().startswith("["):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {path}: not valid JSON ({e})") from None
        ok = isinstance(items, list) and all(
            isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(t, int) for t in x)) for x in items)
        if not ok:
            raise ValueError(f"--prompts {path}: expected a JSON list of strings or of token id lists")
        prompts = [x for x in items if not (isinstance(x, str) and not x.strip())]
    else:
        prompts = []
        for chunk in _SEPARATOR.split(raw):
            if chunk.endswith("\n"):
                chunk = chunk[:-1]
            if chunk.strip():
                prompts.append(chunk)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt found")
    return prompts


def encode_prompts(items: Sequence[str | list[int]], tokenizer: Any, source: str) -> list[Prompt]:
    out = []
    for x in items:
        if isinstance(x, str):
            if tokenizer is None:
                raise ValueError(f"--prompts {source} holds text but the model has no tokenizer.json "
                                 "(give token id lists instead)")
            ids = tokenizer.encode(x, special=True, add_special_tokens=True)
            out.append(Prompt(ids=ids, text=x, source=source))
        else:
            out.append(Prompt(ids=[int(t) for t in x], text=None, source=source))
    return out


# ---- environment ----------------------------------------------------------------------------

def device_tag(device: Any) -> str:
    """``cpu``, or a short lowercase GPU name: "NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" -> "a100"."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    return gpu_tag(torch.cuda.get_device_name(dev))


def gpu_tag(name: str) -> str:
    words = [w for w in re.split(r"[\s_]+", name.lower()) if w and w not in
             {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}]
    pick = next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "gpu")
    pick = pick.split("-")[0] or pick
    return re.sub(r"[^a-z0-9]+", "", pick) or "gpu"


def environment(device: Any, dtype: Any) -> dict[str, Any]:
    dev = torch.device(device)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(dev),
           "device_name": device_name(dev),
           "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if hasattr(os, "getloadavg"):
        env["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return env


# ---- the benchmark ---------------------------------------------------------------------------

def settings_for(methods: Sequence[str], budgets: Sequence[int | str],
                 block_size: int | None = None) -> list[tuple[str, int | str | None]]:
    """(method, budget) per setting; with ``block_size``, dflash also runs cut to every budget below
    its whole chain (block_size - 1 drafts)."""
    out: list[tuple[str, int | str | None]] = [("none", None)]  # always: the reference
    if "dflash" in methods:
        out.append(("dflash", None))
        if block_size is not None:
            out.extend(("dflash", b) for b in budgets if isinstance(b, int) and b < block_size - 1)
    if "ddtree" in methods:
        out.extend(("ddtree", b) for b in budgets)
    return out


def setting_name(method: str, budget: int | str | None) -> str:
    return method if budget is None else f"{method}-{budget}"


def accept_hist(rounds: int, per_depth: Sequence[int]) -> list[int]:
    """Rounds per accepted length (index i = length i + 1, bonus included) from ``accepted_per_depth``.

    ``per_depth[d]`` counts rounds that accepted at least d + 1 drafts, so rounds with exactly k
    drafts accepted = c[k] - c[k + 1] with c[0] = rounds.
    """
    c = [rounds] + list(per_depth) + [0]
    hist = [c[k] - c[k + 1] for k in range(len(c) - 1)]
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    return hist


def run_bench(target: Any, drafter: Any, prompts: Sequence[Prompt], settings: Sequence[tuple[str, int | None]],
              params: Any, *, warmup: bool = True, repeats: int = 1,
              progress: Callable[[str], None] | None = None, eager: bool | None = None) -> list[dict[str, Any]]:
    """Generate every prompt under every setting; per-setting records (see the module docstring).

    With ``repeats`` > 1 the whole sweep (every setting, every prompt) runs that many times, one pass
    after another, and per setting and prompt the run with the shortest decode time is kept: the
    passes differ only by interference from the rest of the machine, and spreading them over time
    keeps a burst of load from landing on one setting only. Warm-ups (one per setting) run first.
    """
    say = progress or (lambda s: None)
    greedy = params.temperature == 0
    if warmup:
        wp = dataclasses.replace(params, max_tokens=min(params.max_tokens, WARMUP_TOKENS))
        for method, budget in settings:
            generate(target, prompts[0].ids, wp, spec=method, drafter=drafter if method != "none" else None,
                     budget=budget, eager=eager)
    best: list[list[Any]] = [[None] * len(prompts) for _ in settings]
    for rep in range(max(repeats, 1)):
        for k, (method, budget) in enumerate(settings):
            name = setting_name(method, budget)
            d = drafter if method != "none" else None
            for i, p in enumerate(prompts):
                res = generate(target, p.ids, params, spec=method, drafter=d, budget=budget, eager=eager)
                s = res.stats
                say(f"{name:>10} prompt {i}" + (f" pass {rep + 1}" if repeats > 1 else "")
                    + f": {s['generated_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f}")
                prev = best[k][i]
                if prev is not None and greedy and prev.token_ids != res.token_ids:
                    raise RuntimeError(f"{name}: prompt {i} gave different greedy tokens on repeated runs")
                if prev is None or s["decode_s"] < prev.stats["decode_s"]:
                    best[k][i] = res
    out = []
    plain = [r.token_ids for r in best[0]]
    for (method, budget), results in zip(settings, best):
        runs = []
        for i, res in enumerate(results):
            s = res.stats
            runs.append({
                "prompt": i, "generated_tokens": s["generated_tokens"], "finish_reason": res.finish_reason,
                "prefill_s": s["prefill_s"], "decode_s": s["decode_s"], "tokens_per_s": s["tokens_per_s"],
                "rounds": s["rounds"], "tau": s["tau"], "draft_tokens": s["draft_tokens"],
                "accepted_tokens": s["accepted_tokens"], "accepted_per_depth": s["accepted_per_depth"],
                "draft_s": s["draft_s"], "tree_s": s["tree_s"], "verify_s": s["verify_s"], "commit_s": s["commit_s"],
                "token_ids": res.token_ids, "same_as_plain": res.token_ids == plain[i],
                "budget_chosen": s.get("budget_chosen"),
            })
        out.append(summarize(method, budget, runs, greedy))
    base = out[0]
    for rec in out:
        rec["speedup"] = rec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else None
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rec["runs"], base["runs"])
                  if b["tokens_per_s"] > 0]
        rec["speedup_macro"] = statistics.fmean(ratios) if ratios else None
    return out


def summarize(method: str, budget: int | None, runs: list[dict[str, Any]], greedy: bool) -> dict[str, Any]:
    steps = sum(max(r["generated_tokens"] - 1, 0) for r in runs)
    decode = sum(r["decode_s"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    stages = {k: sum(r[k] for r in runs) for k in ("draft_s", "tree_s", "verify_s", "commit_s")}
    per_depth = [sum(col) for col in zip(*[r["accepted_per_depth"] for r in runs])] if runs else []
    drafted = sum(r["draft_tokens"] for r in runs)
    same = all(r["same_as_plain"] for r in runs)
    chosen: Counter[int] = Counter()   # --budget auto: rounds per chosen budget, over all prompts
    for r in runs:
        chosen.update({int(b): n for b, n in (r.get("budget_chosen") or {}).items()})
    auto = ({"budget_chosen": dict(sorted(chosen.items())),
             "budget_mean": sum(b * n for b, n in chosen.items()) / sum(chosen.values())} if chosen else {})
    return {
        "setting": setting_name(method, budget), "method": method, "budget": budget,
        "prompts": len(runs), "generated_tokens": sum(r["generated_tokens"] for r in runs),
        "decode_s": decode, "prefill_s": sum(r["prefill_s"] for r in runs),
        "tokens_per_s": steps / decode if decode > 0 else 0.0,
        "tokens_per_s_macro": statistics.fmean(r["tokens_per_s"] for r in runs),
        "tau": statistics.fmean(r["tau"] for r in runs),
        "tau_micro": sum(r["tau"] * r["rounds"] for r in runs) / rounds if rounds else 0.0,
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": sum(r["accepted_tokens"] for r in runs),
        "acceptance_rate": sum(r["accepted_tokens"] for r in runs) / drafted if drafted else None,
        "accept_len_hist": accept_hist(rounds, per_depth),
        **stages,
        "other_s": decode - sum(stages.values()),
        "ms_per_round": {k[:-2]: 1e3 * v / rounds if rounds else 0.0 for k, v in stages.items()},
        "same_as_plain": same,
        "lossless": same if greedy else None,
        **auto,
        "runs": runs,
    }


# ---- reports ---------------------------------------------------------------------------------

def best_ddtree(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    trees = [r for r in records if r["method"] == "ddtree"]
    return max(trees, key=lambda r: r["tokens_per_s"]) if trees else None


def whole_chain(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The dflash record with the drafter's whole chain."""
    return next((r for r in records if r["method"] == "dflash" and r["budget"] is None), None)


def tree_vs_chain(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per DDTree budget: its tau beside the chain of the same width (``dflash-b``, or the whole chain
    when b reaches it) and beside the whole chain."""
    whole = whole_chain(records)
    cut = {r["budget"]: r for r in records if r["method"] == "dflash" and r["budget"] is not None}
    rows = []
    for r in records:
        if r["method"] != "ddtree" or not isinstance(r["budget"], int) or whole is None:
            continue
        same = cut.get(r["budget"], whole)
        rows.append({"budget": r["budget"], "tau": r["tau"], "chain_setting": same["setting"],
                     "chain_tau": same["tau"], "ahead_of_same_width": r["tau"] > same["tau"],
                     "whole_chain_tau": whole["tau"], "ahead_of_whole_chain": r["tau"] > whole["tau"]})
    return rows


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return f"{x:.{nd}f}"


def short_table(records: Sequence[dict[str, Any]]) -> str:
    rows = [("setting", "tok/s", "speedup", "tau", "lossless")]
    for r in records:
        rows.append((r["setting"], _f(r["tokens_per_s"], 1), _f(r["speedup"]) + "x", _f(r["tau"]),
                     {True: "true", False: "FALSE", None: "n/a"}[r["lossless"]]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    env, recs, cfg = report["env"], report["results"], report["config"]
    L = [f"# Speculative decoding benchmark ({report['device_tag']})", "",
         f"Command: `{report['command']}`", "",
         f"torch {env['torch']}, Python {env['python']}, device {env['device']} ({env['device_name']}), "
         f"dtype {env['dtype']}, {env['threads']} thread(s) of {env['cpus']} CPUs"
         + (f", load average at start {env['loadavg_start']}" if "loadavg_start" in env else "")
         + (f", at end {env['loadavg_end']}" if "loadavg_end" in env else "") + ".", "",
         f"Model `{cfg['model']}`, drafter `{cfg['draft']}` (block size {cfg['block_size']}); "
         f"{len(report['prompts'])} prompts ({cfg['prompt_source']}), max tokens {cfg['max_tokens']}, "
         f"temperature {cfg['temperature']}, EOS {'stops' if cfg['stop_at_eos'] else 'ignored'}; "
         "one warm-up generation per setting"
         + (f", fastest of {cfg['repeats']} runs per prompt" if cfg.get("repeats", 1) > 1 else "") + ".", "",
         "tok/s: decode only (tokens after the first / decode time, prefill excluded), pooled over prompts; "
         "macro: mean of per-prompt values. tau: mean accepted length per round incl. the bonus token, "
         "mean over prompts. Speedup: tok/s over plain decoding. Stage times: ms per round. "
         "Lossless: greedy tokens identical to plain decoding for every prompt.", "",
         "| setting | tok/s | tok/s (macro) | speedup | speedup (macro) | tau | rounds | draft ms | tree ms "
         "| verify ms | commit ms | lossless |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in recs:
        m = r["ms_per_round"]
        L.append(f"| {r['setting']} | {_f(r['tokens_per_s'], 1)} | {_f(r['tokens_per_s_macro'], 1)} | "
                 f"{_f(r['speedup'])} | {_f(r['speedup_macro'])} | {_f(r['tau'])} | {r['rounds']} | "
                 f"{_f(m['draft'], 1)} | {_f(m['tree'], 1)} | {_f(m['verify'], 1)} | {_f(m['commit'], 1)} | "
                 f"{ {True: 'true', False: 'FALSE', None: 'n/a (sampling)'}[r['lossless']] } |")
    best = best_ddtree(recs)
    if best is not None:
        L += ["", f"Accepted length per round, best DDTree budget ({best['setting']}, rounds per length 1, 2, ...): "
              f"{best['accept_len_hist']}"]
        dfl = whole_chain(recs)
        if dfl is not None:
            L.append(f"DFlash: {dfl['accept_len_hist']}")
    for r in recs:
        if "budget_chosen" in r:
            L += ["", f"{r['setting']}: budgets chosen (rounds over all prompts) {r['budget_chosen']}, mean "
                  f"{_f(r['budget_mean'], 1)}."]
    vs = tree_vs_chain(recs)
    if vs:
        L += ["", "DDTree against the DFlash chain (tau): the chain of the same width (the budget's first argmax "
              "drafts) and the whole chain.", "",
              "| budget | DDTree tau | chain, same width | chain tau | DDTree ahead | whole chain tau | DDTree ahead |",
              "|---:|---:|---|---:|---|---:|---|"]
        for v in vs:
            L.append(f"| {v['budget']} | {_f(v['tau'])} | {v['chain_setting']} | {_f(v['chain_tau'])} | "
                     f"{_f(v['ahead_of_same_width'])} | {_f(v['whole_chain_tau'])} | {_f(v['ahead_of_whole_chain'])} |")
    L += ["", "Prompts:", ""]
    for i, p in enumerate(report["prompts"]):
        first = (p["text"] or "").strip().splitlines()[0][:70] if p.get("text") else f"{len(p['ids'])} ids"
        L.append(f"{i}. `{p['source']}`: {len(p['ids'])} tokens, `{first}`")
    return "\n".join(L) + "\n"


def plot(report: dict[str, Any], path: str | Path) -> None:
    """tau and speedup against budget (DFlash as a horizontal line) + accepted-length histogram."""
    try:  # optional, --plot only: not a dependency of the package
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(f"--plot needs matplotlib, the [plot] extra: {PLOT_INSTALL}") from None
    recs = report["results"]
    trees = [r for r in recs if r["method"] == "ddtree" and r["budget"] != "auto"]
    chains = [r for r in recs if r["method"] == "dflash" and r["budget"] is not None]
    auto = next((r for r in recs if r["method"] == "ddtree" and r["budget"] == "auto"), None)
    dfl = whole_chain(recs)
    best = best_ddtree(recs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in ((axes[0], "tau", "tau (mean accepted length per round)"),
                           (axes[1], "speedup", "speedup over plain decoding (tok/s)")):
        if trees:
            ax.plot([r["budget"] for r in trees], [r[key] for r in trees], "o-", label="DDTree")
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["budget"] for r in trees], [str(r["budget"]) for r in trees])
        if chains:
            ax.plot([r["budget"] for r in chains], [r[key] for r in chains], "s:", color="C1",
                    label="DFlash chain cut to the budget")
        if dfl is not None:
            ax.axhline(dfl[key], color="C1", linestyle="--", label=f"DFlash whole chain ({dfl[key]:.2f})")
        if auto is not None:
            ax.axhline(auto[key], color="C2", linestyle="-.", label=f"DDTree auto ({auto[key]:.2f})")
        if key == "speedup":
            ax.axhline(1.0, color="gray", linestyle=":", label="plain")
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    if best is not None:
        h = best["accept_len_hist"]
        ax.bar(range(1, len(h) + 1), h, alpha=0.7, label=f"DDTree {best['budget']}")
    if dfl is not None:
        h = dfl["accept_len_hist"]
        ax.step(range(1, len(h) + 1), h, where="mid", color="C1", label="DFlash")
    ax.set_xlabel("accepted length per round (incl. bonus)")
    ax.set_ylabel("rounds")
    ax.legend()
    fig.suptitle(f"{report['device_tag']}: {len(report['prompts'])} prompts, {report['config']['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ----------------------------------------------------------------------------

def _budget_list(text: str) -> list[int | str]:
    """Comma-separated positive budgets; ``auto`` allowed among them."""
    parts = [x for x in text.replace(" ", "").split(",") if x]
    ints = _int_list(",".join(x for x in parts if x != "auto")) if any(x != "auto" for x in parts) else []
    return ints + (["auto"] if "auto" in parts else [])


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _methods(text: str) -> list[str]:
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [v for v in vals if v not in DEFAULT_METHODS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"methods must be among {','.join(DEFAULT_METHODS)}, got {text!r}")
    return vals


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default=None, help="target checkpoint directory (default: the embedded demo)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (default: MODEL/draft)")
    p.add_argument("--prompts", default=None,
                   help="JSON list of strings (or token id lists), or a text file with prompts separated by "
                        "'---' lines (default: prompts cut from held-out stdlib files)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts to run (default {DEFAULT_NUM_PROMPTS}; all of a --prompts file)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="length of the default prompts")
    p.add_argument("--near-copies", choices=["drop", "keep"], default="drop",
                   help="default prompts: leave out held-out files that near-copy a training file (drop, the default)"
                        " or keep them (the selection of records made before the rule, for comparisons)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budgets", type=_budget_list, default=list(DEFAULT_BUDGETS),
                   help="DDTree budgets, e.g. 4,8,16,auto ('auto': chosen per round from the measured cost)")
    p.add_argument("--methods", type=_methods, default=list(DEFAULT_METHODS),
                   help="none,dflash,ddtree (plain decoding always runs: it is the reference)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: ignore it)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each setting")
    p.add_argument("--eager", action="store_true",
                   help="host-driven rounds with stage timers (default on CUDA: greedy rounds with a fixed budget "
                        "replay a CUDA graph, and their stage times read 0 with the whole round under verify)")
    p.add_argument("--repeats", type=int, default=1,
                   help="generate each prompt this many times per setting and keep the fastest run")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"directory for spec-<device>.json and .md (default: a fresh ./{RUNS_DIR}/<UTC time>/)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot tau / speedup vs budget (matplotlib: the [plot] extra)")
    p.set_defaults(func=cmd_bench_spec)
    return p


def add_bench_spec_parser(bench_sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``spec`` under the ``kdtree bench`` subparsers."""
    p = bench_sub.add_parser("spec", help="benchmark plain / DFlash / DDTree decoding over tree budgets",
                             description=__doc__.split("\n\n")[0])
    return configure_parser(p)


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies under it (reports stay machine-neutral)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def fresh_run_dir(root: str | Path, started: datetime) -> Path:
    """A new folder under ``root`` named by the UTC time ``started`` (``-2``, ``-3``... when the name is taken),
    created here so that two runs never share one."""
    name = started.astimezone(timezone.utc).strftime("%Y-%m-%dT%H%M%SZ")
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = Path(root) / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{root}: no free run folder named {name}-N")


def _command_line() -> str:
    argv = list(sys.argv)
    name = Path(argv[0]).name if argv else ""
    if name == "kdtree":
        return shlex.join(["kdtree"] + argv[1:])
    if name == "bench_spec.py" or name.endswith("bench_spec"):
        return shlex.join(["python", "-m", "kdtree_engine.bench_spec"] + argv[1:])
    return shlex.join(argv)


def cmd_bench_spec(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (optional, --plot only: not a dependency of the package)
        except ImportError:
            raise BadInput(f"--plot needs matplotlib, which is not installed: the [plot] extra, "
                           f"{PLOT_INSTALL}") from None
    for flag, v in (("--max-tokens", args.max_tokens), ("--prompt-tokens", args.prompt_tokens),
                    ("--num-prompts", args.num_prompts), ("--threads", args.threads),
                    ("--repeats", args.repeats)):
        if v is not None and v < 1:
            raise BadInput(f"{flag} must be a positive integer, got {v}")
    started = datetime.now(timezone.utc)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else DEMO_DIR
    draft = Path(args.draft) if args.draft else model / "draft"
    if not model.is_dir():
        raise BadInput(f"--model {str(model)!r} is not a directory")
    needs_draft = any(m != "none" for m in args.methods)
    if needs_draft and not draft.is_dir():
        raise BadInput(f"drafter directory {str(draft)!r} does not exist (--draft DIR)")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target = load_target(model, device=device, dtype=dtype, progress=False)
    drafter = load_drafter(draft, target) if needs_draft else None
    tokenizer = load_tokenizer(model)
    if args.prompts:
        try:
            prompts = encode_prompts(read_prompts_file(args.prompts), tokenizer, Path(args.prompts).name)
        except (OSError, ValueError) as e:
            raise BadInput(str(e)) from None
        if args.num_prompts:
            prompts = prompts[:args.num_prompts]
        source = f"from {args.prompts}"
    else:
        if tokenizer is None:
            raise BadInput(f"{model} has no tokenizer.json: the default prompts need one; pass --prompts")
        try:
            prompts = default_prompts(tokenizer, args.num_prompts or DEFAULT_NUM_PROMPTS, args.prompt_tokens,
                                      near_dup=NearDupRule() if args.near_copies == "drop" else None)
        except ValueError as e:
            raise BadInput(str(e)) from None
        which = "that near-copy no training file" if args.near_copies == "drop" else "near-copies of training files kept"
        source = f"held-out stdlib files {which}, {args.prompt_tokens} tokens from the first top-level def/class line"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=not args.stop_at_eos)
    env = environment(device, dtype)
    settings = settings_for(args.methods, args.budgets, getattr(drafter, "block_size", None))
    log.info("bench spec: %d prompts x %d settings on %s (%s, %d threads)", len(prompts), len(settings), device,
             env["dtype"], env["threads"])
    t0 = time.perf_counter()
    records = run_bench(target, drafter, prompts, settings, params, warmup=not args.no_warmup,
                        repeats=args.repeats, progress=lambda s: log.info("%s", s),
                        eager=True if args.eager else None)
    if "loadavg_start" in env:
        env["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    tag = device_tag(device)
    meta = run_metadata(_command_line(), device)
    report = {
        "meta": meta,
        "command": meta["command"],
        "options": {k: v for k, v in vars(args).items() if k != "func"},
        "device_tag": tag, "env": env, "wall_s": time.perf_counter() - t0,
        "config": {"model": _shown(model), "draft": _shown(draft) if needs_draft else None,
                   "block_size": getattr(drafter, "block_size", None), "max_tokens": args.max_tokens,
                   "temperature": args.temperature, "seed": args.seed, "stop_at_eos": args.stop_at_eos,
                   "eager": bool(args.eager),
                   "prompt_source": source, "warmup": not args.no_warmup, "repeats": args.repeats},
        "prompts": [{"source": p.source, "ids": p.ids, "text": p.text} for p in prompts],
        "results": records,
        "tree_vs_chain": tree_vs_chain(records),
    }
    if args.out is None:
        out = fresh_run_dir(RUNS_DIR, started)
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    written = [out / f"spec-{tag}.json", out / f"spec-{tag}.md"]
    written[0].write_text(json.dumps(report, indent=1))
    written[1].write_text(with_metadata(markdown(report), meta))
    if args.plot:
        plot(report, args.plot)
        written.append(Path(args.plot))
    print("wrote " + ", ".join(_shown(w) for w in written))
    print(short_table(records))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kdtree_engine.bench_spec", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return configure_parser(p)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except BAD_INPUT_ERRORS as e:
        print(f"kdtree bench spec: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
