"""A compressed KV cache for transformers: per-layer storage that really shrinks.

Each layer stores keys and values as ``(batch, kv_heads, slots, head_dim)`` (KV heads are never
repeated) plus, for every slot, the index of the token it holds among its row's real tokens
(``-1`` marks an empty slot: left padding, or the unused tail of a row whose budget is smaller
than its neighbour's). Slots need not be in token order: keys are cached after RoPE, so a kept
token carries its true position with it, and the attention hook masks by slot validity, never by
slot position.

The cache knows nothing about a particular method. After every forward pass it asks its
``Method`` for layer budgets (once) and, for every layer over its budget, for token scores, the
slots that must stay, and optionally how to merge what is evicted; it then gathers the kept
slots into smaller tensors.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from d2o.budget import Budget
from d2o.engine.stats import token_surprisal
from d2o.errors import D2OError

if TYPE_CHECKING:
    from d2o.methods.base import Method

# The attention function of transformers does not receive the cache. A layer's `update` is always
# followed, in the same thread, by that layer's attention call on the very tensors `update`
# returned: `update` leaves its layer here and the hook claims it (see `claim_active_layer`).
_active = threading.local()

UNLIMITED = -1  # a layer budget that never evicts (exempt layers)


def claim_active_layer(key: torch.Tensor) -> CompressedLayer | None:
    """The compressed layer whose ``update`` returned ``key``, or None if the cache is not d2o's."""
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if layer is None or layer.keys is not key:
        return None
    return layer


