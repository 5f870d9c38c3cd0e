"""The one reader of the engine's ``KDTREE_*`` environment variables (docs/environment.md lists them).

Read when :func:`read_env` is called, never at import, so a process may change them between engines; a
value outside its set is a ``ValueError`` that names the variable. A ``KDTREE_*`` variable the engine does not
read (a removed knob, a typo) is logged as a warning, once, rather than silently ignored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from .logs import log

BACKENDS = ("torch", "triton")
INT4_BACKENDS = BACKENDS + ("frag",)

# variable -> allowed values (unset or empty: the automatic choice)
VARIABLES: dict[str, tuple[str, ...]] = {
    "KDTREE_INT4_BACKEND": INT4_BACKENDS,
    "KDTREE_DENSE_BACKEND": BACKENDS,
    "KDTREE_ATTN_BACKEND": BACKENDS,
    "KDTREE_TREE_BACKEND": BACKENDS,
}
# the commit a benchmark record names where the checkout's git metadata is not the code's (a copy of a work tree)
RECORD_COMMIT = "KDTREE_RECORD_COMMIT"
_COMMIT = re.compile(r"[0-9a-f]{7,40}(-dirty)?")


# unknown variables already warned about: logging only
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Env:
    """The forced kernel backends (None: the automatic choice)."""

    int4_backend: str | None = None    # KDTREE_INT4_BACKEND: W4A16 linears and MoE
    dense_backend: str | None = None   # KDTREE_DENSE_BACKEND: dense / per-head GEMMs, norms, tails, row select
    attn_backend: str | None = None    # KDTREE_ATTN_BACKEND: MLA attention
    tree_backend: str | None = None    # KDTREE_TREE_BACKEND: DDTree builder and accept walk of device rounds
    record_commit: str | None = None   # KDTREE_RECORD_COMMIT: the commit benchmark records name


def _choice(environ: Mapping[str, str], var: str) -> str | None:
    value = environ.get(var) or None
    allowed = VARIABLES[var]
    if value is not None and value not in allowed:
        raise ValueError(f"{var} must be one of {', '.join(allowed)} (or unset), got {value!r}")
    return value


def read_env(environ: Mapping[str, str] | None = None) -> Env:
    """The ``KDTREE_*`` variables of ``environ`` (default: ``os.environ``, read now)."""
    environ = os.environ if environ is None else environ
    for var in sorted(v for v in environ if v.startswith("KDTREE_") and v not in VARIABLES and v != RECORD_COMMIT):
        if var not in _WARNED:
            _WARNED.add(var)
            log.warning(f"{var} is set but the engine does not read it (docs/environment.md lists the variables "
                        "it reads)")
    return Env(int4_backend=_choice(environ, "KDTREE_INT4_BACKEND"),
               dense_backend=_choice(environ, "KDTREE_DENSE_BACKEND"),
               attn_backend=_choice(environ, "KDTREE_ATTN_BACKEND"),
               tree_backend=_choice(environ, "KDTREE_TREE_BACKEND"),
               record_commit=_commit(environ))


def _commit(environ: Mapping[str, str]) -> str | None:
    value = environ.get(RECORD_COMMIT) or None
    if value is not None and not _COMMIT.fullmatch(value):
        raise ValueError(f"{RECORD_COMMIT} must be a git commit (7 to 40 hex digits, optionally -dirty), got {value!r}")
    return value
