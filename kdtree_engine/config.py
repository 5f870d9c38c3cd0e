"""Model configuration: frozen dataclasses read from a Hugging Face ``config.json``.

Understood layouts:
  * ``model_type`` ``deepseek_v3`` / ``kimi_k2`` (K2, K2-Thinking): fields at the top level.
  * ``model_type`` ``kimi_k25`` / architecture ``KimiK25ForConditionalGeneration`` (K2.5, K2.6):
    text settings under ``text_config``; ``quantization_config`` may sit at either level.
  * rope: classic ``rope_theta`` + ``rope_scaling`` (key ``type`` or ``rope_type``) or the newer
    ``rope_parameters`` dict (which carries ``rope_theta`` itself).

Optional fields take the defaults of transformers' ``DeepseekV3Config``; a missing required field
or an inconsistent value raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar
from .errors import ConfigError

T = TypeVar("T")



TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
WRAPPER_MODEL_TYPES = ("kimi_k25",)
WRAPPER_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)

# Required: no sensible default exists for these (HF's defaults describe DeepSeek-V3, not the file).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

# transformers DeepseekV3Config defaults for everything else.
HF_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}


@dataclass(frozen=True)
class YarnConfig:
    """YaRN rope scaling as DeepSeek-V3 / K2 use it (rope dims only)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(scale: float, mscale: float) -> float:
    """m(s, k) of DeepSeek's YaRN: 1 for s <= 1, else 0.1 * k * ln(s) + 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a K2-family (DeepSeek-V3 architecture) text model."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int = HF_DEFAULTS["intermediate_size"]
    moe_intermediate_size: int = HF_DEFAULTS["moe_intermediate_size"]
    n_shared_experts: int = HF_DEFAULTS["n_shared_experts"]
    n_routed_experts: int = HF_DEFAULTS["n_routed_experts"]
    routed_scaling_factor: float = HF_DEFAULTS["routed_scaling_factor"]
    kv_lora_rank: int = HF_DEFAULTS["kv_lora_rank"]
    q_lora_rank: int | None = HF_DEFAULTS["q_lora_rank"]
    qk_rope_head_dim: int = HF_DEFAULTS["qk_rope_head_dim"]
    v_head_dim: int = HF_DEFAULTS["v_head_dim"]
    qk_nope_head_dim: int = HF_DEFAULTS["qk_nope_head_dim"]
    n_group: int = HF_DEFAULTS["n_group"]
    topk_group: int = HF_DEFAULTS["topk_group"]
    num_experts_per_tok: int = HF_DEFAULTS["num_experts_per_tok"]
    first_k_dense_replace: int = HF_DEFAULTS["first_k_dense_replace"]
    norm_topk_prob: bool = HF_DEFAULTS["norm_topk_prob"]
    max_position_embeddings: int = HF_DEFAULTS["max_position_embeddings"]
    rms_norm_eps: float = HF_DEFAULTS["rms_norm_eps"]
    rope_theta: float = HF_DEFAULTS["rope_theta"]
    rope_scaling: YarnConfig | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = HF_DEFAULTS["bos_token_id"]
    eos_token_ids: tuple[int, ...] = (1,)
    # Raw compressed-tensors quantization_config (validated by kdtree_engine.quant), or None.
    quantization: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived values ------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent cache entry: kv_lora_rank + qk_rope_head_dim (576 for K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
            "qk_nope_head_dim", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"config field 'q_lora_rank' must be positive or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"config field 'first_k_dense_replace' must be in [0, num_hidden_layers="
                f"{self.num_hidden_layers}], got {self.first_k_dense_replace}")
        if self.first_k_dense_replace < self.num_hidden_layers:
            # MoE layers exist: their fields must be consistent.
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
            if self.n_shared_experts < 0:
                raise ConfigError(f"config field 'n_shared_experts' must be >= 0, got {self.n_shared_experts}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(
                    f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                    f"'n_routed_experts' ({self.n_routed_experts})")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(
                    f"config field 'n_group' ({self.n_group}) must divide 'n_routed_experts' ({self.n_routed_experts})")
            if self.topk_group > self.n_group:
                raise ConfigError(f"config field 'topk_group' ({self.topk_group}) exceeds 'n_group' ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ConfigError(
                    f"config field 'n_group' ({self.n_group}) leaves fewer than 2 experts per group")
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(
                    f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds the experts in "
                    f"'topk_group' ({self.topk_group}) groups of {per_group}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"config field 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"config field 'rope_theta' must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            if not self.rope_scaling.factor >= 1.0:
                raise ConfigError(f"config field 'rope_scaling.factor' must be >= 1, got {self.rope_scaling.factor}")
            if self.rope_scaling.original_max_position_embeddings <= 0:
                raise ConfigError("config field 'rope_scaling.original_max_position_embeddings' must be positive")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"config field 'eos_token_id' ({t}) is outside the vocabulary ({self.vocab_size})")

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``<dir>/config.json`` (or a path to the JSON file itself)."""
        return read_config_json(path, cls.from_dict, ConfigError)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        text, quant = _text_section(raw)
        for name in REQUIRED_FIELDS:
            if name not in text or text[name] is None:
                raise ConfigError(f"required config field '{name}' is missing")

        def get(name: str) -> Any:
            # An explicit null means "absent" except for q_lora_rank, where null = no q LoRA.
            if name in text and (text[name] is not None or name == "q_lora_rank"):
                return text[name]
            return HF_DEFAULTS[name]

        if get("hidden_act") != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {get('hidden_act')!r}")
        if get("attention_bias"):
            raise ConfigError("config field 'attention_bias' = true is not supported (K2 has no attention bias)")
        if get("scoring_func") != "sigmoid":
            raise ConfigError(f"config field 'scoring_func' must be 'sigmoid', got {get('scoring_func')!r}")
        if get("topk_method") not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ConfigError(f"config field 'topk_method' {get('topk_method')!r} is not supported")
        if get("moe_layer_freq") != 1:
            raise ConfigError(f"config field 'moe_layer_freq' must be 1, got {get('moe_layer_freq')!r}")
        nkv = text.get("num_key_value_heads")
        if nkv is not None and nkv != text["num_attention_heads"]:
            raise ConfigError(
                f"config field 'num_key_value_heads' ({nkv}) must equal 'num_attention_heads' "
                f"({text['num_attention_heads']}) for MLA")
        if text.get("num_nextn_predict_layers"):
            pass  # MTP layers exist in the file; the loader skips them.
        theta, scaling = _rope(text)
        eos = text.get("eos_token_id", HF_DEFAULTS["eos_token_id"])
        eos_ids: tuple[int, ...] = () if eos is None else (
            tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("rope_theta", "rope_scaling", "eos_token_ids", "quantization"):
                continue
            if f.name in text or f.name in HF_DEFAULTS:
                kwargs[f.name] = get(f.name)
        for name, typ in (("routed_scaling_factor", float), ("rms_norm_eps", float)):
            kwargs[name] = _typed(name, kwargs[name], typ)
        return cls(**kwargs, rope_theta=theta, rope_scaling=scaling, eos_token_ids=eos_ids,
                   quantization=quant)

    def to_dict(self) -> dict[str, Any]:
        """An HF-style ``config.json`` dict (model_type deepseek_v3) that round-trips."""
        d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            if f.name in ("rope_scaling", "eos_token_ids", "quantization"):
                continue
            d[f.name] = getattr(self, f.name)
        d["num_key_value_heads"] = self.num_attention_heads
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        d["topk_method"] = "noaux_tc"
        d["scoring_func"] = "sigmoid"
        d["rope_scaling"] = None if self.rope_scaling is None else {
            "type": "yarn", "rope_type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if self.quantization is not None:
            d["quantization_config"] = dict(self.quantization)
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def read_config_json(path: str | Path, parse: Callable[[dict], T], error: type[ConfigError]) -> T:
    """Load ``<dir>/config.json`` (or the JSON file itself) and parse it; errors name the file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise error(f"no config.json in {path}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{file}: not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise error(f"{file}: top level must be a JSON object")
    try:
        return parse(raw)
    except error as e:
        raise error(f"{file}: {e}") from None


def _typed(name: str, value: Any, typ: type) -> Any:
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config field '{name}' must be a {typ.__name__}, got {value!r}") from None


def _text_section(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type in WRAPPER_MODEL_TYPES or any(a in WRAPPER_ARCHITECTURES for a in archs):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config field 'text_config' is missing (required for model_type {model_type!r})")
        inner = text.get("model_type", "kimi_k2")
        if inner not in TEXT_MODEL_TYPES:
            raise ConfigError(f"config field 'text_config.model_type' must be one of {TEXT_MODEL_TYPES}, got {inner!r}")
        quant = raw.get("quantization_config") or text.get("quantization_config")
        return text, quant
    if model_type is None:
        raise ConfigError("required config field 'model_type' is missing")
    if model_type not in TEXT_MODEL_TYPES:
        raise ConfigError(
            f"config field 'model_type' must be one of {TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES}, got {model_type!r}")
    return raw, raw.get("quantization_config")


def _rope(text: Mapping[str, Any]) -> tuple[float, YarnConfig | None]:
    """Returns (rope_theta, yarn or None) from classic keys or ``rope_parameters``."""
    params = text.get("rope_parameters")
    scaling = text.get("rope_scaling")
    theta = text.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    theta = HF_DEFAULTS["rope_theta"] if theta is None else _typed("rope_theta", theta, float)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"config field 'rope_scaling.type' {kind!r} is not supported (only 'yarn')")
    for name in ("factor", "original_max_position_embeddings"):
        if scaling.get(name) is None:
            raise ConfigError(f"required config field 'rope_scaling.{name}' is missing")
    yarn = YarnConfig(
        factor=_typed("rope_scaling.factor", scaling["factor"], float),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=_typed("rope_scaling.beta_fast", scaling.get("beta_fast", 32.0) or 32.0, float),
        beta_slow=_typed("rope_scaling.beta_slow", scaling.get("beta_slow", 1.0) or 1.0, float),
        mscale=_typed("rope_scaling.mscale", scaling.get("mscale", 1.0) if scaling.get("mscale") is not None else 1.0, float),
        mscale_all_dim=_typed("rope_scaling.mscale_all_dim", scaling.get("mscale_all_dim", 0.0) or 0.0, float),
    )
    return theta, yarn


# ---- presets -----------------------------------------------------------------------------------

def _k2() -> ModelConfig:
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
        intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1, n_routed_experts=384,
        routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=262144,
        rms_norm_eps=1e-5, rope_theta=50000.0,
        rope_scaling=YarnConfig(factor=64.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=163584, eos_token_ids=(163586,),
    )


def _k2_tiny() -> ModelConfig:
    """Small K2-shaped model for tests: every mechanism on (YaRN, group routing, 2 dense layers)."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.827, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=50000.0,
        rope_scaling=YarnConfig(factor=8.0, original_max_position_embeddings=256, beta_fast=32.0,
                                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0, eos_token_ids=(1,),
    )


def _moonlight_16b() -> ModelConfig:
    """moonshotai/Moonlight-16B-A3B (its config.json): the DeepSeek-V3 architecture at 2048 hidden, 27 layers (the
    first dense), 64 routed experts top-6 + 2 shared, no query LoRA, no rope scaling, Kimi's vocabulary; BF16."""
    return ModelConfig(
        vocab_size=163840, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        intermediate_size=11264, moe_intermediate_size=1408, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None,
        bos_token_id=163584, eos_token_ids=(163586,),
    )


PRESETS = {"k2": _k2, "k2-tiny": _k2_tiny, "moonlight-16b": _moonlight_16b}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