class CompressedLayer(CacheLayerMixin):
    """One layer's KV storage: keys, values, per-slot token indices and per-slot method state."""

    is_croppable = False  # eviction cannot be undone, so assisted decoding's rollback cannot work
    is_sliding = False

    def __init__(self, cache: CompressedCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.token_index: torch.Tensor | None = None  # (B, G, N) int64, -1 = empty slot
        # Method state that moves with the slots, each (B, G, N, ...): gathered on eviction,
        # zero-initialised for new tokens.
        self.slot_state: dict[str, torch.Tensor] = {}
        # Method state for the layer as a whole (e.g. D2O's merge threshold per row).
        self.layer_state: dict[str, Any] = {}
        self.seen = 0  # tokens fed, padding included: the offset transformers counts positions from
        self.real_seen: torch.Tensor | None = None  # (B,) real tokens fed per row
        self.budget: torch.Tensor | None = None  # (B,) slots this layer may keep per row, once allocated
        self.merged: torch.Tensor | None = None  # (B,) evicted (token, KV head) pairs merged so far
        self.pending = 0  # tokens appended by `update` that the attention hook has not admitted yet

    # -- transformers' layer interface --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty((batch, heads, 0, dim))
        self.values = value_states.new_empty((batch, heads, 0, value_states.shape[-1]))
        self.token_index = torch.empty((batch, heads, 0), dtype=torch.long, device=self.device)
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.merged = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.pending:
            raise D2OError(
                "the model's attention is not d2o's hook: create the cache with d2o.CompressedCache(model, ...) "
                "or call d2o.install(model) before running it"
            )
        if self.cache.kv_repeats > 1:  # the released D2O's storage: one copy of each KV head per query head
            key_states = key_states.repeat_interleave(self.cache.kv_repeats, dim=1)
            value_states = value_states.repeat_interleave(self.cache.kv_repeats, dim=1)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.pending = key_states.shape[-2]
        _active.layer = self
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # Tokens seen, not kept: the model derives positions from it and `generate` decides from it
        # which input tokens are new.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.keys is None else self.keys.shape[-2]
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise D2OError("a compressed cache cannot be cropped: evicted tokens are gone (assisted decoding needs crop)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices])

    def _map_rows(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values, self.token_index = fn(self.keys), fn(self.values), fn(self.token_index)
        self.real_seen, self.merged = fn(self.real_seen), fn(self.merged)
        if self.budget is not None:
            self.budget = fn(self.budget)
        self.slot_state = {name: fn(t) for name, t in self.slot_state.items()}
        self.layer_state = {
            name: fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for name, v in self.layer_state.items()
        }

    # -- what the attention hook and the methods use --------------------------------------------
    def admit(self, new_valid: torch.Tensor) -> None:
        """Record the tokens ``update`` appended: ``new_valid`` (B, q) is False for padding."""
        q = self.pending
        batch, heads = self.keys.shape[:2]
        index = self.real_seen[:, None] + new_valid.long().cumsum(-1) - 1
        index = index.masked_fill(~new_valid, -1)
        self.token_index = torch.cat([self.token_index, index[:, None, :].expand(batch, heads, q)], dim=2)
        self.real_seen = self.real_seen + new_valid.sum(-1)
        self.seen += q
        for name, state in self.slot_state.items():
            fresh = state.new_zeros((*state.shape[:2], q, *state.shape[3:]))
            self.slot_state[name] = torch.cat([state, fresh], dim=2)
        self.pending = 0

    @property
    def valid(self) -> torch.Tensor:
        """(B, N) bool: which slots hold a token (the same in every KV head of a row)."""
        return self.token_index[:, 0] >= 0

    @property
    def n_kept(self) -> torch.Tensor:
        """(B,) tokens held per row."""
        return self.valid.sum(-1)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values (empty slots of a padded batch included)."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state_nbytes(self) -> int:
        """Bytes of the per-slot bookkeeping: token indices and method state."""
        if not self.is_initialized:
            return 0
        return self.token_index.nbytes + sum(state.nbytes for state in self.slot_state.values())

    def gather_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, G, K, D) of the slots (B, G, K): copies, free to modify."""
        return take_slots(self.keys, slots), take_slots(self.values, slots)

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Shrink to the slots ``keep`` (B, G, K), whose new contents are ``keys``/``values``
        (``gather_kv(keep)``, possibly merged into); ``keep_valid`` (B, K) marks the real ones."""
        self.token_index = self.token_index.gather(2, keep)
        if not bool(keep_valid.all()):  # rows of a batch with smaller budgets: their tail is empty
            empty = ~keep_valid[:, None, :]
            keys.masked_fill_(empty[..., None], 0)
            values.masked_fill_(empty[..., None], 0)
            self.token_index.masked_fill_(empty, -1)
        self.keys, self.values = keys, values
        self.slot_state = {name: take_slots(state, keep) for name, state in self.slot_state.items()}


def take_slots(tensor: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``tensor`` (B, G, N, ...) at ``slots`` (B, G, K) per row and head: a copy (B, G, K, ...).

    One ``index_select`` over flattened (row, head, slot) rows copies each slot's trailing
    values as a block; ``gather`` would need an index as large as the result.
    """
    batch, heads, n_slots = tensor.shape[:3]
    offsets = torch.arange(batch * heads, device=slots.device).view(batch, heads, 1) * n_slots
    rows = tensor.reshape(batch * heads * n_slots, -1).index_select(0, (slots + offsets).flatten())
    return rows.view(*slots.shape, *tensor.shape[3:])


@dataclass
class LayerReport:
    """What one layer holds after a run (per row of the batch, except bytes)."""

    layer: int
    budget: list[int | None]  # None: not compressed (not yet allocated, or an exempt layer)
    kept: list[int]
    full: list[int]  # real tokens seen: what an uncompressed cache would hold
    merged: list[int]
    kv_bytes: int
    kv_bytes_full: int
    state_bytes: int  # token indices and method state kept per slot, beside the keys and values
    tau_history: list[list[float]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CacheReport:
    """Per-layer and total memory of a compressed cache, against the full cache."""

    method: str
    budget: str
    layers: list[LayerReport]

    @property
    def kv_tokens_kept(self) -> int:
        return sum(sum(layer.kept) for layer in self.layers)

    @property
    def kv_tokens_full(self) -> int:
        return sum(sum(layer.full) for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes for layer in self.layers)

    @property
    def kv_bytes_full(self) -> int:
        return sum(layer.kv_bytes_full for layer in self.layers)

    @property
    def state_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers)

    @property
    def layer_budgets(self) -> list[int | None]:
        """Per-layer budget of the first row (the only row for a single prompt)."""
        return [layer.budget[0] if layer.budget else None for layer in self.layers]

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "budget": self.budget,
            "kv_tokens_kept": self.kv_tokens_kept,
            "kv_tokens_full": self.kv_tokens_full,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "state_bytes": self.state_bytes,
            "layer_budgets": self.layer_budgets,
            "layers": [layer.as_dict() for layer in self.layers],
        }

    def table(self) -> str:
        """A plain-text per-layer table (first row of the batch)."""
        lines = [f"{'layer':>5} {'budget':>7} {'kept':>6} {'full':>6} {'merged':>7} {'KV bytes':>10}  tau"]
        for layer in self.layers:
            budget = layer.budget[0] if layer.budget and layer.budget[0] is not None else "-"
            tau = " ".join(f"{step[0]:.3f}" for step in layer.tau_history[:3])
            more = " ..." if len(layer.tau_history) > 3 else ""
            lines.append(
                f"{layer.layer:>5} {budget!s:>7} {layer.kept[0]:>6} {layer.full[0]:>6} {layer.merged[0]:>7} "
                f"{layer.kv_bytes:>10}  {tau}{more}"
            )
        lines.append(
            f"total: {self.kv_tokens_kept} of {self.kv_tokens_full} KV tokens, "
            f"{self.kv_bytes} of {self.kv_bytes_full} bytes ({self.kv_bytes / max(self.kv_bytes_full, 1):.1%})"
        )
        return "\n".join(lines)


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses each layer to the budget its method allocates.

    Use it wherever transformers takes a cache::

        cache = CompressedCache(model, "d2o", budget=0.2)
        model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cache.report().table())

    Compression runs at the end of every forward pass: the first one that the method compresses
    after (the prefill, by default) fixes each layer's budget; from then on a layer over its
    budget (one new token per decode step, or a multi-token input such as an appended question)
    is brought back to it, unless the method keeps its cache after the first compression.
    ``with cache.hold(): ...`` defers compression (a chunked prefill scored as a whole).
    """

    def __init__(self, model, method: Method | str = "d2o", budget: Budget | str | float = 0.2, **method_options):
        from d2o.engine.attention import install
        from d2o.methods import get_method

        install(model)
        if method_options and not isinstance(method, str):
            raise D2OError("method options go with a method name, not with a method object")
        method = get_method(method, **method_options) if isinstance(method, str) else method
        self._setup(model.config.get_text_config(), method, budget)

    def _setup(self, config, method: Method, budget) -> None:
        self.config = config
        self.method = method
        self.budget = Budget.parse(budget)
        self.n_layers = config.num_hidden_layers
        groups = config.num_attention_heads // config.num_key_value_heads
        self.kv_repeats = groups if self.method.repeats_kv_heads else 1
        super().__init__(layers=[CompressedLayer(self, i) for i in range(self.n_layers)])
        self.forwards = 0
        self.allocated = False
        self._holds = 0
        self._last_hidden = None  # the last real token's final hidden state (for surprisal)

    def fork(self, method: Method, budget, slot_prefix: str = "") -> CompressedCache:
        """A cache for ``method`` at ``budget`` continuing from this one's tokens, compressed now if
        it is time. Key/value tensors are shared (nothing writes into them); the slot state under
        ``slot_prefix`` becomes the new cache's own (copied, since methods accumulate into it)."""
        new = CompressedCache.__new__(CompressedCache)
        new._setup(self.config, method, budget)
        if new.kv_repeats != self.kv_repeats:
            raise D2OError(f"{method.name} stores KV heads differently: it cannot share another method's prefill")
        new.forwards = self.forwards
        new._last_hidden = self._last_hidden
        for mine, theirs in zip(self.layers, new.layers):
            if not mine.is_initialized:
                continue
            theirs.lazy_initialization(mine.keys, mine.values)
            theirs.keys, theirs.values, theirs.token_index = mine.keys, mine.values, mine.token_index
            theirs.seen, theirs.real_seen = mine.seen, mine.real_seen
            theirs.slot_state = {
                name[len(slot_prefix):]: state.clone()
                for name, state in mine.slot_state.items()
                if name.startswith(slot_prefix)
            }
        new.compress()
        return new

    # -- lifecycle ----------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.forwards = 0
        self.allocated = False
        self._last_hidden = None

    @contextmanager
    def hold(self):
        """Defer compression until the block ends (e.g. to prefill a long prompt in chunks)."""
        self._holds += 1
        try:
            yield self
        finally:
            self._holds -= 1
        if not self._holds:
            self.compress()

    def observe_tokens(self, input_ids: torch.Tensor, hidden: torch.Tensor, lm_head) -> None:
        """Give the method each new token's surprisal, -log p(token | earlier tokens), (B, q)."""
        first = self.layers[0]
        valid = first.token_index[:, 0, -input_ids.shape[1]:] >= 0
        surprisal, self._last_hidden = token_surprisal(input_ids, hidden, lm_head, valid, self._last_hidden)
        self.method.observe_tokens(self, surprisal)

    def end_of_forward(self) -> None:
        """Called by the decoder's forward hook after every forward pass."""
        self.forwards += 1
        if not self._holds:
            self.compress()

    # -- compression --------------------------------------------------------------------------
    def compress(self) -> None:
        """Allocate budgets if it is time, then bring every layer over its budget back to it."""
        if not self.layers[0].is_initialized:
            return
        if not self.allocated:
            if self.forwards < self.method.compress_after_forward:
                return
            self._allocate()
        elif not self.method.evicts_during_decode:
            return
        for layer in self.layers:
            target = self._target(layer)
            if (layer.n_kept > target).any():
                self._compress_layer(layer, target)

    def _allocate(self) -> None:
        prompt = self.layers[0].real_seen
        if self.budget.ratio == 1.0:  # the whole sequence, now and as it grows: nothing is ever evicted
            budgets = torch.full((len(prompt), self.n_layers), UNLIMITED, dtype=torch.long)
        else:
            totals = torch.tensor([self.budget.total(self.n_layers, int(n)) for n in prompt.tolist()], dtype=torch.long)
            budgets = self.method.allocate(self, totals)
        for i, layer in enumerate(self.layers):
            layer.budget = budgets[:, i].to(layer.device)
        self.allocated = True

    def _target(self, layer: CompressedLayer) -> torch.Tensor:
        kept = layer.n_kept
        return torch.where(layer.budget == UNLIMITED, kept, torch.minimum(layer.budget, kept))

    def _compress_layer(self, layer: CompressedLayer, target: torch.Tensor) -> None:
        method = self.method
        scores = method.score(layer).float()
        protected = method.protected(layer, target)
        keep, keep_valid = select_kept(scores, protected, layer.token_index, target)
        keys, values = layer.gather_kv(keep)
        if method.merge is not None:
            evict, evict_valid = evicted_slots(layer.valid, keep, keep_valid, target)
            layer.merged += method.merge.merge(layer, keep, keys, values, keep_valid, evict, evict_valid)
        layer.keep(keep, keep_valid, keys, values)

    # -- inspection ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def report(self) -> CacheReport:
        layers = []
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            full = layer.real_seen.tolist()
            # What a plain cache would hold: the model's own KV heads, never repeated.
            heads, dim = self.config.num_key_value_heads, layer.keys.shape[-1]
            bytes_per_token = heads * dim * (layer.keys.element_size() + layer.values.element_size())
            budget = None if layer.budget is None else [None if b == UNLIMITED else b for b in layer.budget.tolist()]
            layers.append(
                LayerReport(
                    layer=layer.layer_idx,
                    budget=budget or [None] * len(full),
                    kept=layer.n_kept.tolist(),
                    full=full,
                    merged=layer.merged.tolist(),
                    kv_bytes=layer.nbytes,
                    state_bytes=layer.state_nbytes,
                    # What a DynamicCache would hold: every fed token, padding included.
                    kv_bytes_full=layer.seen * len(full) * bytes_per_token,
                    tau_history=[t.tolist() for t in layer.layer_state.get("tau_history", [])],
                )
            )
        return CacheReport(method=self.method.name, budget=str(self.budget), layers=layers)


def select_kept(
    scores: torch.Tensor, protected: torch.Tensor, token_index: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and KV head, the ``target[b]`` highest-scoring valid slots, protected ones first.

    ``scores``, ``protected`` and ``token_index`` are (B, G, N), ``target`` (B,). Equal scores
    (max pooling makes plateaus) go to the newer token, so where a token sits in storage never
    changes the choice. Returns slot indices (B, G, K) in increasing slot order, K = max(target),
    and (B, K) validity: row b's entries past ``target[b]`` are padding.
    """
    n_slots = scores.shape[-1]
    ranked = scores.masked_fill(protected, float("inf")).masked_fill(token_index < 0, float("-inf"))
    newest_first = token_index.argsort(dim=-1, descending=True)
    order = ranked.gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)
    width = int(target.max())
    top = newest_first.gather(-1, order[..., :width])
    keep_valid = torch.arange(width, device=scores.device)[None, :] < target[:, None]
    keep = top.masked_fill(~keep_valid[:, None, :], n_slots).sort(dim=-1).values.clamp_max(n_slots - 1)
    return keep, keep_valid


def evicted_slots(
    valid: torch.Tensor, keep: torch.Tensor, keep_valid: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid slots that ``keep`` leaves out: indices (B, G, E) and (B, E) validity."""
    batch, heads, _ = keep.shape
    kept = torch.zeros((batch, heads, valid.shape[-1]), dtype=torch.bool, device=valid.device)
    kept.scatter_(2, keep, keep_valid[:, None, :].expand_as(keep))
    evicted = valid[:, None, :] & ~kept
    count = valid.sum(-1) - target
    width = int(count.max())
    order = evicted.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[..., :width]
    evict_valid = torch.arange(width, device=valid.device)[None, :] < count[:, None]
    return order, evict_valid
