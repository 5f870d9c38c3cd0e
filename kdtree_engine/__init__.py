"""kdtree-engine: Kimi K2 family inference with INT4 experts and DFlash + DDTree speculative decoding.

    from kdtree_engine import LLM, SamplingParams
    out = LLM().generate("def quicksort(items):", SamplingParams(max_tokens=64))[0]   # the embedded demo
    print(out.text)   # the generated text only, without the prompt

See :class:`kdtree_engine.engine.LLM` and docs/cli.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "ModelConfig", "__version__"]

if TYPE_CHECKING:
    from .config import ModelConfig
    from .engine import LLM
    from .sampling import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: `import kdtree_engine` stays cheap (no torch import until used).
    if name == "LLM":
        from .engine import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    if name == "ModelConfig":
        from .config import ModelConfig
        return ModelConfig
    raise AttributeError(name)
