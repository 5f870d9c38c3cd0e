"""The engine's logger and the once-per-key logs: automatic decisions (DEBUG) and warnings.

Automatic choices (device, dtype, kernels, round mode, ...) are logged once each at DEBUG: the CLI's ``-v``
shows them; a plain run keeps one INFO line for the load and prints one line for the result.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kdtree_engine")

# Keys already logged: only suppresses repeats of a message, never changes what runs.
_LOGGED: set[str] = set()


def log_once(key: str, msg: str) -> None:
    """Log an automatic choice (at DEBUG) the first time it is made."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.debug(msg)


def warn_once(key: str, msg: str) -> None:
    """Log a warning the first time ``key`` comes up (a request repeated with the same settings warns once)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg)
