"""Python API: load a target (and later a drafter) and a tokenizer; generate.

    from kdtree_engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    out = llm.generate(["def quicksort(items):"], SamplingParams(max_tokens=64))[0]
    print(out.text, out.stats["tokens_per_s"])
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from .config import ModelConfig
from .kernels.dispatch import log_choices, prepare_int4
from .kernels.policy import KernelPolicy
from .logs import log_once
from .model.dflash import DFlashDrafter
from .model.target import Target
from .quant import QuantError, k2_quantization_config, parse_quantization_config
from .sampling import SamplingParams
from .speculative.decode import GenerationResult, generate, resolve_spec
from .weights import iter_checkpoint

log = logging.getLogger("kdtree_engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        log_once("device", f"device: {device} (automatic)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        log_once("dtype", f"dtype: {dtype} (automatic for {device.type})")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_target(path: str | Path, *, device: torch.device, dtype: torch.dtype,
                quantize: str | None = None, progress: bool = True, policy: KernelPolicy | None = None) -> Target:
    """Load an HF-format K2-family checkpoint directory, streaming shard by shard. ``policy``: the kernel
    policy (None: the environment's)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    cfg = ModelConfig.from_pretrained(path)
    scheme = parse_quantization_config(cfg.quantization)
    on_load = False
    if quantize not in (None, "none", "w4a16"):
        raise ValueError(f"--quantize must be none or w4a16, got {quantize!r}")
    if quantize == "w4a16":
        if scheme is not None:
            raise QuantError(f"{path}: the checkpoint is already quantized; drop --quantize w4a16")
        scheme = parse_quantization_config(k2_quantization_config(32))
        on_load = True
        log.info("quantizing routed experts to W4A16 (group 32) while loading")
    target = Target(cfg, dtype=dtype, device=device, quant=scheme, quantize_on_load=on_load, policy=policy)
    for name, tensor in iter_checkpoint(path, cfg, progress=progress):
        target.load_tensor(name, tensor)
    target.finish_loading()
    prepare_int4(target, dtype)   # INT4 words in the order of their kernels, before any capture
    return target


def target_from_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *, device: torch.device | str,
                        dtype: torch.dtype) -> Target:
    """Build a target from canonical-name tensors (e.g. a golden bundle); INT4 per cfg.quantization."""
    scheme = parse_quantization_config(cfg.quantization)
    target = Target(cfg, dtype=dtype, device=device, quant=scheme)
    return target.load_weights(weights.items())


def greedy_from_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], prompt_ids: list[int],
                        n_tokens: int, device: str | torch.device, dtype: torch.dtype) -> list[int]:
    """Greedy tokens (EOS ignored) of the engine on the given weights: what golden checks compare."""
    target = target_from_weights(cfg, weights, device=device, dtype=dtype)
    res = generate(target, prompt_ids, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
    return res.token_ids


def load_drafter(path: str | Path, target: Target):
    """A DFlash drafter directory, checked against the target (DraftMismatchError when it does not fit)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory {str(path)!r} does not exist")
    return DFlashDrafter.from_pretrained(path, target.cfg, dtype=target.dtype, device=target.device,
                                         policy=target.policy)


def load_tokenizer(path: str | Path):
    """The directory's tokenizer.json as a ``tokenizers.Tokenizer``, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(file))


class LLM:
    """A loaded model ready to generate."""

    def __init__(self, model: str | Path, *, draft: str | Path | None = None, spec: str = "none",
                 budget: int | str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
                 quantize: str | None = None, batch_invariant: bool = True, progress: bool = True,
                 eager: bool | None = None) -> None:
        """``eager``: True = rounds driven from the host; False = each round replayed from a CUDA graph
        (CUDA, a fixed budget); None = graphs where they apply (see ``speculative.decode.pick_round_mode``).
        ``batch_invariant`` and the ``KDTREE_*_BACKEND`` variables make the kernel policy of target and drafter."""
        self.policy = KernelPolicy.from_env(batch_invariant=batch_invariant)
        self.eager = eager
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if spec != "none" and draft is None:
            resolve_spec(spec, None, budget)  # raises the error that names --draft
        self.target = load_target(model, device=self.device, dtype=self.dtype, quantize=quantize, progress=progress,
                                  policy=self.policy)
        self.drafter = None if draft is None else load_drafter(draft, self.target)
        self.spec = resolve_spec(spec, self.drafter, budget)
        self.tokenizer = load_tokenizer(model)
        log_choices(self.policy, self.device)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json; pass token ids (--prompt-ids)")
            return self.tokenizer.encode(prompt).ids
        return [int(t) for t in prompt]

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None, *,
                 on_tokens: Callable[[list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts (text or token ids), one after another."""
        params = params or SamplingParams()
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        results = []
        for p in batch:
            res = generate(self.target, self.encode(p), params, spec=self.spec, drafter=self.drafter,
                           on_tokens=on_tokens, eager=self.eager)
            res.text = self.decode(res.token_ids)
            results.append(res)
        return results
