"""The engine's one worker thread and its bounded FIFO queue.

The thread owns the model: it takes one request at a time (until batching lands), runs the generation loop and
hands text to the request's asyncio queue through ``loop.call_soon_threadsafe``. Each request has a cancel flag,
read at every round boundary (the generation loop's ``on_tokens`` returns True to end it): a client gone or a
shutdown frees the worker at the next round. A stop string ends the request at the round that completes it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..sampling import SamplingParams
from ..speculative.decode import GenerationResult
from .detok import Detokenizer
from .metrics import ServeMetrics
from .stops import StopMatcher

log = logging.getLogger("kdtree_engine.serve")

# The engine call the worker makes: prompt ids, parameters, the per-round callback -> the result.
Generate = Callable[[list[int], SamplingParams, Callable[[list[int]], bool]], GenerationResult]
Decode = Callable[[Sequence[int]], str]


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already (or the server is shutting down)."""


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str          # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)
class Job:
    """One request: what to run, where its events go, and its cancel flag."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    id: int = 0

    def send(self, event: Event) -> None:
        """From the worker thread: queue an event on the request's loop (a closed loop: nobody listens)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """Runs jobs one at a time on its own thread, in arrival order."""

    def __init__(self, generate: Generate, decode: Decode, metrics: ServeMetrics, max_queue: int) -> None:
        self.generate = generate
        self.decode = decode
        self.metrics = metrics
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.cond = threading.Condition()
        self.stopping = False
        self.closed = False      # no new requests (a shutdown began); those queued still run
        self.ids = itertools.count(1)
        self.thread = threading.Thread(target=self.loop, name="kdtree-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping or self.closed:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            job.id = next(self.ids)
            self.waiting.append(job)
            self.metrics.label(self.metrics.waiting).set(len(self.waiting))
            self.cond.notify()

    def close(self) -> None:
        """Refuse new requests from now on (a plain flag: a signal handler calls it)."""
        self.closed = True

    def cancel(self, job: Job) -> None:
        """End a job: one still waiting leaves the queue now (its slot is free), a running one ends at the next
        round boundary; a finished one is left alone."""
        with self.cond:
            if not job.cancelled.is_set():
                log.debug("request %d: cancelled (%s)", job.id, "running" if job is self.running else "waiting")
            job.cancel()
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.label(self.metrics.waiting).set(len(self.waiting))
                self.metrics.finished("abort")
                job.send(Done("abort", len(job.prompt_ids), 0))

    def stop(self, timeout: float) -> bool:
        """Cancel what waits and what runs; True when the thread ended within ``timeout`` seconds."""
        with self.cond:
            self.stopping = True
            for job in list(self.waiting) + ([self.running] if self.running else []):
                self.cancel(job)
            self.cond.notify_all()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def next_job(self) -> Job | None:
        with self.cond:
            while not self.waiting and not self.stopping:
                self.cond.wait()
            if not self.waiting:
                return None
            job = self.waiting.popleft()
            self.running = job
            self.metrics.label(self.metrics.waiting).set(len(self.waiting))
            self.metrics.label(self.metrics.running).set(1)
            return job

    def loop(self) -> None:
        while (job := self.next_job()) is not None:
            try:
                self.run(job)
            except Exception as e:  # the engine failed on this request: report it, keep serving the others
                log.exception("request %d failed", job.id)
                self.metrics.finished("error")
                job.send(Failed(f"the engine failed on this request: {type(e).__name__}: {e}"))
            finally:
                with self.cond:
                    self.running = None
                    self.metrics.label(self.metrics.running).set(0)

    def run(self, job: Job) -> None:
        m = self.metrics
        start = time.perf_counter()
        m.label(m.queue_time).observe(start - job.arrived)
        detok, matcher = Detokenizer(self.decode), StopMatcher(job.stops)
        counted = [0]            # tokens up to the one that completed a stop string
        rounds: list[int] = []   # emitted tokens per round after the prefill
        last = [start]

        def on_tokens(tokens: list[int]) -> bool:
            now = time.perf_counter()
            if counted[0] == 0:
                m.label(m.ttft).observe(now - job.arrived)
            else:
                rounds.append(len(tokens))
                for _ in tokens:
                    m.label(m.itl).observe((now - last[0]) / len(tokens))
            last[0] = now
            text = ""
            for t in tokens:
                counted[0] += 1
                text += matcher.push(detok.push(t))
                if matcher.stopped:
                    break
            if text:
                job.send(Delta(text))
            return matcher.stopped or job.cancelled.is_set()

        res = self.generate(job.prompt_ids, job.params, on_tokens)
        if res.finish_reason == "abort" and not matcher.stopped:
            reason = "abort"
        else:
            reason = "stop" if matcher.stopped else res.finish_reason
            tail = "" if matcher.stopped else matcher.push(detok.finish()) + matcher.flush()
            if matcher.stopped:
                reason = "stop"
            if tail:
                job.send(Delta(tail))
        m.observe_rounds(rounds)
        m.observe_stats(res.stats)
        m.label(m.prompt_tokens).inc(len(job.prompt_ids))
        m.label(m.generation_tokens).inc(counted[0])
        m.label(m.e2e).observe(time.perf_counter() - job.arrived)
        m.finished(reason)
        log.debug("request %d: %s, %d prompt and %d generated tokens", job.id, reason, len(job.prompt_ids),
                  counted[0])
        job.send(Done(reason, len(job.prompt_ids), counted[0]))
