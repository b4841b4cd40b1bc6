"""What the engine asks of a compression method: the ``Policy`` interface (no method lives here).

The cache calls, in order: ``stats_request`` and ``observe`` in every attention call (which
statistics to compute, and folding them into per-slot state); ``observe_tokens`` after a pass, if
the policy scores by surprisal; ``probe``, when compression starts, if the policy ``probes`` (more
tokens to run through the model and observe before compressing, taken out of the cache after each
pass); ``allocate`` once, when compression starts (each layer's budget per row); then for every
layer over its budget ``score`` and ``protected`` (which slots to keep) and, if the policy has a
``merge``, ``merge.merge`` (what becomes of the evicted tokens). ``report`` adds the policy's own
per-layer diagnostics to the cache's report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from d2o.budget import Budget
    from d2o.engine.cache import CompressedCache
    from d2o.engine.stats import AttentionStats, StatsRequest
    from d2o.engine.storage import CompressedLayer, RowState


@dataclass
class Evicted:
    """Tokens leaving a layer, per row and KV head, as they were stored (copies).

    ``keys``/``values`` (B, G, E, D), each None unless the merge reads it (``Merge.vectors``);
    ``token_index`` (B, G, E), ``valid`` (B, E): every KV head of a row evicts as many tokens, and
    row b's entries past its count are padding; ``slot_state``: the per-slot method state of those
    tokens, (B, G, E, ...); ``log_weight`` (B, G, E): the log of how many tokens each stands for
    (None: one each).
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    token_index: torch.Tensor
    valid: torch.Tensor
    slot_state: dict[str, torch.Tensor]
    log_weight: torch.Tensor | None = None


@dataclass
class ProbePass:
    """Tokens run through the model after the prompt, observed, then taken out of the cache (KVzip's
    reconstruction of a context): ``ids``, one list per row (rows may differ in length; an empty
    list sits the pass out); ``spans``: per row, the prompt tokens [start, end) the pass is about
    (the policy's to read); ``tag``: whose pass it is (a policy combining others routes by it).
    While it runs, ``cache.probing`` is this pass."""

    ids: list[list[int]]
    spans: list[tuple[int, int]] | None = None
    tag: Any = None


# Bytes of one value of slot state (float32 scores, int32 counts), whatever the model's dtype.
STATE_VALUE_BYTES = 4


class Merge(Protocol):
    """What happens to evicted tokens: folded into the layer's kept slots instead of being dropped."""

    reads: tuple[str, ...]  # the slot states of the evicted tokens it reads (the engine copies only those)
    vectors: tuple[str, ...]  # which of their "keys" and "values" it reads (likewise)

    def slot_state_bytes(self, group: int) -> int:
        """Bytes it keeps per slot and stored KV head, at most (slot state and log weight);
        ``group``: the query heads of each stored KV head."""

    def new_state(self) -> RowState | None:
        """Per-layer state of a new cache (e.g. a merge threshold per row)."""

    def report(self, layer: CompressedLayer) -> dict[str, list[Any]]:
        """Per-layer diagnostics, one entry per row."""

    def merge(self, layers: list[CompressedLayer], evicted: list[Evicted]) -> list[torch.Tensor]:
        """Fold ``evicted[i]`` into the kept slots of ``layers[i]`` (their keys, values and slot
        state are the kept tokens only, modified in place), for the layers one compression evicted
        from (a decode step: every layer, one token per row and KV head); return, per layer, how
        many (token, KV head) pairs were merged, per row (B,)."""


class Policy(Protocol):
    """A compression method as the engine sees it (``d2o.methods.Method`` implements it)."""

    name: str
    compress_after_forward: int  # compression starts after this many forward passes (1: the prefill)
    evicts_during_decode: bool  # False: compress once, then let the cache grow
    needs_surprisal: bool  # True: the engine computes every new token's surprisal for ``observe_tokens``
    repeats_kv_heads: bool  # True: KV heads stored once per query head (the released D2O code's storage)
    keeps_everything: bool  # True: the budget is ignored (the full cache), and reported as none
    probes: bool  # True: the cache records the prompt's token ids and runs ``probe``'s passes before compressing
    merge: Merge | None

    def probe(self, cache: CompressedCache, prompts: list[list[int]]) -> list[ProbePass]:
        """The passes to run and observe before the first compression, given each row's prompt
        token ids (padding left out)."""

    def budget_for(self, budget: Budget) -> Budget:
        """The budget a cache of this policy holds when given ``budget``."""

    def new_layer_state(self) -> RowState | None:
        """The method's own per-layer state for a new cache (None if it keeps none)."""

    def slot_state_bytes(self, group: int) -> int:
        """Bytes of state it keeps per slot and stored KV head, at most, in a layer it scores
        (``slot_state`` and ``log_weight``; a memory plan counts them); ``group``: the query heads
        of each stored KV head."""

    def stats_request(self, layer: CompressedLayer, n_query: int) -> StatsRequest | None: ...

    def observe(self, layer: CompressedLayer, stats: AttentionStats) -> None: ...

    def observe_tokens(self, cache: CompressedCache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The new tokens' surprisal (B, q) and ids (B, q), if ``needs_surprisal``."""

    def allocate(self, cache: CompressedCache, totals: torch.Tensor) -> torch.Tensor:
        """Per-row, per-layer budgets (B, L) (``UNLIMITED``: never evict) summing to ``totals`` (B,)."""

    def score(self, layer: CompressedLayer) -> torch.Tensor:
        """(B, G, N) scores, higher = keep."""

    def protected(self, layer: CompressedLayer, target: torch.Tensor) -> torch.Tensor:
        """(B, G, N) bool: slots kept whatever their score when the layer keeps ``target`` (B,)."""

    def report(self, layer: CompressedLayer) -> dict[str, Any]:
        """Per-layer diagnostics, each value a list with one entry per row."""
