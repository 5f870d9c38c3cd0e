"""Demo-model training: split rule, tokenizer, training code vs the engine, and a tiny end-to-end run.

The end-to-end run is ``scripts/train_demo.py --tiny --device cpu``; its checkpoint is checked with
the engine's loaders and, for the dense export, against HF transformers' DeepseekV3ForCausalLM loaded
with ``from_pretrained`` (an implementation independent of both the engine and the training code).
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import pytest
import torch

from kdtree_engine.engine import load_target
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.train import data as D
from kdtree_engine.train.draft_train import (block_labels, demo_draft_config, draft_hidden, feature_layer_ids,
                                             new_drafter, sample_anchors, target_features)
from kdtree_engine.train.export import canonical_state, dense_tensors, int4_config, int4_tensors, load_served, save_target
from kdtree_engine.train.target_train import TrainModel, demo_model_config, generate

ROOT = Path(__file__).resolve().parents[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- split rule and tokenizer ------------------------------------------------------------------

def test_split_rule_is_the_documented_crc32_rule() -> None:
    for p in ("json/decoder.py", "os.py", "asyncio/sslproto.py", "copy.py", "test/test_os.py"):
        assert D.is_heldout(p) == (zlib.crc32(p.encode("utf-8")) % 20 == 0)
    # pinned values: the rule must not drift between Python versions or refactors
    assert D.is_heldout("copy.py") and D.is_heldout("asyncio/sslproto.py")
    assert not D.is_heldout("os.py") and not D.is_heldout("json/decoder.py")


def test_split_is_deterministic_and_disjoint() -> None:
    paths = D.list_sources(D.stdlib_root())
    assert len(paths) > 100 and paths == sorted(paths)
    assert not any("site-packages" in p for p in paths)
    train, held = D.split_paths(paths)
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(paths)
    assert set(held) == {p for p in reversed(paths) if D.is_heldout(p)}
    assert 0.02 < len(held) / len(paths) < 0.09
    assert D.split_paths(D.list_sources(D.stdlib_root())) == (train, held)


# ---- training code against the engine ----------------------------------------------------------

def _random_train_model(vocab: int = 300, seed: int = 0) -> TrainModel:
    cfg = demo_model_config(vocab, tiny=True)
    m = TrainModel(cfg)
    m.init_weights(seed, std=0.2)
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.05)
    return m.eval()


def test_training_model_matches_engine_and_hf(tmp_path: Path) -> None:
    m = _random_train_model()
    cfg = m.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, aux = m(ids, aux_layers=(0, 1))
    state = canonical_state(m)
    save_target(tmp_path / "dense", cfg, dense_tensors(state, torch.float32))
    eng = load_target(tmp_path / "dense", device=torch.device("cpu"), dtype=torch.float32, progress=False)
    out = eng(ids[1], eng.new_cache(64), aux_layers=(0, 1))
    assert rel(out.logits, logits[1]) < 1e-5
    assert rel(out.aux, aux[1]) < 1e-5
    from transformers import DeepseekV3ForCausalLM
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(hf(ids).logits, logits) < 1e-4
    # INT4 export: the engine computes what the training code computes with dequantized experts
    q = int4_tensors(state)
    save_target(tmp_path / "int4", int4_config(cfg), q)
    eng4 = load_target(tmp_path / "int4", device=torch.device("cpu"), dtype=torch.float32, progress=False)
    served = load_served(int4_config(cfg), q, torch.device("cpu"))
    with torch.no_grad():
        ref, _ = served(ids)
    assert rel(eng4(ids[0], eng4.new_cache(64)).logits, ref[0]) < 1e-5


def test_cached_generation_matches_full_forward() -> None:
    m = _random_train_model(seed=1)
    ids = torch.randint(0, m.cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(1))
    out = generate(m, ids, 10)
    with torch.no_grad():
        full, _ = m(out[:, :-1])
    assert torch.equal(full[:, 6:].argmax(-1), out[:, 7:])


def test_draft_training_forward_equals_engine_drafter() -> None:
    t = _random_train_model(seed=2)
    dcfg = demo_draft_config(t.cfg, 1, tiny=True)
    d = new_drafter(dcfg, 0, torch.device("cpu"), std=0.2)
    ids = torch.randint(2, t.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    feats, greedy = target_features(t, ids, dcfg.target_layer_ids)
    anchors = sample_anchors(2, 64, 16, 5, 1, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert int(anchors.min()) >= 1 and int(anchors.max()) <= 64 - 16
    block = torch.full((2, 5, 16), dcfg.mask_token_id)
    block[:, :, 0] = ids.gather(1, anchors)
    with torch.no_grad():
        h = draft_hidden(d, feats, t.embed_tokens(block), anchors)
        for b in range(2):
            for j in range(5):
                a = int(anchors[b, j])
                # the engine sees exactly the features of positions < anchor
                ref = d(feats[b, :a], t.embed_tokens(block[b, j]), d.new_cache(128), a)
                assert rel(h[b, j], ref) < 1e-5
    labels = block_labels(greedy, anchors, 16)
    assert torch.equal(labels[0, 0], greedy[0, int(anchors[0, 0]) + 1:int(anchors[0, 0]) + 16])


def test_feature_layer_ids() -> None:
    assert feature_layer_ids(6, 4) == (0, 1, 3, 4)
    assert feature_layer_ids(3, 3) == (0, 1)
    for L in range(3, 40):
        ids = feature_layer_ids(L, 4)
        assert len(set(ids)) == len(ids) and max(ids) <= L - 2


# ---- end to end (tiny) ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("demo")
    metrics = mod.main(["--out", str(out), "--tiny", "--device", "cpu", "--seed", "0"])
    return out, metrics


def test_tiny_run_writes_the_demo_layout(tiny_run) -> None:
    out, metrics = tiny_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.txt", "train_metrics.json",
                 "draft/config.json", "draft/model.safetensors", "dense/config.json", "dense/model.safetensors"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "train_metrics.json").read_text())
    assert saved["sizes"]["shipped_total_bytes"] <= saved["sizes"]["limit_bytes"]
    ho = saved["target"]["heldout"]
    for k in ("trained_fp32", "dense_bf16", "int4"):
        assert ho[k]["loss"] == ho[k]["loss"] and ho[k]["ppl"] > 1
    assert len(saved["drafter"]["heldout"]["heldout_data"]["acc_top1"]) == 15
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert cfg["n_routed_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2 and cfg["first_k_dense_replace"] == 1
    assert cfg["rope_scaling"]["type"] == "yarn"
    eng = saved.get("engine_check", {})
    assert "error" not in eng, eng
    assert abs(eng["engine_int4_loss"] - eng["training_code_int4_loss"]) < 1e-3
    for row in eng["decode"]:
        for k, v in row.items():
            if isinstance(v, dict):
                assert v["same_as_plain"], (k, row)


def test_tiny_run_tokenizer_round_trips(tiny_run) -> None:
    from tokenizers import Tokenizer
    out, _ = tiny_run
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id(D.EOS_TOKEN) == 0 and tok.token_to_id(D.MASK_TOKEN) == 1
    samples = [
        "def f(x):\n    return x ** 2  # square\n",
        "class A:\n\tpass\n\n\n   trailing   \n",
        "s = 'naïve café — ünïcödé ✓ 日本語'\nprint(s)\r\n",
        "",
        (ROOT / "kdtree_engine" / "train" / "data.py").read_text(),
    ]
    for s in samples:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s


def test_tiny_run_checkpoint_loads_in_engine_and_hf(tiny_run) -> None:
    from transformers import DeepseekV3ForCausalLM
    out, _ = tiny_run
    cpu = torch.device("cpu")
    ids = torch.randint(2, 500, (48,), generator=torch.Generator().manual_seed(3))
    dense = load_target(out / "dense", device=cpu, dtype=torch.float32, progress=False)
    hf = DeepseekV3ForCausalLM.from_pretrained(out / "dense", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel(dense(ids, dense.new_cache(64)).logits, ref) < 1e-4
    int4 = load_target(out, device=cpu, dtype=torch.float32, progress=False)
    assert int4.cfg.quantization is not None
    lg = int4(ids, int4.new_cache(64)).logits
    assert torch.isfinite(lg).all()
    # INT4 is close to, not equal to, the dense export
    assert 0 < rel(lg, ref) < 0.5


def test_tiny_run_drafter_loads_and_fits(tiny_run) -> None:
    out, _ = tiny_run
    cpu = torch.device("cpu")
    target = load_target(out, device=cpu, dtype=torch.float32, progress=False)
    d = DFlashDrafter.from_pretrained(out / "draft", target.cfg, dtype=torch.float32, device=cpu)
    assert d.block_size == 16 and d.cfg.mask_token_id == 1
    assert 2 <= len(d.target_layer_ids) and max(d.target_layer_ids) < target.cfg.num_hidden_layers - 1
    ids = torch.randint(2, 500, (20,), generator=torch.Generator().manual_seed(4))
    o = target(ids, target.new_cache(64), aux_layers=d.target_layer_ids)
    logits = d.propose(target, o.aux, ids[-1:].clone(), d.new_cache(64), 20)
    assert logits.shape == (15, target.cfg.vocab_size) and torch.isfinite(logits).all()


def test_tiny_run_int4_checkpoint_loads_in_hf_with_compressed_tensors(tiny_run) -> None:
    """Where compressed-tensors is installed, transformers decompresses the INT4 experts on load."""
    pytest.importorskip("compressed_tensors")
    from transformers import DeepseekV3ForCausalLM
    out, _ = tiny_run
    hf = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(2, 500, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    eng = load_target(out, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    # transformers keeps the decompressed experts in bf16; the engine dequantizes to float32
    assert rel(eng(ids, eng.new_cache(64)).logits, ref) < 2e-2
