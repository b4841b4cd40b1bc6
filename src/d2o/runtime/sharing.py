"""One prefill, many methods: record what every method observes, then fork a cache per method.

A sweep of k methods x b budgets over one prompt needs the prompt's keys and values once, and
each method's view of the prefill statistics. ``SharedPrefill`` runs the prefill once under a
method that asks for the union of the statistics the methods need and lets each fold them into
its own namespace of slot state; ``fork`` then gives a method its own cache at its own budget,
sharing the prefill's key/value tensors (compression writes new tensors, never into old ones),
which compresses exactly as if that method had run the prefill alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from d2o.engine.api import AttentionStats, Observed, ProbePass, RowState, StatsRequest, TokenValues
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.methods.base import Method


def _own(layer, index: int):
    """``layer`` (a view) as method ``index`` sees it: its slot state (the names under ``"{index}/"``)
    and its per-layer state (its part of ``_States``)."""
    prefix = f"{index}/"
    return layer.narrowed({name[len(prefix):]: state for name, state in layer.slot_state.items()
                           if name.startswith(prefix)}, layer.state.parts[index])


def _prefixed(values: dict, index: int) -> dict:
    return {f"{index}/{name}": value for name, value in values.items()}


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
        return [m.stats_request(_own(layer, i), n_query) if probing is None or probing.tag == i else None
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

    def observe(self, layer, stats: AttentionStats) -> Observed:
        joined, parts = Observed(), list(layer.state.parts)
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
            observed = method.observe(_own(layer, i), mine)
            if observed is not None:
                joined.slot_state.update(_prefixed(observed.slot_state, i))
                joined.added.update(_prefixed(observed.added, i))
                if observed.state is not None:
                    parts[i] = observed.state
        joined.state = _States(tuple(parts))
        return joined

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues:
        joined = TokenValues({})
        for i, method in enumerate(self.methods):
            values = method.observe_tokens(cache, surprisal, input_ids) if method.needs_surprisal else None
            if values is not None:
                joined.values.update(_prefixed(values.values, i))
                joined.decay.update(_prefixed(values.decay, i))
        return joined

    def probe(self, cache, prompts: list[list[int]]) -> list[ProbePass]:
        """Every method's probe passes, each tagged with the method it is for."""
        return [replace(probe, tag=i) for i, method in enumerate(self.methods) if method.probes
                for probe in method.probe(cache, prompts)]


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
