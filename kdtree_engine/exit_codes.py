"""Exit codes of the ``kdtree`` commands and the error types that mean bad input.

0 success; 1 a check found a mismatch (``golden check``); 2 bad input: any of :data:`BAD_INPUT_ERRORS`
(missing or unreadable model, bad flag value, prompt too long, corrupt bundle), printed without a traceback;
3 a rank of a tensor-parallel engine died (``--tp``), one line.
"""

from __future__ import annotations

from .errors import (BadInput, BundleError, ConfigError, DraftConfigError, DraftLoadError, DraftMismatchError,
                     LoadError, PromptError, QuantError, SamplingError, SpecError, WeightsError)

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
EXIT_RANK_FAILED = 3

BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    BadInput, ConfigError, DraftConfigError, QuantError, SamplingError, PromptError, LoadError, FileNotFoundError,
    SpecError, DraftLoadError, DraftMismatchError, WeightsError, BundleError)
