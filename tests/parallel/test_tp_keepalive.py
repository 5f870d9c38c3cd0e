"""Idle ranks stay in the group: every collective fails after the group's timeout, and the other ranks wait for
rank 0's next message in one, so rank 0 sends a no-op while idle (parallel/keepalive.py). At TP-2 with a 4 s
timeout, an engine left idle for 6 s, and an open batch left idle as long, still run their next requests with the
tokens they gave before."""

from __future__ import annotations

import time

import pytest

from kdtree_engine import LLM, SamplingParams
from kdtree_engine.errors import BadInput

PROMPT = [5, 6, 7, 8]
IDLE_S = 6.0


def test_idle_engine_and_idle_batch_keep_their_ranks() -> None:
    engine = LLM(spec="none", device="cpu", tp=2, threads=1, progress=False, tp_timeout_s=4.0)
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        first = engine.generate(PROMPT, params)[0].token_ids
        time.sleep(IDLE_S)   # past the collective timeout: only the keep-alive holds the other rank
        assert engine.generate(PROMPT, params)[0].token_ids == first
        sched = engine.scheduler()
        seq = engine.submit(sched, PROMPT, params)
        time.sleep(IDLE_S)   # the batch open, its request not yet stepped: the other rank waits for a step
        sched.run()
        assert seq.result.token_ids == first
        sched.close()
        assert engine._keepalive is not None and engine._keepalive.failed is None
    finally:
        engine.close()


def test_timeout_must_be_positive() -> None:
    with pytest.raises(BadInput, match="tp_timeout_s"):
        LLM(spec="none", device="cpu", tp=2, threads=1, progress=False, tp_timeout_s=0.0)
