"""DFlash drafter configuration, read from the released checkpoints' ``config.json`` as is.

Understood layouts: ``block_size`` at the top level (Qwen3 b16 drafts) or inside ``dflash_config``
(newer drafts); ``dflash_config.mask_token_id`` and ``dflash_config.target_layer_ids``; rope from
``rope_theta`` or ``rope_parameters.rope_theta``; ``layer_types`` with ``full_attention`` /
``sliding_attention`` (window ``sliding_window`` or ``dflash_config.swa_window_size``).
Missing target layer ids are derived as the released drafters were trained: evenly spaced over
[1, num_target_layers - 3].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import DraftConfigError
from .config import ConfigError, read_config_json



_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Ids spread evenly over [1, num_target_layers - 3] (one id: the middle layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DraftConfig:
    """Hyper-parameters of a DFlash drafter (a Qwen3-style stack with KV injection)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    # None = full attention in every layer; else one window (tokens) or None per layer.
    sliding_windows: tuple[int | None, ...] | None = None
    causal: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.target_layer_ids, list):
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        self.validate()

    @property
    def num_context_features(self) -> int:
        """K: number of target layers whose outputs are concatenated."""
        return len(self.target_layer_ids)

    def validate(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise DraftConfigError(f"draft config field '{name}' must be a positive integer, got {v!r}")
        if self.block_size < 2:
            raise DraftConfigError(f"draft config field 'block_size' must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError(
                f"draft config field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"'num_attention_heads' ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise DraftConfigError(f"draft config field 'head_dim' must be even, got {self.head_dim}")
        if not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise DraftConfigError(f"draft config field 'mask_token_id' must be a token id >= 0, got {self.mask_token_id!r}")
        if self.vocab_size is not None and self.mask_token_id >= self.vocab_size:
            raise DraftConfigError(f"draft config field 'mask_token_id' ({self.mask_token_id}) is outside "
                                   f"'vocab_size' ({self.vocab_size})")
        if not self.target_layer_ids:
            raise DraftConfigError("draft config field 'target_layer_ids' is empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or any(
                not isinstance(i, int) or i < 0 for i in self.target_layer_ids):
            raise DraftConfigError(f"draft config field 'target_layer_ids' must be distinct ids >= 0, "
                                   f"got {list(self.target_layer_ids)}")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise DraftConfigError(f"draft config field 'target_layer_ids' {list(self.target_layer_ids)} "
                                   f"reaches past 'num_target_layers' ({self.num_target_layers})")
        if not self.rms_norm_eps > 0:
            raise DraftConfigError(f"draft config field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise DraftConfigError(f"draft config field 'rope_theta' must be > 0, got {self.rope_theta}")
        if self.sliding_windows is not None:
            if len(self.sliding_windows) != self.num_hidden_layers:
                raise DraftConfigError(f"draft config field 'layer_types' has {len(self.sliding_windows)} entries, "
                                       f"'num_hidden_layers' is {self.num_hidden_layers}")
            for w in self.sliding_windows:
                if w is not None and (not isinstance(w, int) or w <= 0):
                    raise DraftConfigError(f"draft config field 'sliding_window' must be a positive integer, got {w!r}")
        if self.causal:
            raise DraftConfigError("draft config field 'dflash_config.causal' = true is not supported "
                                   "(the drafter attends non-causally within its block)")

    # ---- I/O ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DraftConfig":
        return read_config_json(path, cls.from_dict, DraftConfigError)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DraftConfig":
        for name in _REQUIRED:
            if raw.get(name) is None:
                raise DraftConfigError(f"required draft config field '{name}' is missing")
        dc = raw.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise DraftConfigError("draft config field 'dflash_config' must be an object")
        block = dc.get("block_size", raw.get("block_size"))
        if block is None:
            raise DraftConfigError("required draft config field 'block_size' is missing "
                                   "(top level or dflash_config.block_size)")
        mask = dc.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise DraftConfigError("required draft config field 'dflash_config.mask_token_id' is missing")
        if raw.get("hidden_act", "silu") != "silu":
            raise DraftConfigError(f"draft config field 'hidden_act' must be 'silu', got {raw.get('hidden_act')!r}")
        if raw.get("attention_bias", False):
            raise DraftConfigError("draft config field 'attention_bias' = true is not supported")
        if raw.get("d2t") is not None or raw.get("draft_vocab_size") not in (None, raw.get("vocab_size")):
            raise DraftConfigError("draft config field 'draft_vocab_size' (a reduced draft vocabulary) is not supported")
        if raw.get("target_hidden_size") not in (None, raw["hidden_size"]):
            raise DraftConfigError(f"draft config field 'target_hidden_size' ({raw['target_hidden_size']}) differs "
                                   f"from 'hidden_size' ({raw['hidden_size']}); not supported")
        n_layers = int(raw["num_hidden_layers"])
        n_target = raw.get("num_target_layers")
        ids = dc.get("target_layer_ids", raw.get("target_layer_ids"))
        if ids is None:
            if n_target is None:
                raise DraftConfigError("draft config field 'dflash_config.target_layer_ids' is missing and "
                                       "'num_target_layers' is not given to derive it")
            ids = default_target_layer_ids(int(n_target), n_layers)
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        scaling = raw.get("rope_scaling")
        rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else rope.get("rope_type")
        if rtype not in (None, "default"):
            raise DraftConfigError(f"draft config field 'rope_scaling' type {rtype!r} is not supported "
                                   "(plain rope only)")
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or int(raw["hidden_size"]) // heads
        windows = None
        types = raw.get("layer_types")
        use_swa = raw.get("use_sliding_window", False) or dc.get("use_swa", False)
        window = dc.get("swa_window_size") or raw.get("sliding_window")
        if types is not None and any(t == "sliding_attention" for t in types):
            if not window:
                raise DraftConfigError("draft config field 'sliding_window' is missing for sliding_attention layers")
            windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
        elif types is None and use_swa and window:
            windows = (int(window),) * n_layers
        known = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "block_size", "dflash_config", "num_target_layers",
                 "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings"}
        try:
            return cls(
                hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=n_layers, num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(head_dim),
                block_size=int(block), mask_token_id=int(mask), target_layer_ids=tuple(int(i) for i in ids),
                num_target_layers=None if n_target is None else int(n_target),
                vocab_size=None if raw.get("vocab_size") is None else int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
                sliding_windows=windows, causal=bool(dc.get("causal", False)),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, DraftConfigError):
                raise
            raise DraftConfigError(f"draft config holds a value of the wrong type ({e})") from None

    def to_dict(self) -> dict[str, Any]:
        """A config.json in the released drafters' layout (block_size at the top level)."""
        d: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            d["vocab_size"] = self.vocab_size
        if self.sliding_windows is None:
            d["layer_types"] = ["full_attention"] * self.num_hidden_layers
            d["sliding_window"] = None
            d["use_sliding_window"] = False
        else:
            d["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in self.sliding_windows]
            d["sliding_window"] = next(w for w in self.sliding_windows if w is not None)
            d["use_sliding_window"] = True
        return d
