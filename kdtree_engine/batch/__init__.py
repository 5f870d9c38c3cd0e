"""Continuous batching: many requests in each target forward, each request's output that of its solo run."""

from .scheduler import DEFAULT_TOKEN_BUDGET, Scheduler
from .sequence import Sequence

__all__ = ["DEFAULT_TOKEN_BUDGET", "Scheduler", "Sequence"]
