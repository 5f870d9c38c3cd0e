"""DFlash drafter: architecture against an independent eager implementation built from
transformers' Qwen3 pieces, the context cache, the released checkpoint format, target fit, and the
target-layer convention (id L = output of decoder layer L)."""

import json
import random

import pytest
import torch

from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig, DraftConfigError, default_target_layer_ids
from kdtree_engine.model.dflash import (DFlashDrafter, DraftLoadError, DraftMismatchError, check_draft_fits,
                                        save_drafter)


pytestmark = pytest.mark.usefixtures("single_thread")


def _cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=255, target_layer_ids=(0, 2, 3),
                num_target_layers=4, vocab_size=256, rope_theta=10000.0)
    base.update(kw)
    return DraftConfig(**base)


def _eager(drafter: DFlashDrafter, feats: torch.Tensor, block: torch.Tensor, start: int) -> torch.Tensor:
    """Whole-context draft pass written from the architecture description (no cache)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

    c = drafter.cfg
    sd = drafter.state_dict()
    hc = Qwen3Config(hidden_size=c.hidden_size, head_dim=c.head_dim, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})

    def norm(name, dim):
        m = Qwen3RMSNorm(dim, eps=c.rms_norm_eps)
        m.weight.data = sd[name].clone()
        return m

    B, S = block.shape[0], feats.shape[0]
    assert S == start
    rot = Qwen3RotaryEmbedding(hc)
    pos = torch.arange(start + B)[None]
    cos, sin = rot(block[None], pos)  # [1, S+B, d]
    ctx = norm("hidden_norm.weight", c.hidden_size)(feats @ sd["fc.weight"].T)  # [S, D]
    h = block
    H, Hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(p + "input_layernorm.weight", c.hidden_size)(h)
        q = norm(p + "self_attn.q_norm.weight", d)((x @ sd[p + "self_attn.q_proj.weight"].T).view(B, H, d))
        kv_in = torch.cat([ctx, x])  # [S+B, D]: context features are keys/values, never queries
        k = norm(p + "self_attn.k_norm.weight", d)((kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(S + B, Hkv, d))
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(S + B, Hkv, d)
        q4, k4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, B, d], [1, Hkv, S+B, d]
        _, k4 = apply_rotary_pos_emb(k4, k4, cos, sin)
        q4, _ = apply_rotary_pos_emb(q4, q4, cos[:, S:], sin[:, S:])
        k4 = k4.repeat_interleave(H // Hkv, dim=1)
        v4 = v.transpose(0, 1)[None].repeat_interleave(H // Hkv, dim=1)
        w = torch.softmax((q4 @ k4.transpose(-1, -2)) * d ** -0.5, dim=-1)  # no mask: non-causal
        if drafter.cfg.sliding_windows and drafter.cfg.sliding_windows[i]:
            win = drafter.cfg.sliding_windows[i]
            qp, kp = torch.arange(start, start + B)[:, None], torch.arange(start + B)[None]
            s = (q4 @ k4.transpose(-1, -2)) * d ** -0.5
            w = torch.softmax(s.masked_fill(kp <= qp - win, float("-inf")), dim=-1)
        o = (w @ v4)[0].transpose(0, 1).reshape(B, H * d)
        h = h + o @ sd[p + "self_attn.o_proj.weight"].T
        y = norm(p + "post_attention_layernorm.weight", c.hidden_size)(h)
        mlp = torch.nn.functional.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ sd[p + "mlp.down_proj.weight"].T
    return norm("norm.weight", c.hidden_size)(h)


@pytest.mark.parametrize("windows", [None, (None, 6)])
def test_cached_rounds_match_eager(windows):
    cfg = _cfg(sliding_windows=windows)
    drafter = DFlashDrafter.random(cfg, seed=1)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(20, cfg.num_context_features * cfg.hidden_size, generator=g)
    cache = drafter.new_cache(32)
    prev = 0
    for start in (7, 8, 12, 16):  # prompt, then rounds committing 1, 4, 4 tokens
        block = torch.randn(cfg.block_size, cfg.hidden_size, generator=g)
        out = drafter(feats[prev:start], block, cache, start)
        assert cache.length == start  # context entries of committed tokens only, never the block
        torch.testing.assert_close(out, _eager(drafter, feats[:start], block, start), rtol=1e-4, atol=1e-4)
        prev = start
    with pytest.raises(ValueError, match="context"):
        drafter(feats[16:17], block, cache, 18)  # a gap between context and block is refused


def test_propose_uses_target_embed_and_head():
    cfg = _cfg()
    drafter = DFlashDrafter.random(cfg, seed=2)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(256, 64, generator=g)
    head = torch.randn(64, 256, generator=g)

    class Tgt:
        def embed(self, ids):
            return emb[ids]

        def lm_head(self, h):
            return (h @ head).float()

    feats = torch.randn(6, 192, generator=g)
    logits = drafter.propose(Tgt(), feats, torch.tensor(17), drafter.new_cache(16), 6)
    block = emb[torch.tensor([17, 255, 255, 255, 255])]
    want = _eager(drafter, feats, block, 6)[1:] @ head
    assert logits.shape == (cfg.block_size - 1, 256) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_checkpoint_round_trip_and_released_names(tmp_path):
    from safetensors.torch import save_file

    cfg = _cfg()
    drafter = DFlashDrafter.random(cfg, seed=3)
    save_drafter(tmp_path / "d", drafter)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["block_size"] == 5 and raw["dflash_config"]["target_layer_ids"] == [0, 2, 3]
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", preset("k2-tiny"))
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    names = set(drafter.state_dict())
    assert len(names) == 3 + 11 * cfg.num_hidden_layers and "fc.weight" in names
    assert "layers.1.self_attn.q_norm.weight" in names and "layers.0.mlp.down_proj.weight" in names
    # a "model."-prefixed export loads too; a missing tensor and a wrong shape are named
    sd = {("model." + k): v.contiguous() for k, v in drafter.state_dict().items()}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps(raw))
    save_file(sd, str(tmp_path / "p" / "model.safetensors"))
    DFlashDrafter.from_pretrained(tmp_path / "p")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file(sd, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="layers.1.mlp.up_proj.weight"):
        DFlashDrafter.from_pretrained(tmp_path / "p")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(sd, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(DraftLoadError, match=r"up_proj.weight.*shape"):
        DFlashDrafter.from_pretrained(tmp_path / "p")


def test_released_config_layouts():
    qwen3_b16 = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
                 "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
                 "num_target_layers": 36, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
                 "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
                 "attention_bias": False, "tie_word_embeddings": True, "vocab_size": 151936}
    c = DraftConfig.from_dict(qwen3_b16)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.sliding_windows) == (16, 151669, (1, 9, 17, 25, 33), None)
    newer = dict(qwen3_b16, dflash_config={"mask_token_id": 7, "block_size": 8, "swa_window_size": 64},
                 rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                 layer_types=["sliding_attention"] * 4 + ["full_attention"])
    newer.pop("block_size")
    newer.pop("rope_theta")
    c2 = DraftConfig.from_dict(newer)
    assert c2.block_size == 8 and c2.rope_theta == 5e6 and c2.sliding_windows == (64, 64, 64, 64, None)
    assert c2.target_layer_ids == default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for field, broken in (("mask_token_id", {"dflash_config": {}}), ("block_size", {"block_size": None}),
                          ("hidden_size", {"hidden_size": None}), ("hidden_act", {"hidden_act": "gelu"})):
        with pytest.raises(DraftConfigError, match=field):
            DraftConfig.from_dict(dict(qwen3_b16, **broken))


def test_mismatched_drafter_refused():
    t = preset("k2-tiny")
    check_draft_fits(_cfg(), t)
    for kw, words in (({"hidden_size": 32}, "hidden_size"), ({"vocab_size": 300, "mask_token_id": 299}, "vocab_size"),
                      ({"vocab_size": None, "mask_token_id": 300}, "mask_token_id"),
                      ({"target_layer_ids": (0, 4), "num_target_layers": None}, "target_layer_ids"),
                      ({"num_target_layers": 61, "target_layer_ids": (1, 30)}, "num_target_layers")):
        with pytest.raises(DraftMismatchError, match=words):
            check_draft_fits(_cfg(**kw), t)
    assert issubclass(DraftMismatchError, ValueError)


def test_target_layer_convention_against_transformers():
    """aux id L = output of decoder layer L = transformers' hidden_states[L + 1]."""
    from hf_oracle import hf_model
    from kdtree_engine.model.target import Target
    from kdtree_engine.reference import random_weights

    cfg = preset("k2-tiny")
    w = random_weights(cfg, 4)
    target = Target(cfg).load_weights((k, torch.from_numpy(v)) for k, v in w.items())
    hf = hf_model(cfg, w)
    ids = torch.tensor([3, 17, 42, 99, 5, 250])
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states  # embeddings, then each layer's output
    # the last layer is left out: transformers' hidden_states[-1] is taken after the final norm
    ids_order = (2, 0, 1)
    aux = target(ids, target.new_cache(16), aux_layers=ids_order).aux
    want = torch.cat([hs[L + 1][0] for L in ids_order], dim=-1)
    torch.testing.assert_close(aux, want, rtol=1e-4, atol=1e-4)
    wrong = torch.cat([hs[L][0] for L in ids_order], dim=-1)  # the +1-shifted convention of other engines
    assert not torch.allclose(aux, wrong, rtol=1e-2, atol=1e-2)


