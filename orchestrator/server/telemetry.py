"""`GET /metrics`: Prometheus counters of the same quantities as `RunMetrics` (summed over all
requests), a histogram of the verification-step latency, and the queue's state."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from orchestrator.decoding.metrics import ENGINE_COUNTERS, RunMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST

# RunMetrics field → (counter name without the _total suffix, help)
COUNTERS = {
    "n_prompt_tokens": ("spac_prompt_tokens", "prompt tokens of all requests"),
    "n_prompt_cached": ("spac_prompt_tokens_cached", "prompt tokens reused from the KV cache (not computed)"),
    "n_tokens": ("spac_tokens_predicted", "generated tokens"),
    "n_steps": ("spac_verify_steps", "verification steps (autoregressive decodes without a draft)"),
    "n_drafted": ("spac_draft_tokens", "drafted tokens"),
    "n_accepted": ("spac_draft_tokens_accepted", "drafted tokens the target accepted"),
    "prefill_s": ("spac_prompt_seconds", "time spent on prompts"),
    "decode_s": ("spac_tokens_predicted_seconds", "time spent generating"),
    **{name: (f"spac_{name}", f"expert engine: {name.replace('_', ' ')}") for name in ENGINE_COUNTERS},
}

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Telemetry:
    """One registry per server (tests run several in one process)."""

    def __init__(self, status: Callable[[], dict]) -> None:
        self.registry = r = CollectorRegistry()
        self._counters = {field: Counter(name, doc, registry=r) for field, (name, doc) in COUNTERS.items()}
        self.requests = Counter("spac_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.step_seconds = Histogram("spac_verify_step_seconds", "latency of one verification step",
                                      buckets=STEP_BUCKETS, registry=r)
        Gauge("spac_requests_processing", "requests being generated", registry=r).set_function(
            lambda: status()["processing"])
        Gauge("spac_requests_queued", "requests waiting in the queue", registry=r).set_function(
            lambda: status()["queued"])

    def finished(self, m: RunMetrics) -> None:
        for field, counter in self._counters.items():
            value = getattr(m, field)
            if value:
                counter.inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
