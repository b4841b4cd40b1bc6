"""Per-layer KV storage that really shrinks: slots of keys and values and what moves with them.

A layer stores keys and values as ``(batch, kv_heads, slots, head_dim)`` (KV heads are never
repeated) plus, for every slot and KV head, the index of the token it holds among its row's real
tokens (``-1`` marks an empty slot: left padding, a slot freed by an eviction, or the unused tail
of a row whose budget is smaller than its neighbour's). Slots need not be in token order, nor the
same in every KV head: keys are cached after RoPE, so a kept token carries its true position with
it, and the attention hook masks by slot validity, never by slot position. Methods keep per-slot
state (accumulated attention, ...) in ``slot_state``, which moves with the slots, and per-layer
state in ``state`` (a ``RowState``).

Decoding does not copy the layer: a step that evicts one token per row and KV head only marks its
slot empty, and the next token is written into that slot (``update``); a multi-token input is
appended, and an eviction of several tokens gathers the kept slots into new, smaller tensors, but
one made while decoding in batches of steps, which marks its slots empty for the next tokens. The
slots an eviction empties in every row are ``Vacancies``: where each of the next tokens goes, and
what it writes there, prepared at the eviction, so that a step between evictions writes its token
with four in-place writes and computes nothing about where.

How keys and values are stored is this class's narrow part (``_stored``/``_store``, ``_write``,
``_append``, ``attended``, ``settle``): slot operations apply to whatever per-slot tensors
``_stored`` gives, so that ``quantized.QuantizedLayer`` stores them packed at fewer bits.
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from d2o.engine.policy import Evicted
from d2o.engine.selection import row_offsets, take_rows, take_slots
from d2o.errors import D2OError

if TYPE_CHECKING:
    from d2o.engine.cache import CompressedCache

# The attention function of transformers does not receive the cache. A layer's `update` is always
# followed, in the same thread, by that layer's attention call on the very tensors `update`
# returned: `update` leaves its layer here and the hook claims it (see `claim_active_layer`).
_active = threading.local()

TOKEN_INDEX_DTYPE = torch.long  # each slot's token index, per KV head
HOOK_PREFIX = "d2o_"  # the attention implementations d2o registers are named d2o_sdpa and d2o_eager


def claim_active_layer(key: torch.Tensor) -> CompressedLayer | None:
    """The compressed layer whose ``update`` returned ``key``, or None if the cache is not d2o's."""
    layer, returned = getattr(_active, "layer", None), getattr(_active, "key", None)
    _active.layer = _active.key = None
    return None if layer is None or returned is not key else layer


@dataclass
class RowState:
    """Base of a method's per-layer state, whose fields hold one entry per row of the batch.

    A tensor field is (batch, ...) (None until first set); a list field is a history, one (batch,)
    tensor per event. Selecting rows (a finished request leaves) and joining caches (a request
    joins a running batch) map every field that way, so a method's state needs no code of its own
    for either; in a join, what a cache had not set yet is NaN for its rows.
    """

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


def _cat_rows(parts: list, rows: list[int]):
    """Per-row tensors of several caches one after the other; a missing one (None) is NaN."""
    example = next((part for part in parts if isinstance(part, torch.Tensor)), None)
    if example is None:
        return parts[0]
    return torch.cat([part if part is not None else example.new_full((n, *example.shape[1:]), math.nan)
                      for part, n in zip(parts, rows)])


