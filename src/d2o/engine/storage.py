"""A layer's KV storage that really shrinks: its ``SlotTable`` (``slots``) and what it is fed.

Keys and values are stored as ``(batch, kv_heads, slots, head_dim)`` (KV heads are never repeated)
with, for every slot and KV head, the index of the token it holds among its row's real tokens (-1:
an empty slot: left padding, a slot freed by an eviction, or the unused tail of a row whose budget
is smaller than its neighbour's). Slots need not be in token order, nor the same in every KV head:
keys are cached after RoPE, so a kept token carries its true position with it, and the attention
hook masks by slot validity, never by slot position.

Decoding does not copy the layer: a step that evicts one token per row and KV head only marks its
slot empty, and the next token is written into that slot (``update``); a multi-token input is
appended, and an eviction of several tokens gathers the kept slots into new, smaller tensors, but
one made while decoding in batches of steps, which marks its slots empty for the next tokens
(``Vacancies``: where each of the next tokens goes, prepared at the eviction, so that a step writes
its token with four in-place writes and computes nothing about where).

The layer is the only writer of its storage: what a method changes comes back as an ``Observed``
or a ``Merged`` (``engine.api``) and the layer applies it. How keys and values are stored is this
class's narrow part (``_stored_form``, ``_write``, ``_append``, ``attended``, ``_write_vectors``,
``settle``), which ``quantized.QuantizedLayer`` does otherwise.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from d2o.engine.api import Evicted, Merged, Observed
from d2o.engine.selection import flat_offsets, take_flat
from d2o.engine.slots import SlotTable, Vacancies
from d2o.errors import D2OError

TOKEN_INDEX_DTYPE = torch.long  # each slot's token index, per KV head
HOOK_PREFIX = "d2o_"  # the attention implementations d2o registers are named d2o_sdpa and d2o_eager
ROW_FIELDS = ("real_seen", "merged", "budget")  # the layer's per-row tensors, (B,) each


class CompressedLayer(CacheLayerMixin):
    """One layer's KV storage: its slot table, its rows' counts and the method's per-layer state."""

    is_croppable = False  # eviction cannot be undone, so assisted decoding's rollback cannot work
    is_sliding = False

    def __init__(self, cache, layer_idx: int, window: int | None = None):
        self.cache = cache
        self.layer_idx = layer_idx
        self.window = window  # a sliding-window layer keeps the newest window - 1 tokens, as the stock cache
        self.is_sliding = window is not None
        # False when the layer never evicts by its policy's scores (a sliding-window layer, or once
        # allocated a layer that can never evict): its statistics are then not needed.
        self.observing = window is None
        self.view = None  # the layer as its policy reads it (an ``api.LayerView``), set by the cache
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.slots: SlotTable | None = None
        # The method's per-layer state (a ``RowState``); a layer of no cache is a method's part tested alone.
        self.state = None if self.cache is None else self.cache.policy.new_layer_state()
        self.seen = 0  # tokens fed, padding included: the offset transformers counts positions from
        self.real_seen: torch.Tensor | None = None  # (B,) real tokens fed per row
        self.budget: torch.Tensor | None = None  # (B,) slots this layer may keep per row, once allocated
        self.merged: torch.Tensor | None = None  # (B,) evicted (token, KV head) pairs merged so far
        # Inside a hold: the attention rows of the latest window queries over every token, across passes.
        self.carried_window: torch.Tensor | None = None
        self.pending = 0  # tokens appended by `update` that the attention hook has not admitted yet
        self.written: torch.Tensor | None = None  # (B, G, 1): where `update` wrote a token in place
        self.vacancies: Vacancies | None = None  # the slots the last eviction emptied in every row, if any
        self._prepared: tuple[torch.Tensor, torch.Tensor] | None = None  # the written token's index, real_seen
        self._zeroed = False  # the written slot's state was zeroed when it was emptied
        self._bias: torch.Tensor | None = None  # (B, G, 1, N): see `logit_bias`
        # False while the tensors are shared with another cache (a copy): never written in place then.
        self.owns_storage = True
        self._offsets: torch.Tensor | None = None  # (B, G, 1): where each row and head starts in a flat view
        self._flat_known: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last two slots `flat` had, its answers

    # -- what the table holds -------------------------------------------------------------------
    @property
    def token_index(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.token_index

    @property
    def log_weight(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.log_weight

    @property
    def slot_state(self) -> dict[str, torch.Tensor]:
        return {} if self.slots is None else self.slots.state

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.vectors["keys"]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.slots is None else self.slots.vectors["values"]

    @property
    def valid(self) -> torch.Tensor:
        """(B, G, N) bool: which slots hold a token, per KV head."""
        return self.slots.token_index >= 0

    @property
    def n_kept(self) -> torch.Tensor:
        """(B,) tokens held per row (every KV head of a row holds as many)."""
        return (self.slots.token_index[:, 0] >= 0).sum(-1)

    def weights(self) -> torch.Tensor:
        """(B, G, N) float32: the log weight of every slot (zeros where none has been set)."""
        table = self.slots
        return table.log_weight if table.log_weight is not None else \
            torch.zeros(table.token_index.shape, dtype=torch.float32, device=table.token_index.device)

    def _set(self, table: SlotTable) -> None:
        self.slots, self._bias = table, None

    # -- transformers' layer interface --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.key_dim, self.value_dim = dim, value_states.shape[-1]
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.merged = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True
        self.adopt(key_states.new_empty((batch, heads, 0, dim)),
                   value_states.new_empty((batch, heads, 0, self.value_dim)),
                   SlotTable({}, torch.empty((batch, heads, 0), dtype=TOKEN_INDEX_DTYPE, device=self.device)))

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, table: SlotTable) -> None:
        """Hold ``keys`` and ``values`` (B, G, N, D), with the other fields of ``table`` (a fork holds
        its source's tensors, shared)."""
        self._set(SlotTable(self._stored_form(keys, values), table.token_index, table.log_weight, table.state))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # Asked before anything is stored: the stock attention would run on this cache's tensors
        # (KV heads stored repeated fail there with a size mismatch) and never admit them.
        implementation = str(getattr(self.cache.facts.config, "_attn_implementation", ""))
        if self.pending or not implementation.startswith(HOOK_PREFIX):
            raise D2OError("the model's attention is not d2o's hook: call d2o.install(model) (d2o.load_model does it) "
                           "before running it with a compressed cache")
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
        return self.attended()

    def get_seq_length(self) -> int:
        # Tokens seen, not kept: the model derives positions from it and `generate` decides from it
        # which input tokens are new.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.slots is None else self.slots.width
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        observing = self.observing
        self._clear()
        self.observing = observing

    def crop(self, tokens_to_remove: int) -> None:
        raise D2OError("a compressed cache cannot be cropped: evicted tokens are gone (assisted decoding needs crop)")

    # -- how keys and values are stored (a quantized layer stores them otherwise) -----------------
    def _stored_form(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table's ``vectors`` for ``keys`` and ``values`` (B, G, N, D)."""
        return {"keys": keys, "values": values}

    def _write(self, written: tuple[torch.Tensor, ...], key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one token per row and KV head into the slots ``written`` (from ``_next_slot``)."""
        _, key_slots, value_slots = written
        self.keys.scatter_(2, key_slots, key_states)
        self.values.scatter_(2, value_slots, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        vectors = self.slots.vectors
        vectors["keys"] = torch.cat([vectors["keys"], key_states], dim=-2)
        vectors["values"] = torch.cat([vectors["values"], value_states], dim=-2)

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the attention reads, (B, G, N, D)."""
        return self.keys, self.values

    def _write_vectors(self, merged: Merged) -> None:
        """Write the keys and values a merge gives (in place at its slots: the layer owns them then)."""
        for name, new in (("keys", merged.keys), ("values", merged.values)):
            if new is None:
                continue
            if merged.slots is None and not self.owns_storage:
                self.slots.vectors[name] = new
            elif merged.slots is None:  # in place: a layer is not copied between evictions
                self.slots.vectors[name].copy_(new)
            else:
                stored = self.slots.vectors[name]
                stored.view(-1, stored.shape[-1]).index_copy_(0, self.flat(merged.slots), new.view(-1, new.shape[-1]))

    def _take_vectors(self, take, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``vectors`` ("keys", "values") of some slots, copied by ``take`` (a function of a per-slot tensor)."""
        return {name: take(self.slots.vectors[name]) for name in vectors}

    def settle(self) -> None:
        """The layer's pass is over (its attention ran, or its eviction): a quantized layer drops the
        full-precision copies it made for it."""

    # -- writing what a pass added ----------------------------------------------------------------
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
        free = self.slots.token_index < 0
        if not bool(free.any(-1).all()):
            return None
        free = free.to(torch.uint8).argmax(-1, keepdim=True)  # the first empty slot of every row and head
        self._zeroed, self._prepared, self._bias_slots = False, None, free[:, :, None, :]
        batch, heads = free.shape[:2]
        return (free, free[..., None].expand(batch, heads, 1, self.key_dim),
                free[..., None].expand(batch, heads, 1, self.value_dim))

    def admit(self, new_valid: torch.Tensor | None) -> None:
        """Record the tokens ``update`` added: ``new_valid`` (B, q) is False for padding (None: all real)."""
        q = self.pending
        table = self.slots
        batch, heads = table.token_index.shape[:2]
        self.seen += q
        self.pending = 0
        if self.written is not None and self._prepared is not None and new_valid is None:
            index, self.real_seen = self._prepared  # a step into a vacancy, prepared at the eviction
            table.token_index.scatter_(2, self.written, index)
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
            table.token_index.scatter_(2, self.written, index[:, None, :].expand(batch, heads, 1))
            if not self._zeroed:
                table.clear(self.flat(self.written))
        else:
            table.grow(index[:, None, :].expand(batch, heads, q))
        self._bias = None
        self.real_seen = self.real_seen + added

    def logit_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, G, 1, N) what the attention adds to each slot's logit: its log weight (0 for a slot
        standing for one token), the lowest value of ``dtype`` for an empty slot. Made once and kept
        up to date in place while tokens are written into vacancies; made again after anything else
        changes the slots."""
        bias = self._bias
        if bias is None or bias.dtype != dtype:
            index, log_weight = self.slots.token_index, self.slots.log_weight
            bias = index.new_zeros(index.shape, dtype=dtype) if log_weight is None else log_weight.to(dtype, copy=True)
            bias = self._bias = bias.masked_fill_(index < 0, torch.finfo(dtype).min)[:, :, None, :]
        return bias

    def flat(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B, G, K) as indices into the flat views (B * G * N, ...) of the table's fields:
        one index for all of them (``index_select``/``index_copy_`` on it cost a few microseconds; a
        decode step makes ~10 per layer)."""
        batch, heads, n_slots = self.slots.token_index.shape
        offsets = self._offsets
        if offsets is None or offsets.shape[:2] != (batch, heads) or self._offsets_width != n_slots:
            offsets = self._offsets = flat_offsets(batch, heads, n_slots, self.device)
            self._offsets_width = n_slots
            self._flat_known = []
        # A decode step asks four times for the victims' slots (they are copied, emptied, then the next
        # token is written there and admitted), a merge in between for its targets': each is computed once.
        for known, index in self._flat_known:
            if known is slots:
                return index
        index = (slots + offsets).flatten()
        self._flat_known = [(slots, index), *self._flat_known[:1]]
        return index

    def fresh_slots(self, q: int) -> torch.Tensor:
        """(B, G, q): the slots of the tokens the last pass added."""
        if self.written is not None:
            return self.written
        batch, heads, n_slots = self.slots.token_index.shape
        return torch.arange(n_slots - q, n_slots, device=self.device).expand(batch, heads, q)

    def fresh_index(self, q: int) -> torch.Tensor:
        """(B, q): the token index of each token of the last pass (-1: padding)."""
        return self.slots.token_index[:, 0].gather(1, self.fresh_slots(q)[:, 0])

    # -- what a method returns, written ------------------------------------------------------------
    def apply_observed(self, observed: Observed | None) -> None:
        if observed is None:
            return
        state = self.slots.state
        for name, added in observed.added.items():
            if name in state:
                state[name] += added
            else:
                state[name] = added.contiguous()
        state.update(observed.slot_state)
        if observed.state is not None:
            self.state = observed.state

    def apply_merged(self, merged: Merged) -> None:
        self.merged += merged.count
        if merged.keys is not None or merged.values is not None:
            self._write_vectors(merged)
        if merged.log_weight is not None:
            self.slots.log_weight, self._bias = merged.log_weight, None
        self.slots.state.update(merged.slot_state)
        if merged.state is not None:
            self.state = merged.state

    def record(self, name: str, values: torch.Tensor, decay: float) -> None:
        """Write the new tokens' ``values`` (B, q) into the slot state ``name``, the older tokens'
        first multiplied by ``decay``."""
        batch, n_new = values.shape
        scores = self.slots.state.get(name)
        if scores is None:
            scores = torch.zeros(self.slots.token_index.shape, dtype=torch.float32, device=values.device)
        elif decay != 1.0:
            scores *= decay  # the new tokens' slots are overwritten just below
        heads = self.slots.token_index.shape[1]
        scores.scatter_(2, self.fresh_slots(n_new), values[:, None, :].expand(batch, heads, n_new))
        self.slots.state[name] = scores

    # -- eviction -------------------------------------------------------------------------------
    def evicted(self, slots: torch.Tensor, valid: torch.Tensor, states: tuple[str, ...] | None = None,
                vectors: tuple[str, ...] = ("keys", "values")) -> Evicted:
        """Copies of what the slots (B, G, E) hold, before they are evicted; ``valid`` (B, E);
        ``states``: the slot states to copy (None: all of them); ``vectors``: which of the keys and
        values to copy (the other is None)."""
        index = self.flat(slots)
        taken = self._take_vectors(lambda tensor: take_flat(tensor, index, slots.shape), vectors)
        return Evicted(keys=taken.get("keys"), values=taken.get("values"), valid=valid,
                       **self.slots.copies(index, slots.shape, states))

    def drop(self, slots: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Empty the slot ``slots`` (B, G, 1) of every KV head of the rows ``rows`` (B,) bool (None:
        every row), in place: the next token of such a row is written there."""
        index = self.flat(slots)
        if rows is None:
            self.slots.token_index.view(-1).index_fill_(0, index, -1)
            self._vacate(slots, index)
        else:
            self.slots.token_index.view(-1).index_fill_(0, index[rows[:, None].expand(slots.shape[:2]).flatten()], -1)
            self._bias = None

    def drop_many(self, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Empty the slots ``slots`` (B, G, E) where ``valid`` (B, E), in place: the next tokens are
        written there (eviction in batches of decode steps)."""
        index = self.slots.token_index
        if bool(valid.all()):
            index.scatter_(2, slots, -1)
            self._vacate(slots, self.flat(slots))
        else:
            index.scatter_(2, slots, torch.where(valid[:, None, :], -1, index.gather(2, slots)))
            self._bias = None
            self.vacancies = None

    def _vacate(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        """The slots (B, G, E) (``index`` of the flat views), just emptied in every row and head, become
        the vacancies the next tokens take: what they held of the method's state and their log weight
        is zeroed now (a token written there starts from nothing) and the logit bias masks them."""
        self.slots.clear(index)
        if self._bias is not None:
            self._bias.view(-1).index_fill_(0, index, torch.finfo(self._bias.dtype).min)
        self.vacancies = Vacancies.of(slots, self.real_seen, self.key_dim, self.value_dim)

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        """Shrink to the slots ``keep`` (B, G, K), gathered into new tensors; ``keep_valid`` (B, K)
        marks the real ones (rows of a batch with smaller budgets have an empty tail). ``slack``
        empty slots more (decoding in batches of that many steps) become the vacancies the next
        tokens are written into: no step before the next eviction copies the layer."""
        self._set(self.slots.take(keep, keep_valid, slack))
        self.owns_storage = True
        self.vacancies = None
        if slack:  # each row's empty tail starts after its kept slots
            batch, heads = keep.shape[:2]
            tail = keep_valid.sum(-1)[:, None, None] + torch.arange(slack, device=self.device)
            self.vacancies = Vacancies.of(tail.expand(batch, heads, slack), self.real_seen, self.key_dim,
                                          self.value_dim)

    # -- rows, copies and snapshots ---------------------------------------------------------------
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) the rows ``index`` (1-D) of every per-row tensor and state."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        self._set(self.slots.select_rows(index))
        for name in ROW_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, index))
        if self.state is not None:
            self.state = self.state.map_rows(lambda tensor: tensor.index_select(0, index))
        self.owns_storage = True
        self.vacancies = None

    def join(self, others: list[CompressedLayer]) -> None:
        """Append the rows of ``others`` (layers of caches of the same policy) to this layer's;
        storage is padded with empty slots to the widest."""
        layers = [self, *others]
        rows = [layer.slots.token_index.shape[0] for layer in layers]
        self._set(SlotTable.join([layer.slots for layer in layers]))
        for name in ROW_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, torch.cat([getattr(layer, name) for layer in layers]))
        if self.state is not None:
            self.state = type(self.state).concat([layer.state for layer in layers], rows)
        self.seen = max(layer.seen for layer in layers)
        self.owns_storage = True
        self.vacancies = None

    def copy_for(self, cache) -> CompressedLayer:
        """This layer as a layer of ``cache`` (``CompressedCache.copy``): storage shared, written in
        place by neither from now on; what is accumulated into, copied."""
        new = copy.copy(self)
        new.cache = cache
        self.owns_storage = new.owns_storage = False
        self.vacancies = new.vacancies = None
        new._bias = None  # made again from its own log weights (the bias is updated in place)
        if not self.is_initialized:
            return new
        new.slots = self.slots.shared()
        new.merged = self.merged.clone()
        if self.state is not None:
            new.state = self.state.map_rows(torch.clone)
        return new

    def snapshot(self) -> tuple:
        """What ``restore`` needs to take out every token fed after this call (nothing is evicted
        in between: a probe runs before compression)."""
        return self.slots.snapshot(), self.real_seen, self.seen, self.owns_storage

    def restore(self, snapshot: tuple) -> None:
        """The layer as it was at ``snapshot``, but for the slot state that the passes since wrote
        into its slots (a probe's statistics); the tokens fed since are gone."""
        table, self.real_seen, self.seen, self.owns_storage = snapshot
        self._set(self.slots.restored(table))
        self.written = self.vacancies = self.carried_window = None

    # -- memory and saving ------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values (empty slots of a padded batch included)."""
        return 0 if self.slots is None else self.slots.vector_bytes

    @property
    def nbytes_parts(self) -> dict[str, int]:
        """``nbytes`` by part, for a layer that stores keys and values quantized (here: none)."""
        return {}

    @property
    def state_nbytes(self) -> int:
        """Bytes of the per-slot bookkeeping: token indices, log weights and method state."""
        return 0 if self.slots is None else self.slots.bookkeeping_bytes

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Its tensors by name, and the rest it needs to be rebuilt (``load_state_dict``)."""
        tensors = {**self.slots.state_dict(),
                   **{name: getattr(self, name) for name in ROW_FIELDS if getattr(self, name) is not None}}
        layout = {}
        if self.state is not None:
            state, layout = self.state.state_dict()
            tensors.update({f"state.{name}": tensor for name, tensor in state.items()})
        return tensors, {"seen": self.seen, "observing": self.observing, "slots": sorted(self.slots.state),
                         "state": layout, "dims": [self.key_dim, self.value_dim]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        token_index = tensors["token_index"]
        batch, heads = token_index.shape[:2]
        self.lazy_initialization(*(torch.empty((batch, heads, 0, dim), dtype=dtype, device=token_index.device)
                                   for dim in meta["dims"]))
        self._set(SlotTable.from_state_dict(tensors))
        for name in ROW_FIELDS:
            setattr(self, name, tensors.get(name))
        self.seen, self.observing = meta["seen"], meta["observing"]
        if self.state is not None:
            self.state = self.state.load_state_dict({name[len("state."):]: tensor for name, tensor in tensors.items()
                                                     if name.startswith("state.")}, meta["state"])
