"""The engine's error types: each names what is wrong (file, tensor, field, flag); the CLI maps them to exit codes."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file is missing a field or holds an inconsistent value."""


class DraftMismatchError(ValueError):
    """The drafter does not fit the target (hidden size, vocabulary or target layer ids)."""


class DraftLoadError(ValueError):
    """A drafter checkpoint is missing a tensor or holds one that does not fit."""


class LoadError(ValueError):
    """A tensor does not fit the model (name, expected and found value in the message)."""


class SamplingError(ValueError):
    """A sampling parameter is out of range."""


class QuantError(ValueError):
    """A quantization_config we cannot serve, or malformed quantized values."""


class PromptError(ValueError):
    """The prompt cannot be run (empty, too long, ids outside the vocabulary)."""


class SpecError(ValueError):
    """The speculative decoding settings are inconsistent (method, drafter, budget)."""


class WeightsError(ValueError):
    """A checkpoint that does not match the config (or cannot be read); the message names the tensor or file."""


class CacheFullError(RuntimeError):
    """A step would write past the cache's capacity."""


class BundleError(Exception):
    """A golden bundle is missing, unreadable or malformed."""


class DraftConfigError(ConfigError):
    """A drafter config.json is missing a field or holds an unsupported value."""



class RankFailure(RuntimeError):
    """A rank of a tensor-parallel engine died or a collective failed (timed out, a peer gone)."""


class BadInput(Exception):
    """Input the user can fix (a flag, a path, a prompt): the commands print it without a traceback, exit 2."""


class TokenizerError(BadInput):
    """A tokenizer file (tokenizer.json, tiktoken.model, tokenizer_config.json) that cannot be read; names the file."""


class ChatTemplateError(BadInput):
    """The chat template cannot render these messages (no template, no messages, a bad message, or the template
    raised); the message is one line naming the problem."""


class PoolFullError(PromptError):
    """A request needs more latent cache blocks than the pool has free; the message names both counts."""
