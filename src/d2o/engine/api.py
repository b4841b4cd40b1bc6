"""The boundary between the engine and the methods: what a method is asked, what it may read and what
it returns. A method imports this module and nothing else of the engine, and this module imports
nothing else of it.

The engine calls a ``Policy``, in order: ``stats_request`` and ``observe`` in every attention call;
``observe_tokens`` after a pass, if it scores by surprisal; ``probe`` when compression starts, if
it ``probes`` (passes run, observed, then taken out); ``allocate`` once; then for every layer over
its budget ``score`` and ``protected`` and, with a ``merge``, ``merge.merge``. A method reads a
``LayerView`` and a ``CacheView`` and returns what it changes (``Observed``, ``TokenValues``,
``Allocated``, ``Merged``): only the layer writes its storage, so a layer storing keys and values
packed knows which slots to encode again. Slots are (B, G, N): rows, stored KV heads, slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Mapping, Protocol

import torch

STATE_VALUE_BYTES = 4  # bytes of one value of slot state (float32 scores, int32 counts), whatever the dtype
QUESTION = "question"  # the tag of a probe pass that is the question, seen after each chunk of a prefill


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without the call when it has that dtype (a decode step makes hundreds)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


@dataclass(frozen=True)
class StatsRequest:
    """What a method needs from one pass of one layer. ``visible`` (B, G, N) bool, if given, restricts
    the statistics' softmax (not the output's) to those slots and the pass's own tokens (KVzip scores
    a reconstructed chunk against that chunk alone)."""

    column_mass: bool = False  # attention each slot received, summed over this pass's real queries
    window: int = 0  # attention rows of the last `window` queries
    column_max: bool = False  # the largest attention any of this pass's real queries paid each slot
    queries: bool = False  # this pass's queries as the attention saw them (after RoPE), and their tokens
    visible: torch.Tensor | None = None

    @property
    def columns(self) -> bool:
        """Every query row's probabilities are needed (column mass or maximum)."""
        return self.column_mass or self.column_max


@dataclass
class AttentionStats:
    """One pass of one layer, per query head grouped by KV head: ``column_mass``, ``column_max``
    (B, G, group, N) float32; ``window`` (B, G, group, w, N), the last w queries' rows (padding's are
    zero); ``output`` (B, q, H, D) when computed with them; ``queries`` (B, H, q, D) after RoPE,
    unscaled, their token ``query_index`` (B, q) (-1: padding) and the logits' ``scaling``."""

    n_query: int
    column_mass: torch.Tensor | None = None
    window: torch.Tensor | None = None
    output: torch.Tensor | None = None
    column_max: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    query_index: torch.Tensor | None = None
    scaling: float | None = None


