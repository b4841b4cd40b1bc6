"""One prefill, many methods: record what every method observes, then fork a cache per method.

A sweep of k methods x b budgets over one prompt needs the prompt's keys and values once, and
each method's view of the prefill statistics. ``SharedPrefill`` runs the prefill once under a
method that asks for the union of the statistics the methods need and lets each fold them into
its own namespace of slot state; ``fork`` then gives a method its own cache at its own budget,
sharing the prefill's key/value tensors (compression writes new tensors, never into old ones),
which compresses exactly as if that method had run the prefill alone.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch

from d2o.engine.cache import CompressedCache
from d2o.engine.stats import AttentionStats, StatsRequest
from d2o.methods.base import Method


class _Namespace(MutableMapping):
    """The slice ``"{i}/..."`` of a layer's slot state, seen by method i as its own dict."""

    def __init__(self, store: dict, prefix: str):
        self.store, self.prefix = store, prefix

    def __getitem__(self, key):
        return self.store[self.prefix + key]

    def __setitem__(self, key, value):
        self.store[self.prefix + key] = value

    def __delitem__(self, key):
        del self.store[self.prefix + key]

    def __iter__(self):
        return (key[len(self.prefix):] for key in self.store if key.startswith(self.prefix))

    def __len__(self):
        return sum(1 for _ in self)


class _View:
    """A layer (or cache) as method i sees it while observing: everything shared but its slot
    state (no method keeps per-layer state before it compresses, which is after the fork)."""

    def __init__(self, target, prefix: str):
        self._target, self._prefix = target, prefix
        self.state = None
        if hasattr(target, "slot_state"):
            self.slot_state = _Namespace(target.slot_state, prefix)
        if hasattr(target, "layers"):
            self.layers = [_View(layer, prefix) for layer in target.layers]

    def __getattr__(self, name):
        return getattr(self._target, name)


@dataclass
class _Observers(Method):
    """Records, for each of ``methods``, what it would observe during a prefill (never compresses)."""

    name = "shared-prefill"
    summary = "records the statistics of several methods at once"

    methods: list[Method] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        self.needs_surprisal = any(m.needs_surprisal for m in self.methods)

    def slot_state_bytes(self, group: int) -> int:
        return sum(method.slot_state_bytes(group) for method in self.methods)

    def requests(self, layer, n_query: int) -> list[StatsRequest | None]:
        return [m.stats_request(_View(layer, f"{i}/"), n_query) for i, m in enumerate(self.methods)]

    def stats_request(self, layer, n_query: int) -> StatsRequest | None:
        asked = [r for r in self.requests(layer, n_query) if r is not None]
        if not asked:
            return None
        return StatsRequest(column_mass=any(r.column_mass for r in asked), window=max(r.window for r in asked))

    def observe(self, layer, stats: AttentionStats) -> None:
        for i, (method, request) in enumerate(zip(self.methods, self.requests(layer, stats.n_query))):
            if request is None:
                continue
            window = stats.window[..., stats.window.shape[-2] - min(request.window, stats.window.shape[-2]) :, :] \
                if request.window else None
            mass = stats.column_mass if request.column_mass else None
            method.observe(_View(layer, f"{i}/"), AttentionStats(stats.n_query, column_mass=mass, window=window))

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None:
        for i, method in enumerate(self.methods):
            if method.needs_surprisal:
                method.observe_tokens(_View(cache, f"{i}/"), surprisal)


class SharedPrefill:
    """Prefill once for several methods; ``fork(i, budget)`` is method i's cache after that prefill."""

    def __init__(self, model, methods: list[Method]):
        self.methods = list(methods)
        self.cache = CompressedCache(model, _Observers(methods=self.methods), budget=1.0, observe=True)

    def fork(self, index: int, budget) -> CompressedCache:
        """Method ``index``'s own cache at ``budget``, compressed now if the method compresses after the prefill."""
        return self.cache.fork(self.methods[index], budget, slot_prefix=f"{index}/")
