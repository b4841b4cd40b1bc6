"""What ``/metrics`` shows, in the Prometheus text format (``prometheus_client``): counters the
engine keeps and gauges it reads at the time of the scrape, and histograms of each request's time
to first token, inter-token latency and latency, by method and budget (as vLLM exposes them)."""

from __future__ import annotations

import time
from collections import Counter, deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

WINDOW = 10.0  # seconds over which tokens/s is measured
# Seconds: from a decode step's milliseconds (inter-token) to a long prompt's prefill under a queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Stats:
    """Counters and peaks, written by the engine's thread under the engine's lock."""

    def __init__(self):
        self.requests: Counter = Counter()  # (method, budget, outcome) -> requests
        self.running_peak: Counter = Counter()  # (method, budget) -> most rows running at once
        self.shapes: dict[tuple, list[int]] = {}  # (method, budget) -> [requests, prompt tokens, max_tokens]
        self.prompt_tokens = self.generated_tokens = 0
        self.kv_bytes = self.kv_bytes_peak = self.waiting_peak = 0
        self._recent: deque = deque()  # (time, tokens) of the last WINDOW seconds
        self.registry = CollectorRegistry(auto_describe=False)  # this engine's own (a process may hold several)
        labels = ("budget", "method")
        self.ttft = Histogram("d2o_time_to_first_token_seconds", "From a request's arrival to its first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("d2o_inter_token_latency_seconds", "Between a request's consecutive tokens.",
                                     labels, buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        self.latency = Histogram("d2o_request_latency_seconds", "From a request's arrival to its last token.",
                                 labels, buckets=LATENCY_BUCKETS, registry=self.registry)

    def tokens_made(self, key: tuple, arrived: float, previous: float | None, tokens: int, now: float) -> None:
        """``tokens`` (>= 1) new tokens of a request of ``key`` (method, budget) at ``now``: its first
        if it had none before (``previous`` None), the gap since its previous otherwise (shared by the
        tokens, should a step bring more than one)."""
        method, budget = key
        if previous is None:
            self.ttft.labels(budget, method).observe(now - arrived)
            tokens -= 1
            previous = now
        for _ in range(tokens):
            self.inter_token.labels(budget, method).observe((now - previous) / max(tokens, 1))

    def finished(self, key: tuple, arrived: float, now: float) -> None:
        method, budget = key
        self.latency.labels(budget, method).observe(now - arrived)

    def admitted(self, key: tuple, prompt_tokens: int, max_tokens: int) -> None:
        shape = self.shapes.setdefault(key, [0, 0, 0])
        shape[0] += 1
        shape[1] += prompt_tokens
        shape[2] += max_tokens
        self.prompt_tokens += prompt_tokens

    def generated(self, tokens: int) -> None:
        now = time.monotonic()
        self.generated_tokens += tokens
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - WINDOW:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in self._recent if t >= now - WINDOW) / WINDOW

    def kv(self, in_use: int, peak: int = 0) -> None:
        """``in_use`` bytes held now; ``peak``: the most held since the last call, if more (a prefill's)."""
        self.kv_bytes = in_use
        self.kv_bytes_peak = max(self.kv_bytes_peak, in_use, peak)


HELP = {
    "requests_total": ("counter", "Requests by method, budget and outcome (finished, cancelled, rejected, failed)."),
    "requests_running": ("gauge", "Requests decoding now."),
    "requests_running_peak": ("gauge", "Most requests decoding at once."),
    "requests_waiting": ("gauge", "Requests queued for KV memory (the queue depth)."),
    "requests_waiting_peak": ("gauge", "Most requests queued at once."),
    "queue_capacity": ("gauge", "Requests the queue holds; beyond it, HTTP 503."),
    "prompt_tokens_total": ("counter", "Prompt tokens of admitted requests."),
    "generated_tokens_total": ("counter", "Tokens generated."),
    "generated_tokens_per_second": ("gauge", f"Tokens generated per second over the last {WINDOW:g} s."),
    "kv_bytes": ("gauge", "KV cache bytes held now (keys, values and their slots' bookkeeping, every running batch)."),
    "kv_bytes_peak": ("gauge", "Most KV cache bytes held at once (a prefill's whole prompt included)."),
    "kv_bytes_reserved": ("gauge", "KV bytes reserved: what admitted requests can hold at most, padding included."),
    "kv_bytes_cap": ("gauge", "The KV memory cap (--kv-memory)."),
    "prefix_cache_bytes": ("gauge", "KV bytes of the compressed prefixes kept (part of kv_bytes and of the cap)."),
    "prefix_cache_entries": ("gauge", "Compressed prefixes kept."),
    "prefix_cache_hits_total": ("counter", "Requests that began with a kept compressed prefix."),
    "prefix_cache_misses_total": ("counter", "Requests with a prefix cache that found none kept."),
    "prefix_cache_evictions_total": ("counter", "Kept prefixes evicted (least recently used) to make room."),
    "prompt_tokens_cached_total": ("counter", "Prompt tokens found compressed in the prefix cache, not prefilled."),
    "kv_fit_requests": ("gauge", "Requests of this method's mean shape (prompt, max_tokens) that fit at once."),
    "kv_fit_requests_full": ("gauge", "Requests of the same shape that fit at once with the full cache."),
}


class _Scraped:
    """``values`` as metric families, for ``generate_latest``."""

    def __init__(self, values: dict[str, object]):
        self.values = values

    def collect(self):
        for name, (kind, text) in HELP.items():
            value = self.values.get(name)
            if value is None:
                continue
            samples = sorted(value.items()) if isinstance(value, dict) else [((), value)]
            names = [key for key, _ in samples[0][0]] if samples else []
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"d2o_{name}", text,
                                                                                      labels=names)
            for labels, number in samples:
                family.add_metric([str(val) for _, val in labels], number)
            yield family


def render(values: dict[str, object], stats: Stats) -> bytes:
    """Prometheus text: ``values`` maps a metric name of ``HELP`` to a number or to {labels: number},
    labels as ((name, value), ...); the histograms of ``stats`` after them."""
    return generate_latest(_Scraped(values)) + generate_latest(stats.registry)