@dataclass
class RowState:
    """Base of a method's per-layer state: a tensor field is (batch, ...) (None until set), a list
    field a history of (batch,) tensors. Selecting rows, joining caches (what a cache had not set is
    NaN for its rows) and saving map every field: a method's state needs no code for them."""

    def map_rows(self, fn) -> RowState:
        """``fn`` (a function of a (batch, ...) tensor) applied to every per-row tensor."""
        return replace(self, **{f.name: _map_field(getattr(self, f.name), fn) for f in fields(self)})

    @classmethod
    def concat(cls, states: list[RowState], rows: list[int]) -> RowState:
        """The states of caches of ``rows`` rows each, one after the other."""
        joined = {}
        for f in fields(cls):
            parts = [getattr(state, f.name) for state in states]
            if all(isinstance(part, list) for part in parts):  # histories, aligned on their latest event
                longest = max(len(part) for part in parts)
                padded = [[None] * (longest - len(part)) + part for part in parts]
                joined[f.name] = [_cat_rows(events, rows) for events in zip(*padded)]
            else:
                joined[f.name] = _cat_rows(parts, rows)
        return cls(**joined)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Its tensors by name (a history's as ``name.i``), and how to rebuild it from them."""
        tensors, layout = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                tensors.update({f"{f.name}.{i}": item for i, item in enumerate(value)})
            elif isinstance(value, torch.Tensor):
                tensors[f.name] = value
            layout[f.name] = len(value) if isinstance(value, list) else \
                "tensor" if isinstance(value, torch.Tensor) else {"value": value}
        return tensors, layout

    def load_state_dict(self, tensors: dict[str, torch.Tensor], layout: dict[str, Any]) -> RowState:
        return replace(self, **{name: tensors[name] if kind == "tensor" else kind["value"] if isinstance(kind, dict)
                                else [tensors[f"{name}.{i}"] for i in range(kind)] for name, kind in layout.items()})


def _cat_rows(parts: list, rows: list[int]):
    """Per-row tensors of several caches one after the other; a missing one (None) is NaN."""
    example = next((part for part in parts if isinstance(part, torch.Tensor)), None)
    if example is None:
        return parts[0]
    return torch.cat([part if part is not None else example.new_full((n, *example.shape[1:]), math.nan)
                      for part, n in zip(parts, rows)])


def _map_field(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    return [fn(item) for item in value] if isinstance(value, list) else value


@dataclass
class ProbePass:
    """Tokens run after the prompt, observed, then taken out (KVzip's reconstruction, the question):
    ``ids``, one list per row (empty: the row sits it out); ``spans``: per row, the prompt tokens
    [start, end) it is about; ``tag``: whose pass it is (``QUESTION``: the question's); ``positions``:
    per row, its first token's position (None: right after the prompt so far). ``CacheView.probing``
    is this pass while it runs."""

    ids: list[list[int]]
    spans: list[tuple[int, int]] | None = None
    tag: Any = None
    positions: list[int] | None = None


@dataclass
class Evicted:
    """Copies of the tokens leaving a layer: ``keys``/``values`` (B, G, E, D), each None unless the
    merge reads it; ``token_index`` (B, G, E); ``valid`` (B, E) (every head of a row evicts as many;
    past a row's count, padding), or (B, G, E) where KV heads are given counts of their own (to a
    merge whose ``uneven_heads`` is True); the ``slot_state`` the merge reads and ``log_weight``,
    (B, G, E, ...)."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    token_index: torch.Tensor
    valid: torch.Tensor
    slot_state: dict[str, torch.Tensor]
    log_weight: torch.Tensor | None = None


@dataclass
class Observed:
    """What a method makes of a pass of a layer: ``slot_state`` replaces those states (B, G, N, ...),
    ``added`` is added to those (set where none yet), ``state`` is the new per-layer state."""

    slot_state: dict[str, torch.Tensor] = field(default_factory=dict)
    added: dict[str, torch.Tensor] = field(default_factory=dict)
    state: RowState | None = None


@dataclass
class TokenValues:
    """The new tokens' values (B, q) by slot-state name, written into every layer at their slots;
    before, the older tokens' values of a name in ``decay`` are multiplied by its factor."""

    values: dict[str, torch.Tensor]
    decay: dict[str, float] = field(default_factory=dict)


@dataclass
class Allocated:
    """Each layer's budget per row (B, L) (``UNLIMITED``: never evicts), and new per-layer states."""

    budgets: torch.Tensor
    states: dict[int, RowState] = field(default_factory=dict)


@dataclass
class Merged:
    """What a merge changed in a layer: ``count`` (B,) pairs merged; new ``keys``/``values`` (B, G, K,
    D) of the slots ``slots`` (B, G, K) (None: of every slot), of which only those nonzero in
    ``changed`` (B, G, K) may differ (None: any); the new ``log_weight`` (B, G, N), ``slot_state``,
    ``state``."""

    count: torch.Tensor
    slots: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    changed: torch.Tensor | None = None
    log_weight: torch.Tensor | None = None
    slot_state: dict[str, torch.Tensor] = field(default_factory=dict)
    state: RowState | None = None


def _read(name: str, doc: str) -> property:
    return property(lambda view: getattr(view._of, name), doc=doc)


class LayerView:
    """One layer as a method reads it."""

    def __init__(self, layer, cache: CacheView, slot_state: Mapping | None = None, state: Any = ...):
        self._of, self.cache = layer, cache
        self._slot_state, self._state = slot_state, state

    def narrowed(self, slot_state: Mapping, state: Any) -> LayerView:
        """This layer with other slot and per-layer states (a method's own, in a shared prefill)."""
        return LayerView(self._of, self.cache, slot_state, state)

    slot_state = property(lambda view: MappingProxyType(view._of.slot_state) if view._slot_state is None
                          else view._slot_state, doc="The method's per-slot state, (B, G, N, ...) by name.")
    state = property(lambda view: view._of.state if view._state is ... else view._state,
                     doc="The method's per-layer state (``new_layer_state``).")
    layer_idx = _read("layer_idx", "The layer's index in the model.")
    device = _read("device", "Where its tensors are.")
    token_index = _read("token_index", "(B, G, N) int32: each slot's token among its row's real ones (-1: empty).")
    valid = _read("valid", "(B, G, N) bool: which slots hold a token.")
    n_kept = _read("n_kept", "(B,) tokens held per row.")
    real_seen = _read("real_seen", "(B,) real tokens fed per row.")
    seen = _read("seen", "Tokens fed, padding included.")
    keys = _read("keys", "(B, G, N, D) keys after RoPE, in the model's dtype.")
    values = _read("values", "(B, G, N, D) values.")
    log_weight = _read("log_weight", "(B, G, N) float32: log of the tokens each slot stands for (None: one each).")
    merged = _read("merged", "(B,) evicted (token, KV head) pairs merged so far.")

    def weights(self) -> torch.Tensor:
        """``log_weight``, or zeros where none is set."""
        return self._of.weights()

    def fresh_index(self, q: int) -> torch.Tensor:
        """(B, q): the token index of each token of the last pass (-1: padding)."""
        return self._of.fresh_index(q)

    def vector_parts(self, name: str) -> tuple[torch.Tensor, ...]:
        """The ``keys`` or ``values`` (``name``) as parts one after another along the slots, each
        (B or 1, G, n, D): the whole (B, G, N, D) of most layers; rows reading a shared prefix, the
        prefix (1, G, P, D) in place, then their own slots. A reader of every slot at a decode step
        (a merge's similarities) that takes the parts never copies the prefix for each row."""
        return self._of.vector_parts(name)

    def vectors_at(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """(B, G, K, D): the ``keys`` or ``values`` (``name``) of the ``slots`` (B, G, K), copied."""
        return self._of.vectors_at(name, slots)


class CacheView:
    """The cache as a method reads it."""

    def __init__(self, cache):
        self._of = cache
        self.layers = [LayerView(layer, self) for layer in cache.layers]

    n_layers = _read("n_layers", "The model's layers.")
    compressible = _read("compressible", "The layers a budget shares (not sliding-window ones).")
    budget = _read("budget", "The cache's ``Budget``.")
    tokenizer = _read("tokenizer", "The model's tokenizer.")
    vocab_size = property(lambda view: view._of.facts.config.vocab_size, doc="The model's vocabulary size.")
    probing = property(lambda view: view._of.prober.probing, doc="The probe pass running now, or None.")
    forwards = property(lambda view: view._of.schedule.forwards, doc="Passes completed (a hold counts one).")
    allocated = property(lambda view: view._of.schedule.allocated, doc="Whether the budgets are allocated.")
    prefilling = property(lambda view: view._of.schedule.prefilling, doc="Whether a prompt is being fed.")
    prompt_lengths = property(lambda view: view._of.schedule.prompt_lengths(),
                              doc="(B,) real tokens of each row's prompt (the whole, when it comes in chunks).")

    def may_evict_after(self, n_query: int) -> bool:
        """Whether the pass running now (``n_query`` new tokens per row) may end in an eviction."""
        return self._of.schedule.may_evict_after(n_query)

    def rotary(self, layer_idx: int, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        """The model's RoPE (cos, sin) at ``positions`` (B, n) in layer ``layer_idx``, (B, n, D) each."""
        return self._of.facts.rotary(layer_idx, positions, dtype)


class Merge(Protocol):
    """What happens to evicted tokens: folded into the layer's kept slots instead of being dropped."""

    reads: tuple[str, ...]  # the slot states of the evicted tokens it reads (the engine copies only those)
    uneven_heads: bool  # True: it takes an ``Evicted`` whose KV heads evict unevenly (``valid`` (B, G, E))
    vectors: tuple[str, ...]  # which of their "keys" and "values" it reads (likewise)
    # Whether it may write new keys or values into kept slots (False: only their weights and state):
    # a row reading a prefix in place copies such a slot into its own part first, which plans count.
    changes_vectors: bool

    def slot_state_bytes(self, group: int) -> int: ...  # per slot and stored KV head, at most
    def new_state(self) -> RowState | None: ...  # per-layer state of a new cache (a threshold per row)
    def report(self, layer: LayerView) -> dict[str, list[Any]]: ...  # per-layer diagnostics, one per row

    def merge(self, layers: list[LayerView], evicted: list[Evicted]) -> list[Merged]:
        """Fold ``evicted[i]`` into the kept slots of ``layers[i]``, for every layer one compression
        evicted from (a decode step: every layer at once)."""


class Policy(Protocol):
    """A compression method as the engine sees it (``d2o.methods.Method`` implements it)."""

    name: str
    compress_after_forward: int  # compression starts after this many passes (1: the prefill)
    evicts_during_decode: bool  # False: compress once, then let the cache grow
    needs_surprisal: bool  # True: every new token's surprisal goes to ``observe_tokens``
    repeats_kv_heads: bool  # True: KV heads stored once per query head (the released D2O's storage)
    keeps_everything: bool  # True: the budget is ignored (the full cache), and reported as none
    probes: bool  # True: the prompt's ids are recorded and ``probe``'s passes run before compressing
    question_tokens: int  # the prompt's last tokens it scores with (a prefill in chunks shows them after each)
    per_head_budgets: bool  # True: ``head_targets`` gives each KV head a count of its own
    merge: Merge | None

    def budget_for(self, budget) -> Any: ...  # the budget a cache of this policy holds when given one
    def new_layer_state(self) -> RowState | None: ...
    def slot_state_bytes(self, group: int) -> int: ...  # per slot and stored KV head, at most
    def allocated_state_bytes(self, group: int) -> int: ...  # the same from the final allocation on
    def stats_request(self, layer: LayerView, n_query: int) -> StatsRequest | None: ...
    def observe(self, layer: LayerView, stats: AttentionStats) -> Observed | None: ...
    def observe_tokens(self, cache: CacheView, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues | None:
        ...
    # Once the budgets are final (a prompt compressed; in chunks, its last chunk): the slot state decoding
    # keeps, without what only the allocation read (None: as it is).
    def once_allocated(self, layer: LayerView) -> Observed | None: ...
    def probe(self, cache: CacheView, prompts: list[list[int]]) -> list[ProbePass]: ...
    def score(self, layer: LayerView) -> torch.Tensor: ...  # (B, G, N), higher = keep
    def report(self, layer: LayerView) -> dict[str, Any]: ...  # per-layer diagnostics, one per row

    def allocate(self, cache: CacheView, totals: torch.Tensor) -> Allocated:
        """Per-row, per-layer budgets (B, L) summing to ``totals`` (B,) over the layers a budget shares."""

    def protected(self, layer: LayerView, target: torch.Tensor) -> torch.Tensor:
        """(B, G, N) bool: slots kept whatever their score when the layer keeps ``target`` (B,)."""

    def head_targets(self, layer: LayerView, scores: torch.Tensor, protected: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor | None:
        """(B, G) tokens each KV head keeps when the layer keeps ``target`` (B,) per head on average
        (the layer then holds a run of slots per KV head); None: ``target`` each."""
