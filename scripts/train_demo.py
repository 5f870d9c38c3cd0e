#!/usr/bin/env python
"""Train the embedded demo model from scratch in one process: tokenizer, K2-family target, DFlash drafter.

    python scripts/train_demo.py --out out/demo                       # one H200, about 9 minutes
    python scripts/train_demo.py --out /tmp/demo --tiny --device cpu  # smoke run, under a minute

Writes into --out:
    config.json, model.safetensors, tokenizer.json   the target (routed experts INT4 group 32, rest bf16)
    draft/config.json, draft/model.safetensors        the DFlash drafter (bf16)
    dense/                                            the same target with dense bf16 experts (HF check; not shipped)
    train_log.txt, train_metrics.json, loss_curve.png
See docs/demo_model.md for the data rule, the sizes and the settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdtree_engine.train import data as D  # noqa: E402
from kdtree_engine.train import draft_train as DT  # noqa: E402
from kdtree_engine.train import export as X  # noqa: E402
from kdtree_engine.train import target_train as TT  # noqa: E402

SIZE_LIMIT = 16_000_000


class Logger:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "w")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--target-minutes", type=float, default=4.5)
    p.add_argument("--target-max-epochs", type=float, default=16.0,
                   help="stop the target after this many passes over the train split (0: time box only)")
    p.add_argument("--draft-minutes", type=float, default=7.0,
                   help="continuation pool + drafter training (shortened to keep --max-total-minutes)")
    p.add_argument("--max-total-minutes", type=float, default=9.25,
                   help="wall-clock cap of the whole run; the drafter phase is shortened to keep it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--tiny", action="store_true", help="tiny dims, few steps, corpus subset (CPU smoke run)")
    p.add_argument("--target-steps", type=int, default=None, help="fixed step count instead of the time box")
    p.add_argument("--draft-steps", type=int, default=None, help="fixed step count instead of the time box")
    p.add_argument("--vocab-size", type=int, default=None, help="default 4096 (tiny: 512)")
    p.add_argument("--batch", type=int, default=None, help="target batch (sequences)")
    p.add_argument("--seq-len", type=int, default=None, help="target sequence length")
    p.add_argument("--no-tests", action="store_true", help="leave the stdlib test directories out of the corpus")
    p.add_argument("--compile", action="store_true", help="torch.compile the target training step")
    p.add_argument("--expert-impl", default="auto", choices=["auto", "grouped", "loop"])
    p.add_argument("--skip-engine-check", action="store_true")
    return p.parse_args(argv)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


def main(argv=None) -> dict:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Logger(out / "train_log.txt")
    t_start = time.perf_counter()
    deadline = t_start + args.max_total_minutes * 60
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed_all(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tiny = args.tiny
    phases: dict[str, float] = {}
    metrics: dict = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "env": {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "cpus": os.cpu_count()},
        "seed": args.seed, "tiny": tiny, "phases_s": phases,
    }
    log(f"demo training: device {device}, python {platform.python_version()}, torch {torch.__version__}, "
        f"tiny={tiny}")

    # ---- 1. data + tokenizer -----------------------------------------------------------------
    t = time.perf_counter()
    corpus = D.load_corpus(include_tests=not args.no_tests,
                           max_train_bytes=400_000 if tiny else None,
                           max_heldout_bytes=120_000 if tiny else None)
    cs = corpus.stats()
    log(f"corpus {cs['root']}: train {cs['train_files']} files {cs['train_bytes'] / 1e6:.1f} MB, held-out "
        f"{cs['heldout_files']} files {cs['heldout_bytes'] / 1e6:.2f} MB, {cs['skipped_not_utf8']} non-UTF-8 skipped "
        f"(rule: crc32(relpath) % {D.HELDOUT_MODULUS} == 0)")
    vocab = args.vocab_size or (512 if tiny else 4096)
    t_tok = time.perf_counter()
    tok = D.train_tokenizer((text for _, text in corpus.train), vocab, max_bytes=24_000_000)
    tok_s = time.perf_counter() - t_tok
    tok.save(str(out / "tokenizer.json"))
    t_enc = time.perf_counter()
    train_stream = D.encode_docs(tok, corpus.train)
    held_stream = D.encode_docs(tok, corpus.heldout)
    enc_s = time.perf_counter() - t_enc
    eos_id, mask_id = tok.token_to_id(D.EOS_TOKEN), tok.token_to_id(D.MASK_TOKEN)
    bytes_per_token = cs["heldout_bytes"] / max(1, held_stream.numel() - len(corpus.heldout))
    roundtrip_bad = sum(tok.decode(tok.encode(x).ids, skip_special_tokens=False) != x for _, x in corpus.heldout)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {tok_s:.1f}s; encoded in {enc_s:.1f}s: train "
        f"{train_stream.numel() / 1e6:.2f}M tokens, held-out {held_stream.numel() / 1e6:.3f}M tokens, "
        f"{bytes_per_token:.2f} bytes/token; held-out round-trip failures {roundtrip_bad}")
    phases["data_tokenizer"] = round(time.perf_counter() - t, 2)
    metrics["corpus"] = {**cs, "include_tests": not args.no_tests, "split_rule":
                         f"held-out iff zlib.crc32(relpath.encode('utf-8')) % {D.HELDOUT_MODULUS} == 0",
                         "train_tokens": train_stream.numel(), "heldout_tokens": held_stream.numel(),
                         "heldout_files_list": [p for p, _ in corpus.heldout]}
    metrics["tokenizer"] = {"vocab_size": tok.get_vocab_size(), "eos_id": eos_id, "mask_id": mask_id,
                            "train_seconds": round(tok_s, 2), "encode_seconds": round(enc_s, 2),
                            "heldout_bytes_per_token": round(bytes_per_token, 3),
                            "heldout_roundtrip_failures": roundtrip_bad}

    # ---- 2. target ---------------------------------------------------------------------------
    t = time.perf_counter()
    cfg = TT.demo_model_config(tok.get_vocab_size(), tiny=tiny)
    ts = TT.TargetTrainSettings(minutes=args.target_minutes, max_steps=args.target_steps, seed=args.seed,
                                compile=args.compile, expert_impl=args.expert_impl,
                                max_epochs=args.target_max_epochs or None)
    if tiny:
        ts.batch, ts.seq_len, ts.warmup_steps, ts.eval_windows, ts.dropout = 4, 64, 3, 4, 0.0
        ts.lr, ts.eval_every = 3e-3, 10
        if ts.max_steps is None:
            ts.max_steps = 20
    ts.batch = args.batch or ts.batch
    ts.seq_len = args.seq_len or ts.seq_len
    held_windows = D.consecutive_windows(held_stream, ts.seq_len + 1, max_windows=16 if tiny else None)
    res = TT.train_target(cfg, train_stream, held_windows, ts, device, log)
    phases["target_train"] = round(time.perf_counter() - t, 2)
    log(f"target: {res.steps} steps, {res.tokens / 1e6:.1f}M tokens "
        f"({res.tokens / train_stream.numel():.2f} epochs) in {res.seconds:.1f}s")

    # ---- 3. export + held-out evaluation -----------------------------------------------------
    t = time.perf_counter()
    state = X.canonical_state(res.model)
    dense = X.dense_tensors(state)
    int4 = X.int4_tensors(state)
    qcfg = X.int4_config(cfg)
    X.save_target(out / "dense", cfg, dense, tok)
    X.save_target(out, qcfg, int4, tok)
    ev = {"trained_fp32": TT.evaluate_loss(res.model, held_windows, device)}
    served_dense = X.load_served(cfg, dense, device, res.expert_impl)
    ev["dense_bf16"] = TT.evaluate_loss(served_dense, held_windows, device)
    del served_dense
    target = X.load_served(qcfg, int4, device, res.expert_impl)
    ev["int4"] = TT.evaluate_loss(target, held_windows, device)
    train_windows = D.consecutive_windows(train_stream, ts.seq_len + 1, max_windows=held_windows.shape[0])
    ev["int4_on_train_split"] = TT.evaluate_loss(target, train_windows, device)
    for k, v in ev.items():
        v["bits_per_byte"] = round(v["loss"] / math.log(2) / bytes_per_token, 4)
        log(f"held-out {k}: loss {v['loss']:.5f} ppl {v['ppl']:.2f} ({v['bits_per_byte']:.3f} bits/byte, "
            f"{v['tokens']} tokens)" if k != "int4_on_train_split" else
            f"train-split sample (INT4): loss {v['loss']:.4f} ppl {v['ppl']:.2f}")
    phases["export_eval"] = round(time.perf_counter() - t, 2)
    metrics["target"] = {"config": qcfg.to_dict(), "settings": res.settings, "steps": res.steps,
                         "tokens": res.tokens, "epochs": round(res.tokens / train_stream.numel(), 3),
                         "train_seconds": round(res.seconds, 2), "expert_impl": res.expert_impl,
                         "params": sum(p.numel() for p in res.model.parameters()),
                         "final_expert_load": [[round(x, 4) for x in l] for l in res.final_load],
                         "router_bias": [m.gate.e_score_correction_bias.tolist() for m in res.model.moe_layers()],
                         "heldout": ev, "curve": res.curve}
    del res

    # ---- 4. drafter ----------------------------------------------------------------------------
    t = time.perf_counter()
    dcfg = DT.demo_draft_config(cfg, mask_id, tiny=tiny)
    reserve = 15 if tiny else 40  # drafter evaluation, engine check, writing
    minutes = args.draft_minutes
    left = (deadline - time.perf_counter() - reserve) / 60
    if args.draft_steps is None and not tiny and left < minutes:
        log(f"drafter: shortened from {minutes:g} to {max(left, 0.5):.2f} min to keep the total under "
            f"{args.max_total_minutes:g} min")
        minutes = max(left, 0.5)
    dsets = DT.DraftTrainSettings(minutes=minutes, max_steps=args.draft_steps, seed=args.seed)
    if tiny:
        dsets.batch, dsets.seq_len, dsets.blocks_per_seq, dsets.pool_seqs, dsets.gen_batch = 4, 64, 8, 8, 4
        dsets.prefix_lens, dsets.warmup_steps, dsets.lr, dsets.sample_every = (8, 16), 3, 3e-3, 2
        if dsets.max_steps is None:
            dsets.max_steps = 12
    # held-out prompts, continued by the target in the pool's first batch (for the drafter evaluation)
    n_eval = 4 if tiny else 64
    P = dsets.prefix_lens[0]
    prompts = D.consecutive_windows(held_stream, P, max_windows=n_eval)
    dres = DT.train_drafter(target, dcfg, train_stream, dsets, device, log, eval_prompts=prompts)
    phases["draft_train"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    from kdtree_engine.model.dflash import save_drafter
    save_drafter(out / "draft", DT.export_drafter(dres.drafter))
    # held-out evaluation: continuations of held-out prefixes (what decoding sees) and held-out data
    cont = dres.eval_continuations
    dev_eval = {"heldout_greedy_continuations": DT.evaluate_drafter(dres.drafter, target, cont, P, device,
                                                                     seed=args.seed)}
    data_seqs = D.consecutive_windows(held_stream, dsets.seq_len, max_windows=n_eval)
    dev_eval["heldout_data"] = DT.evaluate_drafter(dres.drafter, target, data_seqs, 1, device, seed=args.seed)
    for k, v in dev_eval.items():
        log(f"drafter on {k}: tau(chain) {v['tau_chain']:.2f}, top-1 acc by position "
            f"{' '.join(f'{a:.2f}' for a in v['acc_top1'])}")
    phases["draft_eval"] = round(time.perf_counter() - t, 2)
    metrics["drafter"] = {"config": dcfg.to_dict(), "settings": dres.settings, "steps": dres.steps,
                          "train_seconds": round(dres.seconds, 2), "pool_sequences": dres.pool_seqs,
                          "pool_seconds": round(dres.pool_seconds, 2),
                          "params": sum(p.numel() for p in dres.drafter.parameters()),
                          "labels": "target greedy (argmax) predictions on each training sequence",
                          "heldout": dev_eval, "curve": dres.curve}

    # ---- 5. engine check (CPU, float32): load, held-out loss agreement, speculative decoding ----
    t = time.perf_counter()
    if not args.skip_engine_check:
        try:
            metrics["engine_check"] = engine_check(out, target, held_stream, tok, log, tiny,
                                                   deadline=deadline - 5)
        except Exception as e:  # reported, never fatal: the checkpoint is already written
            log(f"engine check failed: {type(e).__name__}: {e}")
            log(traceback.format_exc())
            metrics["engine_check"] = {"error": f"{type(e).__name__}: {e}"}
    phases["engine_check"] = round(time.perf_counter() - t, 2)

    # ---- 6. sizes, metrics, figure -----------------------------------------------------------
    sizes = {"target_bytes": X.dir_bytes(out, ("config.json", "model.safetensors")),
             "tokenizer_bytes": (out / "tokenizer.json").stat().st_size,
             "draft_bytes": X.dir_bytes(out / "draft", ("config.json", "model.safetensors")),
             "dense_export_bytes_not_shipped": X.dir_bytes(out / "dense")}
    sizes["shipped_total_bytes"] = sizes["target_bytes"] + sizes["tokenizer_bytes"] + sizes["draft_bytes"]
    sizes["limit_bytes"] = SIZE_LIMIT
    metrics["sizes"] = sizes
    log(f"sizes: target {sizes['target_bytes'] / 1e6:.2f} MB + tokenizer {sizes['tokenizer_bytes'] / 1e6:.2f} MB "
        f"+ drafter {sizes['draft_bytes'] / 1e6:.2f} MB = {sizes['shipped_total_bytes'] / 1e6:.2f} MB "
        f"(limit {SIZE_LIMIT / 1e6:.0f} MB){'' if sizes['shipped_total_bytes'] <= SIZE_LIMIT else '  OVER THE LIMIT'}")
    phases["total"] = round(time.perf_counter() - t_start, 2)
    log("phases (s): " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, out / "loss_curve.png", log)
    log(f"done in {phases['total']:.1f}s -> {out}")
    return metrics


def engine_check(out: Path, target, held_stream: torch.Tensor, tok, log, tiny: bool, deadline: float) -> dict:
    """Load the written checkpoint with the engine on the CPU; compare losses; decode with speculation."""
    import torch.nn.functional as F

    from kdtree_engine.engine import load_target
    from kdtree_engine.model.dflash import DFlashDrafter
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate

    cpu = torch.device("cpu")
    eng = load_target(out, device=cpu, dtype=torch.float32, progress=False)
    drafter = DFlashDrafter.from_pretrained(out / "draft", eng.cfg, dtype=torch.float32, device=cpu)
    L = 64 if tiny else 512
    windows = D.consecutive_windows(held_stream, L + 1, max_windows=2 if tiny else 4)
    served_cpu = X.load_served(eng.cfg, X_load(out, eng.cfg), cpu)
    eng_loss = ref_loss = 0.0
    with torch.no_grad():
        for w in windows:
            lg = eng(w[:-1], eng.new_cache(L)).logits
            eng_loss += float(F.cross_entropy(lg, w[1:]))
            ref, _ = served_cpu(w[:-1].unsqueeze(0))
            ref_loss += float(F.cross_entropy(ref[0], w[1:]))
    n = windows.shape[0]
    res: dict = {"engine_int4_loss": round(eng_loss / n, 5), "training_code_int4_loss": round(ref_loss / n, 5),
                 "windows": n, "tokens_per_window": L}
    log(f"engine (CPU fp32) held-out loss on {n} windows: {eng_loss / n:.4f}; training code on the same: "
        f"{ref_loss / n:.4f}")
    prompts = D.consecutive_windows(held_stream, 32, max_windows=1 if tiny else 3)
    new = 12 if tiny else 128
    specs = (("none", None), ("dflash", None), ("ddtree", 32)) + ((("ddtree", 64),) if not tiny else ())
    runs = []
    for i, p in enumerate(prompts.tolist()):
        if time.perf_counter() > deadline - 20:
            log("engine check: stopping speculative decoding runs (time)")
            break
        row = {"prompt": i}
        base = None
        for spec, budget in specs:
            r = generate(eng, p, SamplingParams(max_tokens=new, ignore_eos=True), spec=spec, drafter=drafter,
                         budget=budget)
            key = spec if budget is None else f"{spec}{budget}"
            row[key] = {"tau": round(float(r.stats.get("tau", 1.0)), 3),
                        "tokens_per_s": round(float(r.stats.get("tokens_per_s", 0.0)), 1)}
            if base is None:
                base = r.token_ids
                row["text"] = tok.decode(p + r.token_ids)[-300:]
            row[key]["same_as_plain"] = r.token_ids == base
        runs.append(row)
        log(f"engine decode prompt {i}: " + ", ".join(
            f"{k} tau {v['tau']:.2f} {v['tokens_per_s']:.0f} tok/s same={v['same_as_plain']}"
            for k, v in row.items() if isinstance(v, dict)))
    res["decode"] = runs
    return res


def X_load(out: Path, cfg) -> dict:
    from kdtree_engine.weights import load_checkpoint
    return load_checkpoint(out, cfg)


def plot(metrics: dict, path: Path, log) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no figure")
        return
    tc = metrics["target"]["curve"]
    dc = metrics["drafter"]["curve"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    if tc:
        ax[0].plot([c["tokens"] / 1e6 for c in tc], [c["train_loss_ema"] or c["train_loss"] for c in tc], label="train (EMA)")
        ax[0].plot([c["tokens"] / 1e6 for c in tc], [c["eval_loss"] for c in tc], label="held-out (subset)")
    ax[0].set_xlabel("tokens (M)")
    ax[0].set_ylabel("loss (nats/token)")
    ax[0].set_title("target")
    ax[0].legend()
    if dc:
        ax[1].plot([c["step"] for c in dc], [c["loss_ema"] for c in dc], label="weighted CE (EMA)")
        ax2 = ax[1].twinx()
        ax2.plot([c["step"] for c in dc], [c["acc1_ema"] for c in dc], color="tab:orange", label="pos-1 acc (EMA)")
        ax2.set_ylabel("accuracy")
        ax2.legend(loc="center right")
    ax[1].set_xlabel("step")
    ax[1].set_title("drafter")
    ax[1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"figure: {path}")


if __name__ == "__main__":
    main()
