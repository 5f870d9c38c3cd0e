"""Golden bundles: round trip, error reporting, W4A16 goldens, and the ``golden`` commands on the engine."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kdtree_engine import reference as ref
from kdtree_engine.bundle import FORMAT, BundleError, load_bundle, make_bundle, save_bundle
from kdtree_engine.config import preset
from kdtree_engine.golden import compare, main as golden_main

CFG = preset("k2-tiny")


@pytest.fixture(scope="module")
def bundle():
    return make_bundle(CFG, seed=0, n_tokens=16, prompt_len=8)


@pytest.fixture(scope="module")
def bundle_file(bundle, tmp_path_factory) -> Path:
    return save_bundle(bundle, tmp_path_factory.mktemp("golden") / "b.safetensors")


def test_make_bundle_contents(bundle) -> None:
    assert bundle.meta["format"] == FORMAT and bundle.meta["quant"] == "none"
    assert bundle.meta["dtype_reference"] == "float64" and bundle.meta["seed"] == "0"
    assert bundle.meta["robust"] == "yes"
    assert bundle.prompt_ids.dtype == np.int64 and bundle.prompt_ids.shape == (8,)
    assert bundle.golden_tokens.dtype == np.int64 and bundle.golden_tokens.shape == (16,)
    assert ref.greedy(CFG, bundle.weights, bundle.prompt_ids, 16) == bundle.golden_tokens.tolist()
    again = make_bundle(CFG, seed=0, n_tokens=16, prompt_len=8)  # deterministic
    assert again.golden_tokens.tolist() == bundle.golden_tokens.tolist()
    assert again.prompt_ids.tolist() == bundle.prompt_ids.tolist()


def test_round_trip(bundle, bundle_file) -> None:
    b = load_bundle(bundle_file)
    assert b.cfg == bundle.cfg
    assert set(b.weights) == set(bundle.weights)
    for k, v in bundle.weights.items():
        assert b.weights[k].dtype == v.dtype
        np.testing.assert_array_equal(b.weights[k], v)
    np.testing.assert_array_equal(b.prompt_ids, bundle.prompt_ids)
    np.testing.assert_array_equal(b.golden_tokens, bundle.golden_tokens)
    assert b.meta["config"] and json.loads(b.meta["config"])["hidden_size"] == CFG.hidden_size
    assert not list(bundle_file.parent.glob("*.tmp")), "no temporary file left behind"


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, meta: dict | None = None) -> Path:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src))
    if drop:
        tensors.pop(drop)
    with src.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        old = json.loads(f.read(n))["__metadata__"]
    save_file(tensors, str(dst), metadata={**old, **(meta or {})})
    return dst


def test_errors(bundle_file, tmp_path) -> None:
    with pytest.raises(BundleError, match="not found"):
        load_bundle(tmp_path / "missing.safetensors")
    data = bundle_file.read_bytes()
    for cut in (4, 200, len(data) // 2, len(data) - 1):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with pytest.raises(BundleError, match="truncated"):
            load_bundle(tmp_path / "t.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + b"\0" * 64)
    with pytest.raises(BundleError, match="corrupt"):
        load_bundle(tmp_path / "junk.safetensors")
    with pytest.raises(BundleError, match="format tag"):
        load_bundle(_rewrite(bundle_file, tmp_path / "f.safetensors", meta={"format": "other/1"}))
    with pytest.raises(BundleError, match="config"):
        load_bundle(_rewrite(bundle_file, tmp_path / "c.safetensors", meta={"config": "{"}))
    with pytest.raises(BundleError, match="__golden_tokens__"):
        load_bundle(_rewrite(bundle_file, tmp_path / "g.safetensors", drop="__golden_tokens__"))
    with pytest.raises(BundleError, match="__prompt_ids__"):
        load_bundle(_rewrite(bundle_file, tmp_path / "p.safetensors", drop="__prompt_ids__"))
    with pytest.raises(BundleError, match="layers.2.self_attn.o_proj.weight"):
        load_bundle(_rewrite(bundle_file, tmp_path / "w.safetensors", drop="layers.2.self_attn.o_proj.weight"))


def test_w4a16_goldens_differ_from_float() -> None:
    """Same seed, same prompt: dequantized INT4 experts change the model enough to change the tokens."""
    differs = 0
    for seed in (0, 2):
        bq = make_bundle(CFG, seed=seed, n_tokens=64, prompt_len=8, quant="w4a16")
        assert bq.meta["quant"] == "w4a16" and bq.meta["group_size"] == "32"
        assert bq.cfg.quantization is not None
        packed = bq.weights["layers.1.mlp.experts.3.up_proj.weight_packed"]
        assert packed.dtype == np.int32 and packed.shape == (CFG.moe_intermediate_size, CFG.hidden_size // 8)
        assert "layers.1.mlp.experts.3.up_proj.weight" not in bq.weights
        float_tokens = ref.greedy(CFG, ref.random_weights(CFG, seed), bq.prompt_ids, 64)
        differs += float_tokens != bq.golden_tokens.tolist()
    assert differs >= 1


def test_w4a16_round_trip(tmp_path) -> None:
    bq = make_bundle(CFG, seed=1, n_tokens=8, prompt_len=4, quant="w4a16")
    b = load_bundle(save_bundle(bq, tmp_path / "q.safetensors"))
    assert b.cfg.quantization == bq.cfg.quantization and b.quant == "w4a16"
    assert ref.greedy(b.cfg, b.weights, b.prompt_ids, 8) == bq.golden_tokens.tolist()


def test_compare_messages() -> None:
    assert compare([1, 2, 3], [1, 2, 3]) == (True, "match 3/3")
    assert compare([1, 2, 3], [1, 5, 3]) == (False, "mismatch at position 1: expected 2, got 5 (match 1/3)")
    ok, msg = compare([1, 2], [1])
    assert not ok and msg.startswith("mismatch at position 1: expected 2, got nothing")


def test_golden_make_and_check_engine(tmp_path, capsys) -> None:
    out = tmp_path / "k.safetensors"
    assert golden_main(["make", "--preset", "k2-tiny", "--seed", "3", "--tokens", "12", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert golden_main(["check", str(out)]) == 0  # the torch engine, float32 on the CPU
    assert capsys.readouterr().out.strip().endswith("match 12/12")


def test_golden_check_mismatch_and_bad_bundle(bundle, tmp_path, capsys) -> None:
    wrong = make_bundle(CFG, seed=0, n_tokens=6, prompt_len=8)
    wrong.golden_tokens = wrong.golden_tokens.copy()
    wrong.golden_tokens[4] = (wrong.golden_tokens[4] + 1) % CFG.vocab_size
    path = save_bundle(wrong, tmp_path / "wrong.safetensors")
    assert golden_main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"mismatch at position 4: expected {wrong.golden_tokens[4]}" in out and "(match 4/6)" in out
    path.write_bytes(path.read_bytes()[:1000])
    assert golden_main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err
    assert golden_main(["check", str(tmp_path / "none.safetensors")]) == 2
    assert "not found" in capsys.readouterr().err
