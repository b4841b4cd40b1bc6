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
from dataclasses import dataclass, field, replace

import torch

from d2o.engine.cache import CompressedCache
from d2o.engine.policy import ProbePass
from d2o.engine.stats import AttentionStats, StatsRequest
from d2o.engine.storage import RowState
from d2o.errors import D2OError
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
    """A layer (or cache) as method ``index`` sees it while observing: everything shared but its
    slot state (the slice under ``prefix``) and its per-layer state (its part of ``_States``)."""

    def __init__(self, target, prefix: str, index: int):
        self._target, self._prefix = target, prefix
        if hasattr(target, "slot_state"):
            self.slot_state = _Namespace(target.slot_state, prefix)
            self.state = None if target.state is None else target.state.parts[index]
        if hasattr(target, "layers"):
            self.layers = [_View(layer, prefix, index) for layer in target.layers]

    def __getattr__(self, name):
        return getattr(self._target, name)


@dataclass
class _States(RowState):
    """Each method's own per-layer state, side by side."""

    parts: tuple = ()

    def map_rows(self, fn) -> _States:
        return _States(tuple(None if part is None else part.map_rows(fn) for part in self.parts))


@dataclass
class _Observers(Method):
    """Records, for each of ``methods``, what it would observe during a prefill (never compresses)."""

    name = "shared-prefill"
    summary = "records the statistics of several methods at once"

    methods: list[Method] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        self.needs_surprisal = any(m.needs_surprisal for m in self.methods)
        self.probes = any(m.probes for m in self.methods)

    def slot_state_bytes(self, group: int) -> int:
        return sum(method.slot_state_bytes(group) for method in self.methods)

    def new_layer_state(self) -> _States:
        return _States(tuple(method.new_layer_state() for method in self.methods))

    def requests(self, layer, n_query: int) -> list[StatsRequest | None]:
        """Each method's request; during a probe pass, only the request of the method it is for."""
        probing = layer.cache.probing
        return [m.stats_request(_View(layer, f"{i}/", i), n_query) if probing is None or probing.tag == i else None
                for i, m in enumerate(self.methods)]

    def stats_request(self, layer, n_query: int) -> StatsRequest | None:
        asked = [r for r in self.requests(layer, n_query) if r is not None]
        if not asked:
            return None
        if len(asked) == 1:
            return asked[0]
        if any(r.visible is not None for r in asked):
            raise D2OError("statistics restricted to some slots are asked for by one method at a time (a probe)")
        return StatsRequest(column_mass=any(r.column_mass for r in asked), window=max(r.window for r in asked),
                            column_max=any(r.column_max for r in asked), queries=any(r.queries for r in asked))

    def observe(self, layer, stats: AttentionStats) -> None:
        for i, (method, request) in enumerate(zip(self.methods, self.requests(layer, stats.n_query))):
            if request is None:
                continue
            window = stats.window[..., stats.window.shape[-2] - min(request.window, stats.window.shape[-2]) :, :] \
                if request.window else None
            mine = replace(stats, window=window, output=None,
                           column_mass=stats.column_mass if request.column_mass else None,
                           column_max=stats.column_max if request.column_max else None)
            if not request.queries:
                mine = replace(mine, queries=None, query_index=None, scaling=None)
            method.observe(_View(layer, f"{i}/", i), mine)

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> None:
        for i, method in enumerate(self.methods):
            if method.needs_surprisal:
                method.observe_tokens(_View(cache, f"{i}/", i), surprisal, input_ids)

    def probe(self, cache, prompts: list[list[int]]) -> list[ProbePass]:
        """Every method's probe passes, each tagged with the method it is for."""
        return [replace(probe, tag=i) for i, method in enumerate(self.methods) if method.probes
                for probe in method.probe(_View(cache, f"{i}/", i), prompts)]


class SharedPrefill:
    """Prefill once for several methods; ``fork(i, budget)`` is method i's cache after that prefill."""

    def __init__(self, model, methods: list[Method], tokenizer=None):
        self.methods = list(methods)
        self.cache = CompressedCache(model, _Observers(methods=self.methods), budget=1.0, observe=True,
                                     tokenizer=tokenizer)

    def fork(self, index: int, budget, evict_every: int = 1, kv_bits=None) -> CompressedCache:
        """Method ``index``'s own cache at ``budget``, compressed now if the method compresses after the
        prefill (``evict_every``, ``kv_bits``: the new cache's, ``CompressedCache``)."""
        return self.cache.fork(self.methods[index], budget, slot_prefix=f"{index}/",
                               state_of=lambda layer: layer.state.parts[index], evict_every=evict_every,
                               kv_bits=kv_bits)
