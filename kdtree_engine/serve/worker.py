"""The engine's one worker thread and its bounded FIFO queue.

The thread owns the model and runs the queued requests in one of two ways:

- :class:`BatchWorker` (continuous batching, the default at tp 1): the thread owns a
  :class:`~kdtree_engine.batch.Scheduler`; at each turn of its loop every newly queued request joins the batch, one
  step runs (one batched forward over every request's round and the next prompt chunks), and the requests that
  ended are reported;
- :class:`SerialWorker` (one request at a time, ``--no-batching`` or ``--tp N > 1``): each request runs the whole
  generation loop (``llm.generate``) in arrival order.

Either way each round's text goes to the request's asyncio queue through ``loop.call_soon_threadsafe``
(:class:`Reply`, shared by both). Each request has a cancel flag read at every round boundary (the per-round
callback returns True to end it; in the batch its sequence is cancelled too, so a request still in prefill ends at
the next step): a client gone or a shutdown frees the engine at the next round. A stop string ends the request at
the round that completes it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..sampling import SamplingParams
from ..speculative.decode import GenerationResult, OnTokens
from .detok import Detokenizer
from .metrics import ServeMetrics
from .stops import StopMatcher

log = logging.getLogger("kdtree_engine.serve")

# The engine call of the one-at-a-time path: prompt ids, parameters, the per-round callback -> the result.
Generate = Callable[[list[int], SamplingParams, Callable[[list[int]], bool]], GenerationResult]
# The batched path: a new scheduler, and a request queued on it (scheduler, prompt ids, parameters, the per-round
# callback -> its batch Sequence, whose ``result`` is set when it ends).
MakeScheduler = Callable[[], Any]
Join = Callable[[Any, list[int], SamplingParams, OnTokens], Any]
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


class Reply:
    """One started request's side of the stream: text and metrics per round (:meth:`on_tokens`, the engine's
    per-round callback) and its end (:meth:`finish`). Made when the request leaves the queue."""

    def __init__(self, job: Job, decode: Decode, metrics: ServeMetrics) -> None:
        self.job, self.m = job, metrics
        self.last = time.perf_counter()
        metrics.label(metrics.queue_time).observe(self.last - job.arrived)
        self.detok, self.matcher = Detokenizer(decode), StopMatcher(job.stops)
        self.counted = 0              # tokens up to the one that completed a stop string
        self.rounds: list[int] = []   # emitted tokens per round after the prefill

    def on_tokens(self, tokens: list[int]) -> bool:
        """One round's tokens: detokenized, matched against the stop strings, sent; True ends the request (a stop
        string completed, or the request was cancelled)."""
        m, now = self.m, time.perf_counter()
        if self.counted == 0:
            m.label(m.ttft).observe(now - self.job.arrived)
        else:
            self.rounds.append(len(tokens))
            for _ in tokens:
                m.label(m.itl).observe((now - self.last) / len(tokens))
        self.last = now
        text = ""
        for t in tokens:
            self.counted += 1
            text += self.matcher.push(self.detok.push(t))
            if self.matcher.stopped:
                break
        if text:
            self.job.send(Delta(text))
        return self.matcher.stopped or self.job.cancelled.is_set()

    def finish(self, res: GenerationResult) -> Done:
        """The request's end: the text held back (unless it was cut) and its metrics; its Done, to send once the
        worker's books show it ended."""
        job, m, matcher = self.job, self.m, self.matcher
        if res.finish_reason == "abort" and not matcher.stopped:
            reason = "abort"
        else:
            reason = "stop" if matcher.stopped else res.finish_reason
            tail = "" if matcher.stopped else matcher.push(self.detok.finish()) + matcher.flush()
            if matcher.stopped:
                reason = "stop"
            if tail:
                job.send(Delta(tail))
        m.observe_rounds(self.rounds)
        m.observe_stats(res.stats)
        m.label(m.prompt_tokens).inc(len(job.prompt_ids))
        m.label(m.generation_tokens).inc(self.counted)
        m.label(m.e2e).observe(time.perf_counter() - job.arrived)
        m.finished(reason)
        log.debug("request %d: %s, %d prompt and %d generated tokens", job.id, reason, len(job.prompt_ids),
                  self.counted)
        return Done(reason, len(job.prompt_ids), self.counted)


