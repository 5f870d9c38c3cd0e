"""Prometheus metrics of the server, in vLLM's naming style with a ``kdtree:`` prefix (docs/serve.md lists them).

One :class:`ServeMetrics` per server, on its own registry (no process-wide state): the app exposes
``registry`` at ``GET /metrics``. Counters carry prometheus-client's ``_total`` suffix when exposed.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "kdtree:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
TAU_BUCKETS = tuple(float(i) for i in range(1, 17)) + (24.0, 32.0)

FINISHED_REASONS = ("stop", "length", "abort", "error")

__all__ = ["CONTENT_TYPE_LATEST", "FINISHED_REASONS", "ServeMetrics"]


class ServeMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ("model_name",)
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + extra, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        self.success = counter("request_success", "Requests finished, by finish reason (abort: cancelled, a client "
                               "gone or a shutdown; error: the engine failed)", ("finished_reason",))
        self.rejected = counter("request_rejected", "Requests answered with an error status before generating, "
                                "by HTTP status code", ("status_code",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that ran")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (those counted in usage)")
        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival (queue time included) to "
                              "its first generated token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens: each round's time "
                             "after the previous one, divided over the tokens it emitted", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From a request's arrival to its end", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a request waited in the queue (before it "
                                    "joined the batch or started)",
                                    REQUEST_BUCKETS)
        self.waiting = gauge("num_requests_waiting", "Requests waiting: in the queue, or in the batch without "
                             "cache blocks yet")
        self.running = gauge("num_requests_running", "Requests generating (in the batch with their cache blocks; "
                             "at most one without batching)")
        self.cache_usage = gauge("kv_cache_usage_perc", "Fraction of the latent cache pool's blocks held by "
                                 "requests (updated by the continuous batch after each step; 0 without batching)")
        self.rounds = counter("spec_decode_num_rounds", "Decoding rounds after the prefill (one token each "
                              "without a drafter)")
        self.drafted = counter("spec_decode_num_draft_tokens", "Draft tokens proposed (tree nodes below the root)")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens excluded)")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Rounds whose draft at this depth "
                               "(0 = the first drafted token) was accepted", ("position",))
        self.tau = histogram("spec_decode_tokens_per_round", "Tokens emitted per round (accepted drafts and the "
                             "bonus token; tau)", TAU_BUCKETS)
        self.verify_s = counter("spec_decode_verify_seconds", "Time spent verifying trees (host-driven rounds "
                                "only: a round replayed from a CUDA graph has no stage timers)")
        self.verify = histogram("spec_decode_verify_time_per_round_seconds", "A request's verify time divided by "
                                "its rounds, observed once per request (host-driven rounds only)", LATENCY_BUCKETS)
        self.waiting.labels(model_name).set(0)
        self.running.labels(model_name).set(0)
        self.cache_usage.labels(model_name).set(0)

    def label(self, metric: Any, **labels: str) -> Any:
        return metric.labels(model_name=self.model_name, **labels)

    def observe_rounds(self, counts: list[int]) -> None:
        """The emitted-token count of each round after the prefill (the last one may be cut by a stop)."""
        tau = self.label(self.tau)
        for n in counts:
            tau.observe(n)

    def observe_stats(self, stats: dict[str, Any]) -> None:
        """A finished request's speculative statistics (``GenerationResult.stats``)."""
        self.label(self.rounds).inc(stats.get("rounds", 0))
        if stats.get("spec", "none") == "none":
            return
        self.label(self.drafted).inc(stats.get("draft_tokens", 0))
        self.label(self.accepted).inc(stats.get("accepted_tokens", 0))
        for depth, n in enumerate(stats.get("accepted_per_depth", ())):
            if n:
                self.label(self.per_pos, position=str(depth)).inc(n)
        if "verify_s" in stats and "rounds_mode" not in stats and stats.get("rounds"):
            self.label(self.verify_s).inc(stats["verify_s"])
            self.label(self.verify).observe(stats["verify_s"] / stats["rounds"])

    def finished(self, reason: str) -> None:
        self.label(self.success, finished_reason=reason).inc()

    def reject(self, status: int) -> None:
        self.label(self.rejected, status_code=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
