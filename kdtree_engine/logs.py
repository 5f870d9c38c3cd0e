"""The engine's logger and the once-per-choice log of automatic decisions."""

from __future__ import annotations

import logging

log = logging.getLogger("kdtree_engine")

# Keys already logged: only suppresses repeats of a message, never changes what runs.
_LOGGED: set[str] = set()


def log_once(key: str, msg: str) -> None:
    """Log an automatic choice the first time it is made."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(msg)