class Worker:
    """The queue and the thread; subclasses say how the queued requests run (:meth:`loop`).

    ``max_queue`` bounds the requests waiting: those in the queue and, with batching, those inside the batch that
    hold no cache yet (its admission waits for cache blocks)."""

    def __init__(self, decode: Decode, metrics: ServeMetrics, max_queue: int) -> None:
        self.decode = decode
        self.metrics = metrics
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.running: set[Job] = set()   # taken from the queue, not yet reported as ended
        self.held = 0                    # of those, inside the batch but holding no cache yet (counted as waiting)
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
            if len(self.waiting) + self.held >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            job.id = next(self.ids)
            self.waiting.append(job)
            self.gauges()
            self.cond.notify()

    def close(self) -> None:
        """Refuse new requests from now on (a plain flag: a signal handler calls it)."""
        self.closed = True

    def cancel(self, job: Job) -> None:
        """End a job: one still in the queue leaves it now (its slot is free), a started one ends at the next
        round boundary; a finished one is left alone."""
        with self.cond:
            if not job.cancelled.is_set():
                log.debug("request %d: cancelled (%s)", job.id, "running" if job in self.running else "waiting")
            job.cancel()
            if job in self.waiting:
                self.waiting.remove(job)
                self.gauges()
                self.metrics.finished("abort")
                job.send(Done("abort", len(job.prompt_ids), 0))

    def stop(self, timeout: float) -> bool:
        """Cancel what waits and what runs; True when the thread ended within ``timeout`` seconds."""
        with self.cond:
            self.stopping = True
            for job in list(self.waiting) + list(self.running):
                self.cancel(job)
            self.cond.notify_all()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def gauges(self) -> None:
        """The waiting and running gauges (called with ``cond`` held)."""
        m = self.metrics
        m.label(m.waiting).set(len(self.waiting) + self.held)
        m.label(m.running).set(len(self.running) - self.held)

    def ended(self, job: Job) -> None:
        """A started job was reported."""
        with self.cond:
            self.running.discard(job)
            self.gauges()

    def fail(self, job: Job, e: Exception) -> None:
        """The engine failed on this request: report it (the others keep being served)."""
        log.error("request %d failed", job.id, exc_info=e)
        self.metrics.finished("error")
        self.ended(job)
        job.send(Failed(f"the engine failed on this request: {type(e).__name__}: {e}"))

    def report(self, reply: Reply, res: GenerationResult) -> None:
        """A started job's end (the gauges count it out before its client hears of it)."""
        try:
            done = reply.finish(res)
        except Exception as e:
            self.fail(reply.job, e)
            return
        self.ended(reply.job)
        reply.job.send(done)

    def loop(self) -> None:
        raise NotImplementedError


class SerialWorker(Worker):
    """Runs jobs one at a time, in arrival order, each through the whole generation loop."""

    def __init__(self, generate: Generate, decode: Decode, metrics: ServeMetrics, max_queue: int) -> None:
        super().__init__(decode, metrics, max_queue)
        self.generate = generate

    def take_one(self) -> Job | None:
        with self.cond:
            while not self.waiting and not self.stopping:
                self.cond.wait()
            if not self.waiting:
                return None
            job = self.waiting.popleft()
            self.running.add(job)
            self.gauges()
            return job

    def loop(self) -> None:
        while (job := self.take_one()) is not None:
            try:
                reply = Reply(job, self.decode, self.metrics)
                res = self.generate(job.prompt_ids, job.params, reply.on_tokens)
            except Exception as e:
                self.fail(job, e)
                continue
            self.report(reply, res)


class BatchWorker(Worker):
    """Runs jobs concurrently through one continuous batch: each turn of the loop moves every queued job into the
    scheduler, runs one step, and reports the requests that ended. Idle (nothing queued, the batch empty): it
    waits on the condition."""

    def __init__(self, make_scheduler: MakeScheduler, join: Join, decode: Decode, metrics: ServeMetrics,
                 max_queue: int) -> None:
        super().__init__(decode, metrics, max_queue)
        self.make_scheduler, self.join = make_scheduler, join
        self.scheduler = make_scheduler()   # made now: a bad setting fails at start, not in the thread
        self.inside: dict[Any, Reply] = {}   # the scheduler's sequences -> their replies

    def loop(self) -> None:
        while (jobs := self.take()) is not None:
            for job in jobs:
                self.start_job(job)
            for seq, reply in self.inside.items():
                if reply.job.cancelled.is_set():
                    seq.cancel()   # ends at this step, wherever it is (waiting, prefill or decoding)
            try:
                done = self.scheduler.step()
            except Exception as e:   # the batch's forward failed: every request in it fails, a new batch starts
                self.fail_batch(e)
                continue
            pool = self.scheduler.pool
            self.metrics.label(self.metrics.cache_usage).set(1.0 - pool.free_blocks / max(pool.num_blocks, 1))
            with self.cond:
                self.held = len(self.scheduler.waiting)
                self.gauges()
            for seq in done:
                self.report(self.inside.pop(seq), seq.result)

    def take(self) -> list[Job] | None:
        """Every queued job (into the batch: counted as held), once there is one or the batch has work (no busy
        wait: idle, the thread sleeps on the condition); None once stopping with nothing queued and the batch
        empty."""
        with self.cond:
            while not self.waiting and not self.stopping and self.scheduler.idle:
                self.cond.wait()
            if not self.waiting and self.scheduler.idle:
                return None
            jobs = list(self.waiting)
            self.waiting.clear()
            self.running.update(jobs)
            self.held += len(jobs)
            return jobs

    def start_job(self, job: Job) -> None:
        """Into the batch (a request it refuses fails alone); one that ends at once is reported now."""
        try:
            reply = Reply(job, self.decode, self.metrics)
            seq = self.join(self.scheduler, job.prompt_ids, job.params, reply.on_tokens)
        except Exception as e:
            self.release_held()
            self.fail(job, e)
            return
        if seq.done:
            self.release_held()
            self.report(reply, seq.result)
        else:
            self.inside[seq] = reply

    def release_held(self) -> None:
        """A job taken into the batch never reached its waiting list."""
        with self.cond:
            self.held -= 1

    def fail_batch(self, e: Exception) -> None:
        """Fail every request inside the batch and give their cache blocks back; a new scheduler takes over."""
        log.error("a batched forward failed (%d requests inside)", len(self.inside), exc_info=e)
        try:
            self.scheduler.drop_all()
        except Exception:   # the requests still fail below (never left waiting); the blocks may be lost
            log.exception("the failed batch's requests could not be ended cleanly")
        self.scheduler = self.make_scheduler()
        inside, self.inside = self.inside, {}
        with self.cond:
            self.held = 0
        for reply in inside.values():
            self.fail(reply.job, e)
