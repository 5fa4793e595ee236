"""Prometheus metrics (`GET /metrics`), in a registry of this app's own (several apps may share a process).

Engine state and counters are read at scrape time from `engine.stats` (the engine knows nothing of
Prometheus); request latencies are observed by the handlers; HTTP counts by a small ASGI middleware.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from looped_lm.engine.engine import Engine

PREFIX = "looped_lm"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Queue lengths, slots and token / iteration counters of the engine, read on every scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e, s = self.engine, self.engine.stats
        for name, doc, value in (
            ("num_requests_running", "requests holding a KV slot", e.num_running),
            ("num_requests_waiting", "requests queued for a KV slot", e.num_waiting),
            ("kv_slots", "KV cache slots (concurrent sequences)", s.num_slots),
            ("kv_slots_free", "KV cache slots free now", e.num_free_slots),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        for name, doc, value in (
            ("requests", "requests the engine accepted", s.requests),
            ("prompt_tokens", "prompt tokens processed (prefilled or scored)", s.prompt_tokens),
            ("generation_tokens", "tokens generated", s.generation_tokens),
            ("iterations", "denoising iterations run, summed over generated tokens: K each, fewer "
                           "under an adaptive exit rule (1 per token without K)",
             s.iterations),
            ("engine_steps", "engine steps", s.steps),
            ("decode_calls", "batched decode forwards (one per K group per step)", s.decode_calls),
            ("decoded_rows", "rows advanced by decode forwards (/ decode_calls = mean batch)", s.decoded_rows),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        finished = CounterMetricFamily(f"{PREFIX}_requests_finished", "engine requests by finish reason",
                                       labels=["finish_reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([reason], count)
        yield finished


class ServerMetrics:
    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests", ["method", "path", "status"],
                                     registry=r)
        self.e2e_latency = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "request latency, arrival to last "
                                     "token", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first generated token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.request_iterations = Histogram(f"{PREFIX}_request_num_iterations", "K of each request",
                                            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.choices = Counter(f"{PREFIX}_choices_finished", "choices returned, by finish reason",
                               ["endpoint", "finish_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, endpoint: str, num_iterations: int | None) -> "RequestTimer":
        if num_iterations is not None:
            self.request_iterations.observe(num_iterations)
        return RequestTimer(self, endpoint)


class RequestTimer:
    """Times one API request: first token, end."""

    def __init__(self, metrics: ServerMetrics, endpoint: str):
        self.metrics, self.endpoint, self.start, self.first = metrics, endpoint, time.perf_counter(), None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.metrics.ttft.labels(self.endpoint).observe(self.first - self.start)

    def done(self, finish_reasons: list[str]) -> None:
        self.metrics.e2e_latency.labels(self.endpoint).observe(time.perf_counter() - self.start)
        for reason in finish_reasons:
            self.metrics.choices.labels(self.endpoint, reason).inc()


class HTTPMetricsMiddleware:
    """Counts responses by method, route path and status (unknown paths count as "other")."""

    def __init__(self, app, metrics: ServerMetrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def send_counted(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(scope["method"], path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counted)
