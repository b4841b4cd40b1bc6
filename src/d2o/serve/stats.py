"""What ``/metrics`` shows, in the Prometheus text format: counters the engine keeps, gauges it
reads at the time of the scrape."""

from __future__ import annotations

import time
from collections import Counter, deque

WINDOW = 10.0  # seconds over which tokens/s is measured


class Stats:
    """Counters and peaks, written by the engine's thread under the engine's lock."""

    def __init__(self):
        self.requests: Counter = Counter()  # (method, budget, outcome) -> requests
        self.running_peak: Counter = Counter()  # (method, budget) -> most rows running at once
        self.shapes: dict[tuple, list[int]] = {}  # (method, budget) -> [requests, prompt tokens, max_tokens]
        self.prompt_tokens = self.generated_tokens = 0
        self.kv_bytes = self.kv_bytes_peak = self.waiting_peak = 0
        self._recent: deque = deque()  # (time, tokens) of the last WINDOW seconds

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

    def kv(self, in_use: int) -> None:
        self.kv_bytes = in_use
        self.kv_bytes_peak = max(self.kv_bytes_peak, in_use)


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


def render(values: dict[str, object]) -> str:
    """Prometheus text: ``values`` maps a metric name to a number or to {labels tuple: number},
    labels as ((name, value), ...)."""
    lines = []
    for name, (kind, text) in HELP.items():
        value = values.get(name)
        if value is None:
            continue
        lines += [f"# HELP d2o_{name} {text}", f"# TYPE d2o_{name} {kind}"]
        samples = value.items() if isinstance(value, dict) else [((), value)]
        for labels, number in sorted(samples):
            tags = ",".join(f'{key}="{val}"' for key, val in labels)
            text = str(number) if isinstance(number, int) else f"{number:.6g}"
            lines.append(f"d2o_{name}{{{tags}}} {text}" if tags else f"d2o_{name} {text}")
    return "\n".join(lines) + "\n"