def _state(layer: CompressedLayer, name: str, example: torch.Tensor) -> torch.Tensor:
    """``layer``'s slot state ``name``, or zeros shaped for its slots like ``example``'s."""
    if name in layer.slot_state:
        return layer.slot_state[name]
    return example.new_zeros((*layer.token_index.shape, *example.shape[3:]))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A (B, G, N, ...) tensor as (B * G * N, rest): a view, so writes into it land in ``tensor``."""
    return tensor.view(tensor.shape[0] * tensor.shape[1] * tensor.shape[2], -1)


@dataclass
class Vacancies:
    """The slots an eviction emptied in every row and KV head, each step's ready to write into:
    the next tokens take them in order. Per step: ``slots`` (B, G, 1) (the token's slot in each row
    and head); ``bias_slots`` (B, G, 1, 1) and ``key_slots``/``value_slots`` (B, G, 1, D), the same
    slots as scatter indices into the logit bias, the keys and the values; ``token_index`` (B, G, 1)
    the index the token gets and ``real_seen`` (B,) the row's tokens after it, if every token up to
    it is real (the prepared ones count so; a padded step computes them)."""

    slots: tuple[torch.Tensor, ...]
    bias_slots: tuple[torch.Tensor, ...]
    key_slots: tuple[torch.Tensor, ...]
    value_slots: tuple[torch.Tensor, ...]
    token_index: tuple[torch.Tensor, ...]
    real_seen: tuple[torch.Tensor, ...]
    taken: int = 0
    counted: bool = True  # False once a step had padding: its prepared indices no longer hold

    @classmethod
    def of(cls, slots: torch.Tensor, real_seen: torch.Tensor, key_dim: int, value_dim: int) -> Vacancies:
        """The vacancies ``slots`` (B, G, E) of a layer whose rows have seen ``real_seen`` (B,) tokens."""
        batch, heads, count = slots.shape
        steps = torch.arange(count, device=slots.device)
        key_slots = slots[..., None].expand(batch, heads, count, key_dim).split(1, 2)
        value_slots = key_slots if value_dim == key_dim else \
            slots[..., None].expand(batch, heads, count, value_dim).split(1, 2)
        return cls(slots=slots.split(1, 2), bias_slots=slots[:, :, None, :].split(1, 3), key_slots=key_slots,
                   value_slots=value_slots,
                   token_index=(real_seen[:, None, None] + steps).expand(batch, heads, count).split(1, 2),
                   real_seen=(real_seen[None, :] + steps[:, None] + 1).unbind(0))

    @property
    def left(self) -> int:
        return len(self.slots) - self.taken


def _defines_bias(name: str) -> property:
    """A layer's tensor the logit bias is made from (token indices, log weights): a new tensor drops
    the bias (in-place changes update it or drop it themselves)."""
    private = "_" + name

    def get(layer):
        return getattr(layer, private)

    def set_(layer, value):
        setattr(layer, private, value)
        layer._bias = None

    return property(get, set_)


def _with_empty_slots(tensor: torch.Tensor, count: int, fill) -> torch.Tensor:
    """``tensor`` (B, G, N, ...) with ``count`` more slots holding ``fill`` (itself when none)."""
    if count <= 0:
        return tensor
    return torch.cat([tensor, tensor.new_full((*tensor.shape[:2], count, *tensor.shape[3:]), fill)], dim=2)


def _map_field(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [fn(item) for item in value]
    return value


class CompressedLayer(CacheLayerMixin):
    """One layer's KV storage: keys, values, per-slot token indices and method state."""

    is_croppable = False  # eviction cannot be undone, so assisted decoding's rollback cannot work
    is_sliding = False
    _bias: torch.Tensor | None = None

    token_index = _defines_bias("token_index")
    log_weight = _defines_bias("log_weight")

    def __init__(self, cache: CompressedCache, layer_idx: int, window: int | None = None):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.window = window  # a sliding-window layer keeps the newest window - 1 tokens, as the stock cache
        self.is_sliding = window is not None
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.token_index: torch.Tensor | None = None  # (B, G, N) int64, -1 = empty slot
        # Method state that moves with the slots, each (B, G, N, ...): gathered on eviction,
        # zero-initialised for new tokens.
        self.slot_state: dict[str, torch.Tensor] = {}
        # (B, G, N) float32: the log of how many tokens each slot stands for (None: one each). A merge
        # that folds tokens into a slot raises it; the attention adds it to the slot's logits, so the
        # slot receives the attention of all its tokens.
        self.log_weight: torch.Tensor | None = None
        # Method state for the layer as a whole (e.g. D2O's merge threshold per row).
        self.state = self.cache.policy.new_layer_state() if self.cache is not None else None
        self.seen = 0  # tokens fed, padding included: the offset transformers counts positions from
        self.real_seen: torch.Tensor | None = None  # (B,) real tokens fed per row
        self.budget: torch.Tensor | None = None  # (B,) slots this layer may keep per row, once allocated
        self.merged: torch.Tensor | None = None  # (B,) evicted (token, KV head) pairs merged so far
        # While the cache is held: the latest window rows of attention, (B, G, group, w, N), across passes.
        self.held_window: torch.Tensor | None = None
        self.pending = 0  # tokens appended by `update` that the attention hook has not admitted yet
        self.written: torch.Tensor | None = None  # (B, G, 1): where `update` wrote a token in place
        self.vacancies: Vacancies | None = None  # the slots the last eviction emptied in every row, if any
        self._prepared: tuple[torch.Tensor, torch.Tensor] | None = None  # the written token's index, real_seen
        self._zeroed = False  # the written slot's state was zeroed when it was emptied
        # False when the layer never evicts by its policy's scores (a sliding-window layer, or once
        # allocated a layer that can never evict): its statistics are then not needed.
        self.observing = self.window is None
        # False while the tensors are shared with another cache (a fork): never written in place then.
        self.owns_storage = True
        self._offsets: torch.Tensor | None = None  # (B, G, 1): where each row and head starts in a flat view
        self._offsets_width = 0  # the slots per row and head those offsets were made for
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last two slots `rows_of` had, its answers

    # -- transformers' layer interface --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.key_dim, self.value_dim = dim, value_states.shape[-1]
        self.adopt(key_states.new_empty((batch, heads, 0, dim)),
                   value_states.new_empty((batch, heads, 0, self.value_dim)))
        self.token_index = torch.empty((batch, heads, 0), dtype=TOKEN_INDEX_DTYPE, device=self.device)
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.merged = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # Asked before anything is stored: the stock attention would run on this cache's tensors
        # (KV heads stored repeated fail there with a size mismatch) and never admit them.
        implementation = str(getattr(self.cache.config, "_attn_implementation", ""))
        if self.pending or not implementation.startswith(HOOK_PREFIX):
            raise D2OError(
                "the model's attention is not d2o's hook: call d2o.install(model) (d2o.load_model does it) "
                "before running it with a compressed cache"
            )
        if self.cache.kv_repeats > 1:  # the released D2O's storage: one copy of each KV head per query head
            key_states = key_states.repeat_interleave(self.cache.kv_repeats, dim=1)
            value_states = value_states.repeat_interleave(self.cache.kv_repeats, dim=1)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = key_states.shape[-2]
        written = self._next_slot() if self.pending == 1 else None
        if written is not None:  # one token per row and KV head, into an empty slot: nothing is copied
            self._write(written, key_states, value_states)
            self.written = written[0]
        else:
            self._append(key_states, value_states)
            self.written = self.vacancies = None
            self.owns_storage = True
        keys, values = self.attended()
        _active.layer, _active.key = self, keys
        return keys, values

    # -- how keys and values are stored (a quantized layer stores them otherwise) -----------------
    def _stored(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors the keys and values are stored as, each (B, G, N, ...): what slot
        operations (gather, padding, rows) apply to."""
        return {"keys": self.keys, "values": self.values}

    def _store(self, stored: dict[str, torch.Tensor]) -> None:
        self.keys, self.values = stored["keys"], stored["values"]

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys`` and ``values`` (B, G, N, D) as the slots' (a fork holds its source's, shared)."""
        self.keys, self.values = keys, values

    def _write(self, written: tuple[torch.Tensor, ...], key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one token per row and KV head into the slots ``written`` (from ``_next_slot``)."""
        _, key_slots, value_slots = written
        self.keys.scatter_(2, key_slots, key_states)
        self.values.scatter_(2, value_slots, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the attention reads, (B, G, N, D)."""
        return self.keys, self.values

    def settle(self) -> None:
        """The layer's pass is over (its attention ran, or its eviction): a quantized layer drops the
        full-precision copies it made for it."""

    def _next_slot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where one new token per row and KV head goes: its slots (B, G, 1) and those as indices into
        the keys and values; None when it must be appended (no empty slot in some row and head, or
        storage shared with another cache). The vacancies an eviction left come first."""
        if not self.owns_storage:
            return None
        vacancies = self.vacancies
        if vacancies is not None and vacancies.left:
            step = vacancies.taken
            vacancies.taken += 1
            self._zeroed = True
            self._prepared = (vacancies.token_index[step], vacancies.real_seen[step]) if vacancies.counted else None
            self._bias_slots = vacancies.bias_slots[step]
            return vacancies.slots[step], vacancies.key_slots[step], vacancies.value_slots[step]
        self.vacancies = None
        free = self.free_slots()
        if free is None:
            return None
        self._zeroed, self._prepared, self._bias_slots = False, None, free[:, :, None, :]
        batch, heads = free.shape[:2]
        return (free, free[..., None].expand(batch, heads, 1, self.key_dim),
                free[..., None].expand(batch, heads, 1, self.value_dim))

    def free_slots(self) -> torch.Tensor | None:
        """(B, G, 1): the first empty slot of every row and KV head, or None if one has none (or the
        tensors are shared with another cache)."""
        if not self.owns_storage:
            return None
        free = self.token_index < 0
        if not bool(free.any(-1).all()):
            return None
        return free.to(torch.uint8).argmax(-1, keepdim=True)

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B, G, K) as rows of the layer's tensors viewed flat, (B * G * N, ...): one
        index for keys, values, token indices and every slot state (``index_select``/``index_copy_``
        on it cost a few microseconds; a decode step makes ~10 per layer)."""
        batch, heads, n_slots = self.token_index.shape
        if self._offsets is None or self._offsets.shape[:2] != (batch, heads) or self._offsets_width != n_slots:
            self._offsets = row_offsets(batch, heads, n_slots, self.device)
            self._offsets_width = n_slots
            self._rows = []
        # A decode step asks four times for the victims' slots (they are copied, emptied, then the next
        # token is written there and admitted), a merge in between for its targets': each is computed once.
        for known, rows in self._rows:
            if known is slots:
                return rows
        rows = (slots + self._offsets).flatten()
        self._rows = [(slots, rows), *self._rows[:1]]
        return rows

    def fresh_slots(self, q: int) -> torch.Tensor:
        """(B, G, q): the slots of the tokens the last pass added."""
        if self.written is not None:
            return self.written
        batch, heads, n_slots = self.token_index.shape
        return torch.arange(n_slots - q, n_slots, device=self.token_index.device).expand(batch, heads, q)

    def fresh_index(self, q: int) -> torch.Tensor:
        """(B, q): the token index of each token of the last pass (-1: padding)."""
        return self.token_index[:, 0].gather(1, self.fresh_slots(q)[:, 0])

    def fresh_real(self, q: int) -> torch.Tensor:
        """(B, q) bool: which tokens of the last pass are real (not padding)."""
        return self.fresh_index(q) >= 0

    def get_seq_length(self) -> int:
        # Tokens seen, not kept: the model derives positions from it and `generate` decides from it
        # which input tokens are new.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.token_index is None else self.token_index.shape[-1]
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        observing = self.observing
        self._clear()
        self.observing = observing

    def crop(self, tokens_to_remove: int) -> None:
        raise D2OError("a compressed cache cannot be cropped: evicted tokens are gone (assisted decoding needs crop)")

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) the rows ``index`` (1-D) of every per-row tensor and state."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)

        def fn(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.index_select(0, index)

        self._store({name: fn(tensor) for name, tensor in self._stored().items()})
        self.token_index = fn(self.token_index)
        self.real_seen, self.merged = fn(self.real_seen), fn(self.merged)
        if self.budget is not None:
            self.budget = fn(self.budget)
        self.slot_state = {name: fn(t) for name, t in self.slot_state.items()}
        if self.log_weight is not None:
            self.log_weight = fn(self.log_weight)
        if self.state is not None:
            self.state = self.state.map_rows(fn)
        self.owns_storage = True
        self.vacancies = None

    def join(self, others: list[CompressedLayer]) -> None:
        """Append the rows of ``others`` (layers of caches of the same policy) to this layer's;
        storage is padded with empty slots to the widest."""
        layers = [self, *others]
        rows = [layer.token_index.shape[0] for layer in layers]
        width = max(layer.token_index.shape[2] for layer in layers)
        weighted = any(layer.log_weight is not None for layer in layers)
        weights = [layer.weights() for layer in layers] if weighted else None

        def padded(tensor: torch.Tensor, fill) -> torch.Tensor:
            return _with_empty_slots(tensor, width - tensor.shape[2], fill)

        # A kind of state one side has not made yet (a method may add one late: D2O's merge counts
        # appear at its first merge) is zeros there, as for a new token.
        examples = {}
        for layer in layers:
            for name, state in layer.slot_state.items():
                examples.setdefault(name, state)
        self.slot_state = {name: torch.cat([padded(_state(layer, name, example), 0) for layer in layers])
                           for name, example in examples.items()}
        stored = [layer._stored() for layer in layers]
        self._store({name: torch.cat([padded(part[name], 0) for part in stored]) for name in stored[0]})
        self.token_index = torch.cat([padded(layer.token_index, -1) for layer in layers])
        if weights is not None:
            self.log_weight = torch.cat([padded(weight, 0) for weight in weights])
        self.real_seen = torch.cat([layer.real_seen for layer in layers])
        self.merged = torch.cat([layer.merged for layer in layers])
        if self.budget is not None:
            self.budget = torch.cat([layer.budget for layer in layers])
        if self.state is not None:
            self.state = type(self.state).concat([layer.state for layer in layers], rows)
        self.seen = max(layer.seen for layer in layers)
        self.owns_storage = True
        self.vacancies = None

    def copy_for(self, cache: CompressedCache) -> CompressedLayer:
        """This layer as a layer of ``cache`` (``CompressedCache.copy``): storage shared, written in
        place by neither from now on; the state that is accumulated into, copied."""
        new = copy.copy(self)
        new.cache = cache
        self.owns_storage = new.owns_storage = False
        self.vacancies = new.vacancies = None
        new._bias = None  # made again from its own log weights (the bias is updated in place)
        if not self.is_initialized:
            return new
        new.slot_state = {name: state.clone() for name, state in self.slot_state.items()}
        new.log_weight = None if self.log_weight is None else self.log_weight.clone()
        new.merged = self.merged.clone()
        if self.state is not None:
            new.state = self.state.map_rows(torch.clone)
        return new

    # -- probing: passes observed, then taken out ------------------------------------------------
    def snapshot(self) -> tuple:
        """What ``restore`` needs to take out every token fed after this call (nothing is evicted
        in between: a probe runs before compression)."""
        return (self._stored(), self.token_index, self.log_weight, self.real_seen, self.seen, self.owns_storage)

    def restore(self, snapshot: tuple) -> None:
        """The layer as it was at ``snapshot``, but for the slot state that the passes since wrote
        into its slots (a probe's statistics); the tokens fed since are gone."""
        stored, self.token_index, self.log_weight, self.real_seen, self.seen, self.owns_storage = snapshot
        self._store(stored)
        if self.token_index is None:
            return
        n_slots = self.token_index.shape[2]
        self.slot_state = {name: state[:, :, :n_slots].contiguous() for name, state in self.slot_state.items()}
        self.written = self.vacancies = self.held_window = None

    # -- what the attention hook and the methods use --------------------------------------------
    def admit(self, new_valid: torch.Tensor | None) -> None:
        """Record the tokens ``update`` added: ``new_valid`` (B, q) is False for padding (None: all real)."""
        q = self.pending
        batch, heads = self.token_index.shape[:2]
        self.seen += q
        self.pending = 0
        if self.written is not None and self._prepared is not None and new_valid is None:
            index, self.real_seen = self._prepared  # a step into a vacancy, prepared at the eviction
            self._token_index.scatter_(2, self.written, index)
            if self._bias is not None:
                self._bias.scatter_(3, self._bias_slots, 0.0)  # its log weight, zeroed when it was emptied
            return
        if new_valid is None:
            index = self.real_seen[:, None] if q == 1 else self.real_seen[:, None] + torch.arange(q, device=self.device)
            added = q
        else:
            index = (self.real_seen[:, None] + new_valid.long().cumsum(-1) - 1).masked_fill(~new_valid, -1)
            added = new_valid.sum(-1)
            if self.vacancies is not None:
                self.vacancies.counted = False  # its prepared indices assumed every token real
        if self.written is not None:
            self._token_index.scatter_(2, self.written, index[:, None, :].expand(batch, heads, 1))
            if not self._zeroed:
                self._clear_state(self.rows_of(self.written))
            self._bias = None
        else:
            self.token_index = torch.cat([self.token_index, index[:, None, :].expand(batch, heads, q)], dim=2)
            for name, state in self.slot_state.items():
                fresh = state.new_zeros((*state.shape[:2], q, *state.shape[3:]))
                self.slot_state[name] = torch.cat([state, fresh], dim=2)
            if self.log_weight is not None:
                self.log_weight = torch.cat([self.log_weight, self.log_weight.new_zeros((batch, heads, q))], dim=2)
        self.real_seen = self.real_seen + added

    def logit_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, G, 1, N) what the attention adds to each slot's logit: its log weight (0 for a slot
        standing for one token), the lowest value of ``dtype`` for an empty slot. Made once and kept
        up to date in place while tokens are written into vacancies; made again after anything else
        changes the slots."""
        bias = self._bias
        if bias is None or bias.dtype != dtype:
            index = self._token_index
            bias = (index.new_zeros(index.shape, dtype=dtype) if self._log_weight is None
                    else self._log_weight.to(dtype, copy=True))
            bias = self._bias = bias.masked_fill_(index < 0, torch.finfo(dtype).min)[:, :, None, :]
        return bias

    @property
    def valid(self) -> torch.Tensor:
        """(B, G, N) bool: which slots hold a token, per KV head."""
        return self.token_index >= 0

    @property
    def n_kept(self) -> torch.Tensor:
        """(B,) tokens held per row (every KV head of a row holds as many)."""
        return (self.token_index[:, 0] >= 0).sum(-1)

    def weights(self) -> torch.Tensor:
        """(B, G, N) float32: the log weight of every slot, made (zeros) if no merge has set one."""
        if self.log_weight is None:
            self.log_weight = torch.zeros(self.token_index.shape, dtype=torch.float32, device=self.token_index.device)
        return self.log_weight

    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values (empty slots of a padded batch included)."""
        if not self.is_initialized:
            return 0
        return sum(tensor.nbytes for tensor in self._stored().values())

    @property
    def nbytes_parts(self) -> dict[str, int]:
        """``nbytes`` by part, for a layer that stores keys and values quantized (here: none)."""
        return {}

    @property
    def state_nbytes(self) -> int:
        """Bytes of the per-slot bookkeeping: token indices and method state."""
        if not self.is_initialized:
            return 0
        weights = 0 if self.log_weight is None else self.log_weight.nbytes
        return self.token_index.nbytes + weights + sum(state.nbytes for state in self.slot_state.values())

    def evicted(self, slots: torch.Tensor, valid: torch.Tensor, states: tuple[str, ...] | None = None,
                vectors: tuple[str, ...] = ("keys", "values")) -> Evicted:
        """Copies of what the slots (B, G, E) hold, before they are evicted; ``valid`` (B, E);
        ``states``: the slot states to copy (None: all of them); ``vectors``: which of the keys and
        values to copy (the other is None)."""
        rows = self.rows_of(slots)  # one index for every tensor

        def take(tensor: torch.Tensor) -> torch.Tensor:
            return take_rows(tensor, rows, slots.shape)

        taken = self._take_vectors(take, vectors)
        return Evicted(keys=taken.get("keys"), values=taken.get("values"),
                       token_index=take(self.token_index),
                       valid=valid, slot_state={name: take(state) for name, state in self.slot_state.items()
                                                if states is None or name in states},
                       log_weight=None if self.log_weight is None else take(self.log_weight))

    def _take_vectors(self, take, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``vectors`` ("keys", "values") of some slots, copied by ``take`` (a function of a per-slot tensor)."""
        return {name: take(self.keys if name == "keys" else self.values) for name in vectors}

    def drop(self, slots: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Empty the slot ``slots`` (B, G, 1) of every KV head of the rows ``rows`` (B,) bool (None:
        every row), in place: the next token of such a row is written there."""
        flat = self.rows_of(slots)
        if rows is None:
            self.token_index.view(-1).index_fill_(0, flat, -1)
            self._vacate(slots, flat)
        else:
            self.token_index.view(-1).index_fill_(0, flat[rows[:, None].expand(slots.shape[:2]).flatten()], -1)
            self._bias = None

    def drop_many(self, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Empty the slots ``slots`` (B, G, E) where ``valid`` (B, E), in place: the next tokens are
        written there (eviction in batches of decode steps)."""
        index = self.token_index
        if bool(valid.all()):
            index.scatter_(2, slots, -1)
            self._vacate(slots, self.rows_of(slots))
        else:
            index.scatter_(2, slots, torch.where(valid[:, None, :], -1, index.gather(2, slots)))
            self._bias = None
            self.vacancies = None

    def _clear_state(self, rows: torch.Tensor) -> None:
        """Zero the method's state and the log weight of the slots at ``rows`` of the flat views, in
        place (the logit bias is left to the caller)."""
        for state in self.slot_state.values():
            _flat(state).index_fill_(0, rows, 0)
        if self._log_weight is not None:
            self._log_weight.view(-1).index_fill_(0, rows, 0)

    def _vacate(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The slots (B, G, E) (``rows`` of the flat views), just emptied in every row and head, become
        the vacancies the next tokens take: what they held of the method's state and their log weight
        is zeroed now (a token written there starts from nothing) and the logit bias masks them."""
        self._clear_state(rows)  # in place: the bias is updated below
        if self._bias is not None:
            self._bias.view(-1).index_fill_(0, rows, torch.finfo(self._bias.dtype).min)
        self.vacancies = Vacancies.of(slots, self.real_seen, self.key_dim, self.value_dim)

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        """Shrink to the slots ``keep`` (B, G, K), gathered into new tensors; ``keep_valid`` (B, K)
        marks the real ones (rows of a batch with smaller budgets have an empty tail). ``slack``
        empty slots more (decoding in batches of that many steps) become the vacancies the next
        tokens are written into: no step before the next eviction copies the layer."""
        stored = {name: take_slots(tensor, keep) for name, tensor in self._stored().items()}
        token_index = self.token_index.gather(2, keep)
        if not bool(keep_valid.all()):
            empty = ~keep_valid[:, None, :]
            for tensor in stored.values():
                tensor.masked_fill_(empty.view(*empty.shape, *(1,) * (tensor.dim() - 3)), 0)
            token_index.masked_fill_(empty, -1)
        slot_state = {name: take_slots(state, keep) for name, state in self.slot_state.items()}
        log_weight = None if self.log_weight is None else take_slots(self.log_weight, keep)
        if slack:
            stored = {name: _with_empty_slots(tensor, slack, 0) for name, tensor in stored.items()}
            token_index = _with_empty_slots(token_index, slack, -1)
            slot_state = {name: _with_empty_slots(state, slack, 0) for name, state in slot_state.items()}
            log_weight = None if log_weight is None else _with_empty_slots(log_weight, slack, 0)
        self._store(stored)
        self.token_index, self.log_weight = token_index, log_weight
        self.slot_state = slot_state
        self.owns_storage = True
        self.vacancies = None
        if slack:  # each row's empty tail starts after its kept slots
            batch, heads = token_index.shape[:2]
            tail = keep_valid.sum(-1)[:, None, None] + torch.arange(slack, device=self.device)
            self.vacancies = Vacancies.of(tail.expand(batch, heads, slack), self.real_seen, self.key_dim,
                                          self.value_dim)
