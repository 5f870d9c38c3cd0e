"""Continuous batching (docs/batching.md): many requests in each target forward, each request's output that of its
solo run. The scheduler (scheduler.py: admission, the rows of a step, the end of a request), a request's state
(sequence.py) and the tree budgets under load (load_budget.py)."""
