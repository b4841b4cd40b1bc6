"""The method base class, the engine's ``Policy`` made concrete, and the registry of methods.

A method is a stateless configuration (a dataclass): all state lives in the cache layers, so one
method object can serve any number of caches and nothing leaks from one sequence to the next.
It sees the cache only through ``d2o.engine.api``: it reads ``LayerView``s and a ``CacheView``
and returns what it changes. The engine asks it, in order:

1. ``stats_request(layer, n_query)``: which attention statistics to compute in this pass;
2. ``observe(layer, stats)``: what it makes of them (``Observed``: new or added slot state, a new
   per-layer state);
3. ``probe(cache, prompts)``, if the method ``probes``: passes run through the model after the
   prompt and observed (1 and 2 again, ``cache.probing`` set), then taken out of the cache
   (KVzip's reconstruction of the context);
4. ``allocate(cache, totals)``: once, each layer's budget per row, (B, L), summing to ``totals``;
   then ``once_allocated(layer)``: the slot state decoding keeps, where the allocation read more;
5. ``score(layer)``: a (B, kv_heads, slots) tensor, higher = keep;
6. ``protected(layer, target)``: (B, kv_heads, slots) bool, slots kept whatever their score;
7. ``merge`` (optional component): what becomes of the evicted slots (``Merged``).

The engine then keeps, per row and KV head, the protected slots and the best-scoring others.
Per-layer state a method needs beyond its slots is a typed ``RowState`` of its own
(``new_layer_state``), and ``report`` returns its diagnostics. A method that keeps slot state
declares its size (``slot_state_bytes``): memory plans count it, and the test matrix holds every
method to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

import torch

from d2o.budget import UNLIMITED, Budget
from d2o.engine.api import (Allocated, AttentionStats, CacheView, LayerView, Merge, Observed, ProbePass, RowState,
                            StatsRequest, TokenValues)
from d2o.errors import D2OError
from d2o.methods.allocation import Allocation, Uniform, allocation_named, conserve, head_counts
from d2o.methods.scoring import scoring_named
from d2o.options import HEADS, whole


@dataclass
class Method:
    """Base class of every compression method; subclasses set ``name`` and ``summary``.

    ``n_sinks``: the first tokens of every row, always kept. ``allocation``: how the total budget
    is shared among layers. ``exempt_layers``: layers never compressed (what they hold counts
    against the total). ``merge``: None, or a component folding evicted slots into kept ones.
    ``heads``: "even" (every KV head of a layer keeps its budget) or "adaptive" (the layer's
    budget x KV heads pairs go to its best-scoring (token, KV head) pairs, each head keeping at
    least ``head_floor`` x its even share: AdaKV's rule, ``allocation.head_counts``); a method that
    evicts while decoding then evicts as many from every KV head, so that each keeps its count.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # Compression starts after this many forward passes (1: at the end of the prefill).
    compress_after_forward: ClassVar[int] = 1
    # False: compress once, then let the cache grow with new tokens (SnapKV-style methods).
    evicts_during_decode: ClassVar[bool] = True
    # True: the engine computes each token's surprisal and calls `observe_tokens`.
    needs_surprisal: ClassVar[bool] = False
    # True: KV heads are stored once per query head (the released D2O code; parity only).
    repeats_kv_heads: ClassVar[bool] = False
    # True: the budget is ignored and nothing is ever evicted (the full cache).
    keeps_everything: ClassVar[bool] = False
    # False: the layers' budgets need not add up to the total (a memory plan reserves the full cache).
    conserves_budget: ClassVar[bool] = True
    # True: before compressing, the cache runs the passes of `probe` through the model and observes them.
    probes: ClassVar[bool] = False
    # The prompt's last tokens the method scores with (its question), shown after each chunk of a prefill in chunks.
    question_tokens: ClassVar[int] = 0

    n_sinks: int = 0
    allocation: Allocation = field(default_factory=Uniform)
    exempt_layers: tuple[int, ...] = ()
    merge: Merge | None = None
    heads: str = "even"
    head_floor: float = 0.2

    def __post_init__(self):
        check(whole(self.n_sinks) and self.n_sinks >= 0, "n_sinks", self.n_sinks, "must be a whole number >= 0")
        if whole(self.exempt_layers):  # exempt_layers=0 on the command line
            self.exempt_layers = (self.exempt_layers,)
        check(isinstance(self.exempt_layers, (tuple, list)) and all(map(whole, self.exempt_layers)),
              "exempt_layers", self.exempt_layers, "must be layer indices (whole numbers), e.g. 0,1,-1")
        self.exempt_layers = tuple(self.exempt_layers)
        self.check_parts()

    def check_parts(self) -> None:
        """Refuse parts that are not what they must be, or do not fit together (run again once
        ``get_method`` set nested options)."""
        check(isinstance(self.allocation, Allocation), "allocation", self.allocation,
              "must be an allocation: uniform, pyramid, expdecay, variance or scores")
        check(self.merge is None or all(callable(getattr(self.merge, name, None)) for name in ("merge", "new_state")),
              "merge", self.merge, "must be a merge (set its fields with merge.NAME=VALUE) or none")
        check(self.heads in HEADS, "heads", self.heads, f"must be one of {', '.join(HEADS)}")
        check(isinstance(self.head_floor, (int, float)) and 0 <= self.head_floor <= 1, "head_floor", self.head_floor,
              "must be a share of a KV head's even budget, in [0, 1]")
        if self.per_head_budgets and self.repeats_kv_heads:
            raise D2OError(f"heads=adaptive gives each stored KV head a count of its own; {self.name} stores every KV "
                           f"head once per query head")
        if self.per_head_budgets and self.merge is not None and not self.merge.uneven_heads:
            raise D2OError(f"heads=adaptive evicts unevenly across KV heads, which {self.name}'s merge cannot fold in")

    per_head_budgets = property(lambda method: method.heads == "adaptive",
                                doc="Whether a layer's KV heads keep counts of their own (``head_targets``).")

    # -- state and diagnostics ------------------------------------------------------------------
    def new_layer_state(self) -> RowState | None:
        """The per-layer state of a new cache: its merge component's, if it has one."""
        return self.merge.new_state() if self.merge is not None else None

    def report(self, layer: LayerView) -> dict[str, list[Any]]:
        """Per-layer diagnostics (one entry per row): its merge component's, if it has one."""
        return self.merge.report(layer) if self.merge is not None else {}

    def slot_state_bytes(self, group: int) -> int:
        """Bytes of state kept per slot and stored KV head (``group`` query heads each), at most:
        its merge component's; a method that scores from slot state adds its own."""
        return self.merge.slot_state_bytes(group) if self.merge is not None else 0

    def allocated_state_bytes(self, group: int) -> int:
        """``slot_state_bytes`` from the final allocation on (``once_allocated``): a row decoding, or
        reading a compressed context."""
        return self.slot_state_bytes(group)

    # -- statistics -----------------------------------------------------------------------------
    def stats_request(self, layer: LayerView, n_query: int) -> StatsRequest | None:
        return None

    def observe(self, layer: LayerView, stats: AttentionStats) -> Observed | None:
        return None

    def observe_tokens(self, cache: CacheView, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues | None:
        """The new tokens' surprisal (B, q) and ids, if ``needs_surprisal``; called before compression."""
        return None

    def once_allocated(self, layer: LayerView) -> Observed | None:
        """The layer's slot state from the final allocation on (None: as it is)."""
        return None

    def probe(self, cache: CacheView, prompts: list[list[int]]) -> list[ProbePass]:
        """If ``probes``: the passes to run through the model and observe before the first
        compression (each taken out of the cache after it), given each row's prompt token ids."""
        return []

    def probe_tokens(self, prompt_tokens: int) -> int:
        """The most tokens one probe pass adds to every layer for a prompt of ``prompt_tokens``
        (an upper bound: a memory plan reserves it during the prefill)."""
        return 0

    # -- budgets --------------------------------------------------------------------------------
    @property
    def min_layer_budget(self) -> int:
        """The smallest budget a layer can have under this method (its protected slots + 1)."""
        return self.reserved + self.n_sinks + 1

    def min_budget_reason(self) -> str:
        return f"{self.n_sinks} sinks + 1"

    def check_budget(self, budget: Budget) -> None:
        """Refuse, before any model runs, a budget that could leave a layer below what this method
        must keep: a token budget below it, or a floor below it (the floor meets the minimum of a
        ratio budget; ``min_tokens=0`` turns the floor off, and a ratio too small for the method is
        then refused when the prompt's length is known)."""
        if budget.tokens is not None and budget.tokens < self.min_layer_budget:
            raise D2OError(f"budget {budget} leaves {budget.tokens} tokens per layer; {self.name} needs at least "
                           f"{self.min_layer_budget} ({self.min_budget_reason()})")
        if budget.ratio is not None and 0 < budget.min_tokens < self.min_layer_budget and not self.keeps_everything:
            raise D2OError(f"min_tokens={budget.min_tokens} is too low a floor: {self.name} needs at least "
                           f"{self.min_layer_budget} ({self.min_budget_reason()})")

    def budget_for(self, budget: Budget) -> Budget:
        """The budget a cache of this method holds when given ``budget`` (a method reproducing code
        that has no floor drops the default one)."""
        return budget

    def exempt_of(self, n_layers: int) -> set[int]:
        """The exempt layers among ``n_layers`` (negative indices from the last), each checked."""
        for index in self.exempt_layers:
            check(-n_layers <= index < n_layers, "exempt_layers", index, f"is not a layer of a {n_layers}-layer model")
        return {index % n_layers for index in self.exempt_layers}

    def exempt_among(self, n_layers: int, compressible: list[int]) -> list[int]:
        """The exempt layers (model indices) of those a budget shares, ``compressible``; refused
        when they are all of them: nothing would be compressed."""
        exempt = sorted(self.exempt_of(n_layers) & set(compressible))
        if compressible and len(exempt) == len(compressible):
            raise D2OError(f"exempt_layers={self.exempt_layers!r} exempts every layer a budget compresses "
                           f"({', '.join(map(str, compressible))}): nothing would be compressed")
        return exempt

    @property
    def reserved(self) -> int:
        """Tokens every layer sets aside before the rest is shared by ``allocation`` (a window)."""
        return 0

    def allocate(self, cache: CacheView, totals: torch.Tensor) -> Allocated:
        """Per-row, per-layer budgets (B, L) summing to ``totals`` (B,) over the layers a budget
        shares (every layer but sliding-window ones); the others are UNLIMITED."""
        n_layers = cache.n_layers
        exempt = self.exempt_among(n_layers, cache.compressible)
        active = [i for i in cache.compressible if i not in exempt]
        prompt = cache.prompt_lengths.cpu()
        shared = totals - len(exempt) * prompt  # exempt layers hold the whole prompt
        weights = self.allocation.weights(cache, active, shared, self).double()  # (B, len(active))
        budgets = torch.full((len(prompt), n_layers), UNLIMITED, dtype=torch.long)
        reserved = self.reserved
        for row, (length, total) in enumerate(zip(prompt.tolist(), shared.tolist())):
            if total >= len(active) * length:  # the budget covers the prompt: nothing to evict yet
                # but every layer gets what the method needs once it must evict (a short prompt's
                # layers would otherwise start below it and drop each new token, or a sink)
                lower = min(max(length, self.min_layer_budget), total // len(active))
                budgets[row, active] = torch.tensor(conserve(weights[row], total, lower, None), dtype=torch.long)
                continue
            lower = max(self.min_layer_budget, self.allocation.lower(length), cache.budget.floor(length))
            if total < len(active) * lower:
                why = self.min_budget_reason() if lower == self.min_layer_budget else "its allocation's smallest share"
                raise D2OError(
                    f"budget {cache.budget} leaves {max(total, 0) / max(len(active), 1):.1f} tokens per layer for a "
                    f"{length}-token prompt; {self.name} needs at least {lower} ({why})"
                )
            shares = conserve(weights[row], total - len(active) * reserved, lower - reserved, length - reserved)
            budgets[row, active] = torch.tensor(shares, dtype=torch.long) + reserved
        return Allocated(budgets)

    # -- eviction -------------------------------------------------------------------------------
    def score(self, layer: LayerView) -> torch.Tensor:
        raise NotImplementedError

    def n_recent(self, target: torch.Tensor) -> torch.Tensor:
        """(B,) how many of the newest tokens to protect when a layer keeps ``target`` tokens."""
        return torch.zeros_like(target)

    def head_targets(self, layer: LayerView, scores: torch.Tensor, protected: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor | None:
        """(B, G) tokens each KV head keeps when the layer keeps ``target`` (B,) per head on average;
        None: ``target`` each (``heads=even``)."""
        if not self.per_head_budgets:
            return None
        return head_counts(scores, protected, layer.valid, target, self.head_floor)

    def protected(self, layer: LayerView, target: torch.Tensor) -> torch.Tensor:
        """Sinks and the recent window: (B, G, N) bool."""
        index = layer.token_index
        recent_from = layer.real_seen - self.n_recent(target)
        return (index >= 0) & ((index < self.n_sinks) | (index >= recent_from[:, None, None]))


@dataclass
class HeavyRecent(Method):
    """A method whose layer budgets split N:M into scored tokens and a window of the newest ones."""

    split: tuple[int, int] = (1, 1)  # scored : recent parts of each layer's budget

    def __post_init__(self):
        super().__post_init__()
        check(isinstance(self.split, (tuple, list)), "split", self.split, "must be two parts, scored:recent, e.g. 3:1")
        self.split = tuple(self.split)
        check(len(self.split) == 2 and all(map(whole, self.split)) and min(self.split) >= 0 and sum(self.split) > 0,
              "split", self.split, "must be two non-negative parts (whole numbers), scored:recent, not both 0")

    def n_recent(self, target: torch.Tensor) -> torch.Tensor:
        scored, recent = self.split
        return torch.minimum(target * recent // (scored + recent), target - self.n_sinks).clamp_min(0)


def recency(layer: LayerView) -> torch.Tensor:
    """Newer tokens score higher (local windows, StreamingLLM)."""
    return layer.token_index.float()


def check(ok: bool, parameter: str, value, requirement: str) -> None:
    """Raise a D2OError naming the parameter when a method option is out of range."""
    if not ok:
        raise D2OError(f"{parameter}={value!r} {requirement}")


# -- registry -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """A name ``get_method`` builds: a method's class, or an ablation of a method (``base``): the
    same class with other defaults (``options``)."""

    name: str
    summary: str
    cls: type[Method]
    options: dict = field(default_factory=dict)
    base: str | None = None

    @property
    def ablation(self) -> bool:
        """A part removed or swapped to explain a result, not a method to choose."""
        return self.base is not None

    def build(self, **options) -> Method:
        return self.cls(**{**copy.deepcopy(self.options), **options})


REGISTRY: dict[str, Entry] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by its ``name``."""
    REGISTRY[cls.name] = Entry(cls.name, cls.summary, cls)
    return cls


def register_ablation(name: str, base: str, summary: str, options: dict) -> None:
    """Make ``name`` the method ``base`` with ``options`` for defaults (listed by ``d2o methods --all``)."""
    REGISTRY[name] = Entry(name, summary, REGISTRY[base].cls, options, base)


def get_method(name: str, **options) -> Method:
    """Build the method registered as ``name`` with ``options`` overriding its defaults.

    ``allocation`` and ``scoring`` may be names (``"uniform"``, ``"blended"``); ``component.field``
    sets one field of a component (``**{"merge.alpha": 0.3}``, ``--option merge.alpha=0.3``).
    """
    entry = REGISTRY.get(name)
    if entry is None:
        raise D2OError(f"unknown method {name!r}; choose one of: {', '.join(REGISTRY)}")
    if options and entry.cls.keeps_everything:  # its fields are the base class's: none would act
        raise D2OError(f"{name} keeps every token and takes no options (given: {', '.join(options)})")
    nested = {key: value for key, value in options.items() if "." in key}
    direct = {key: value for key, value in options.items() if "." not in key}
    if isinstance(direct.get("allocation"), str):
        direct["allocation"] = allocation_named(direct["allocation"])
    if isinstance(direct.get("scoring"), str):
        direct["scoring"] = scoring_named(direct["scoring"])
    try:
        method = entry.build(**direct)
    except TypeError as error:
        names = ", ".join(f.name for f in fields(entry.cls))
        raise D2OError(f"bad option for method {name!r} ({error}); options: {names}") from None
    for key, value in nested.items():
        component, _, attribute = key.partition(".")
        part = getattr(method, component, None)
        if not is_dataclass(part) or attribute not in {f.name for f in fields(part)}:
            if not is_dataclass(part):
                parts = [f.name for f in fields(method) if is_dataclass(getattr(method, f.name))]
                raise D2OError(f"{name} has no option {key!r}: its parts with options are {', '.join(parts) or 'none'}")
            has = ", ".join(f.name for f in fields(part))
            raise D2OError(f"{name} has no option {key!r}: its {component} ({type(part).__name__}) has "
                           + (f"options {has}" if has else "no options"))
        setattr(method, component, replace(part, **{attribute: value}))
    if nested:
        method.check_parts()
    return method