def test_passes_built_together_hold_what_each_pass_builds_alone():
    """DFlashDrafter.contexts_together (the batched passes' data for the one-launch attention kernel) against
    context() of each pass alone: the same positions, cache slots, lengths; rope rows equal to rounding (the CPU's
    vectorised tails; on the GPU bit for bit); a pass whose rows do not end at its block refused as alone."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    drafter = DFlashDrafter.random(_cfg(), seed=seed)
    items = []
    for _ in range(5):
        cache = drafter.new_cache(300)
        cache.length = rng.randint(0, 200)
        rows = rng.choice([0, 1, rng.randint(2, 40)])
        items.append((rows, cache, cache.length + rows))
    together = drafter.contexts_together(items)
    for (rows, cache, start), t in zip(items, together):
        a = drafter.context(cache, rows, start)
        assert torch.equal(t.q_pos, a.q_pos) and t.kv_len == a.kv_len == start and t.host_length == a.host_length
        assert (t.c_pos is None) == (a.c_pos is None) == (rows == 0)
        if rows:
            assert torch.equal(t.c_pos, a.c_pos)
            torch.testing.assert_close(t.cos_c, a.cos_c, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(t.sin_c, a.sin_c, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t.cos_b, a.cos_b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t.sin_b, a.sin_b, rtol=1e-6, atol=1e-6)
        assert int(t.start) == start and t.k_pos is None and t.visible is None
    rows, cache, start = items[0]
    with pytest.raises(ValueError, match=f"block starts at {start + 1}"):
        drafter.contexts_together([(rows, cache, start + 1)])
