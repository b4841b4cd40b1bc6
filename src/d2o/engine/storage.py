"""A layer's KV storage that really shrinks: its slot table (``slots``) and what it is fed.

Keys and values are (batch, kv_heads, slots, head_dim), KV heads never repeated, with each slot's
token index (-1: empty: padding, a freed slot, the tail of a row keeping fewer than its batch).
Slots are in no order, nor alike across KV heads: keys are cached after RoPE and the attention
masks by slot validity. Decoding copies nothing: a step evicting one token per row and head empties
its slot for the next token; an eviction of more gathers the kept slots into new tensors, but one
made while decoding in batches of steps empties its slots, the ``Vacancies`` the next tokens take.

The layer is the only writer of its storage: what a method changes comes back as an ``Observed``
or a ``Merged`` and the layer applies it. How keys and values are stored is its narrow part
(``_stored_form``, ``_write``, ``_append``, ``attended``, ``_write_vectors``, ``_take_vectors``,
``settle``), which ``quantized.QuantizedLayer`` does otherwise.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from d2o.engine.api import Evicted, Merged, Observed
from d2o.engine.selection import take_flat
from d2o.engine.slots import TOKEN_INDEX_DTYPE, SlotTable, Vacancies, named
from d2o.errors import D2OError

HOOK_PREFIX = "d2o_"  # the attention implementations d2o registers are named d2o_sdpa and d2o_eager


class CompressedLayer(CacheLayerMixin):
    """One layer's KV storage: its slot table, its rows' counts and the method's per-layer state."""

    is_croppable = False  # eviction cannot be undone, so assisted decoding's rollback cannot work
    is_sliding = False
    row_fields = ("real_seen", "merged", "budget")  # its per-row tensors, (B, ...) each (None until set)

    def __init__(self, cache, layer_idx: int, window: int | None = None):
        self.cache, self.layer_idx = cache, layer_idx
        self.window = window  # a sliding-window layer keeps the newest window - 1 tokens, as the stock cache
        self.is_sliding = window is not None
        self.observing = window is None  # False: it never evicts by the policy's scores, which it needs not
        self.view = None  # the layer as its policy reads it (an ``api.LayerView``), set by the cache
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.slots: SlotTable | None = None
        # The method's per-layer state (a layer of no cache: a method's part tested alone).
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
        self.owns_storage = True  # False while shared with another cache (a copy): never written in place

    # -- what the table holds (None before the first token) ---------------------------------------
    token_index = property(lambda layer: layer.slots and layer.slots.token_index)
    log_weight = property(lambda layer: layer.slots and layer.slots.log_weight)
    slot_state = property(lambda layer: {} if layer.slots is None else layer.slots.state)
    keys = property(lambda layer: layer.slots and layer.slots.vectors["keys"])
    values = property(lambda layer: layer.slots and layer.slots.vectors["values"])
    valid = property(lambda layer: layer.slots.token_index >= 0, doc="(B, G, N) bool: the slots holding a token.")
    n_kept = property(lambda layer: (layer.slots.token_index[:, 0] >= 0).sum(-1), doc="(B,) tokens held per row.")

    def head_counts(self) -> torch.Tensor:
        """(B, G): the tokens each stored KV head holds."""
        return (self.slots.token_index >= 0).sum(-1)

    def weights(self) -> torch.Tensor:
        """(B, G, N) float32: the log weight of every slot (zeros where none is set)."""
        index = self.slots.token_index
        return self.slots.log_weight if self.slots.log_weight is not None else \
            torch.zeros(index.shape, dtype=torch.float32, device=index.device)

    def _set(self, table: SlotTable) -> None:
        self.slots, self._bias = table, None

    # -- transformers' layer interface --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.key_dim, self.value_dim = dim, value_states.shape[-1]
        self.real_seen, self.merged = (torch.zeros(batch, dtype=torch.long, device=self.device) for _ in range(2))
        self.is_initialized = True
        self.adopt(key_states.new_empty((batch, heads, 0, dim)),
                   value_states.new_empty((batch, heads, 0, self.value_dim)),
                   SlotTable({}, torch.empty((batch, heads, 0), dtype=TOKEN_INDEX_DTYPE, device=self.device)))

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, table: SlotTable) -> None:
        """Hold ``keys`` and ``values`` (B, G, N, D) with ``table``'s other fields (a fork's, shared)."""
        self._set(SlotTable(self._stored_form(keys, values), table.token_index, table.log_weight, table.state))

    def _check_hooked(self) -> None:
        """Before anything is stored: the stock attention would run on the keys and never admit them."""
        implementation = str(getattr(self.cache.facts.config, "_attn_implementation", ""))
        if self.pending or not implementation.startswith(HOOK_PREFIX):
            raise D2OError("the model's attention is not d2o's hook: call d2o.install(model) (d2o.load_model does it) "
                           "before running it with a compressed cache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_hooked()
        if self.cache.kv_repeats > 1:  # the released D2O's storage: a copy of each KV head per query head
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
            self.written, self.vacancies, self.owns_storage = None, None, True
        return self.passed()

    def passed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` hands the attention: the keys and values it reads (``attended``)."""
        return self.attended()

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen, not kept: positions and `generate`'s new tokens count from it

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = 0 if self.slots is None else self.slots.width
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        observing, _ = self.observing, self._clear()
        self.observing = observing

    def crop(self, tokens_to_remove: int) -> None:
        raise D2OError("a compressed cache cannot be cropped: evicted tokens are gone (assisted decoding needs crop)")

    # -- how keys and values are stored (a quantized layer stores them otherwise) -----------------
    def _stored_form(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}  # the table's ``vectors``

    def _write(self, written: tuple[torch.Tensor, ...], key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One token per row and KV head into the slots ``written`` (``_next_slot``'s)."""
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
        """The keys and values a merge gives, written in place (into new tensors when shared)."""
        for name, new in (("keys", merged.keys), ("values", merged.values)):
            stored = self.slots.vectors[name]
            if new is None:
                continue
            if merged.slots is not None:  # a decode step's: the layer owns its storage then
                stored.view(-1, stored.shape[-1]).index_copy_(0, self.slots.flat(merged.slots), new.flatten(0, 2))
            elif self.owns_storage:
                stored.copy_(new)
            else:
                self.slots.vectors[name] = new

    def _take_vectors(self, slots: torch.Tensor, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``vectors`` ("keys", "values") of the ``slots`` (B, G, K), copied."""
        index = self.slots.flat(slots)
        return {name: take_flat(self.slots.vectors[name], index, slots.shape) for name in vectors}

    def vector_parts(self, name: str) -> tuple[torch.Tensor, ...]:
        """The keys or values (``name``) as parts one after another along the slots: this layer's whole."""
        return (getattr(self, name),)

    def vectors_at(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """The keys or values (``name``) of the ``slots`` (B, G, K), as the attention reads them: a copy."""
        vectors = getattr(self, name)
        return vectors.gather(2, slots[..., None].expand(*slots.shape, vectors.shape[-1]))

    def settle(self) -> None:
        """The pass is over (its attention, or its eviction): a quantized layer closes its open copy."""

    # -- writing what a pass added ----------------------------------------------------------------
    def _next_slot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where one new token per row and KV head goes, (B, G, 1) and as indices into the keys and
        values: a vacancy, else the first empty slot; None: appended (no empty slot, or shared)."""
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
        index, added = self._new_index(q, new_valid)
        if new_valid is not None and self.vacancies is not None:
            self.vacancies.counted = False  # its prepared indices assumed every token real
        if self.written is not None:
            table.token_index.scatter_(2, self.written, index[:, None, :].expand(batch, heads, 1))
            if not self._zeroed:
                table.clear(self.slots.flat(self.written))
        else:
            table.grow(index[:, None, :].expand(batch, heads, q))
        self._bias = None
        self.real_seen = self.real_seen + added

    def _new_index(self, q: int, new_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | int]:
        """The token index of each of ``q`` new tokens (B, q; -1: padding) and each row's real ones."""
        if new_valid is None:
            index = self.real_seen[:, None] if q == 1 else self.real_seen[:, None] + torch.arange(q, device=self.device)
            return index.to(TOKEN_INDEX_DTYPE), q
        index = (self.real_seen[:, None] + new_valid.long().cumsum(-1) - 1).masked_fill(~new_valid, -1)
        return index.to(TOKEN_INDEX_DTYPE), new_valid.sum(-1)

    def logit_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, G, 1, N) what the attention adds to each slot's logit: its log weight, the lowest value
        of ``dtype`` for an empty slot. Kept up to date in place while tokens fill vacancies; made
        again after anything else changes the slots."""
        bias = self._bias
        if bias is None or bias.dtype != dtype:
            index, log_weight = self.slots.token_index, self.slots.log_weight
            bias = index.new_zeros(index.shape, dtype=dtype) if log_weight is None else log_weight.to(dtype, copy=True)
            bias = self._bias = bias.masked_fill_(index < 0, torch.finfo(dtype).min)[:, :, None, :]
        return bias

    def fresh_slots(self, q: int) -> torch.Tensor:
        """(B, G, q): the slots of the tokens the last pass added."""
        batch, heads, n_slots = self.slots.token_index.shape
        return self.written if self.written is not None else \
            torch.arange(n_slots - q, n_slots, device=self.device).expand(batch, heads, q)

    def fresh_index(self, q: int) -> torch.Tensor:
        """(B, q): the token index of each token of the last pass (-1: padding)."""
        return self.slots.token_index[:, 0].gather(1, self.fresh_slots(q)[:, 0])

    # -- what a method returns, written ---------------------------------------------------------
    def apply_observed(self, observed: Observed | None) -> None:
        if observed is None:
            return
        state = self.slots.state
        for name, added in observed.added.items():
            state[name] = state[name].add_(added) if name in state else added.contiguous()
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
        """The new tokens' ``values`` (B, q), the same for every KV head, into the slot state ``name``,
        the others' times ``decay``."""
        scores = self.slots.state.get(name)
        if scores is None:
            scores = torch.zeros(self.slots.token_index.shape, dtype=torch.float32, device=values.device)
        elif decay != 1.0:
            scores *= decay  # the new tokens' slots are overwritten just below
        slots = self.fresh_slots(values.shape[1])
        scores.scatter_(2, slots, values[:, None, :].expand(slots.shape))
        self.slots.state[name] = scores

    # -- eviction -------------------------------------------------------------------------------
    def evicted(self, slots: torch.Tensor, valid: torch.Tensor, states: tuple[str, ...] | None = None,
                vectors: tuple[str, ...] = ("keys", "values")) -> Evicted:
        """Copies of what the slots (B, G, E) hold (``valid`` (B, E)): the slot ``states`` (None: all)
        and ``vectors`` a merge reads."""
        index = self.slots.flat(slots)
        taken = self._take_vectors(slots, vectors)
        return Evicted(keys=taken.get("keys"), values=taken.get("values"), valid=valid,
                       **self.slots.copies(index, slots.shape, states))

    def drop(self, slots: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Empty the slots (B, G, E) where ``valid`` (B, E) (None: all), in place, for the next tokens."""
        token_index = self.slots.token_index
        if valid is not None and not bool(valid.all()):
            token_index.scatter_(2, slots, torch.where(valid[:, None, :], -1, token_index.gather(2, slots)))
            self._bias = self.vacancies = None
            return
        # Emptied in every row and head: vacancies, zeroed now (a token written there starts from nothing).
        token_index.scatter_(2, slots, -1)
        index = self.slots.flat(slots)
        self.slots.clear(index)
        if self._bias is not None:
            self._bias.view(-1).index_fill_(0, index, torch.finfo(self._bias.dtype).min)
        self.vacancies = Vacancies.of(slots, self.real_seen, self.key_dim, self.value_dim)

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        """Shrink to the slots ``keep`` (B, G, K) gathered into new tensors (``keep_valid`` (B, K): a
        row keeping fewer has an empty tail), ``slack`` more: vacancies for the next tokens."""
        self._set(self.slots.take(keep, keep_valid, slack))
        self.owns_storage, self.vacancies = True, None
        if slack:  # each row's empty tail starts after its kept slots
            batch, heads = keep.shape[:2]
            tail = keep_valid.sum(-1)[:, None, None] + torch.arange(slack, device=self.device)
            self.vacancies = Vacancies.of(tail.expand(batch, heads, slack), self.real_seen, self.key_dim,
                                          self.value_dim)

    # -- rows, copies and snapshots ----------------------------------------------------------------
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) the rows ``index`` (1-D)."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        self._replace_rows(self.slots.select_rows(index), lambda name: getattr(self, name).index_select(0, index),
                        self.state and self.state.map_rows(lambda tensor: tensor.index_select(0, index)))

    def join(self, others: list[CompressedLayer]) -> None:
        """Append the rows of ``others`` (layers of caches of the same policy), padded to the widest."""
        layers = [self, *others]
        rows = [layer.slots.token_index.shape[0] for layer in layers]
        self._replace_rows(self._joined_table(layers),
                        lambda name: torch.cat([getattr(layer, name) for layer in layers]),
                        self.state and type(self.state).concat([layer.state for layer in layers], rows))
        self.seen = max(layer.seen for layer in layers)

    def _joined_table(self, layers: list[CompressedLayer]) -> SlotTable:
        return SlotTable.join([layer.slots for layer in layers])

    def _replace_rows(self, table: SlotTable, rows_of, state) -> None:
        """Rows selected or joined: ``table``, each per-row tensor ``rows_of(name)``, the ``state``."""
        self._set(table)
        for name in self.row_fields:
            if getattr(self, name) is not None:
                setattr(self, name, rows_of(name))
        self.state, self.owns_storage, self.vacancies = state, True, None

    def copy_for(self, cache) -> CompressedLayer:
        """This layer in ``cache`` (``CompressedCache.copy``): storage shared (neither then writes it in
        place), what is accumulated into copied."""
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
        """What ``restore`` needs to take out the tokens fed after it (a probe: nothing is evicted)."""
        return self.slots.snapshot(), {name: getattr(self, name) for name in self.row_fields}, self.seen, \
            self.owns_storage

    def restore(self, snapshot: tuple) -> None:
        """The layer at ``snapshot`` but for the state the passes since wrote into its slots."""
        table, rows, self.seen, self.owns_storage = snapshot
        self.__dict__.update(rows)
        self._set(self.slots.restored(table))
        self.written = self.vacancies = self.carried_window = None

    # -- memory and saving -------------------------------------------------------------------------
    nbytes = property(lambda layer: 0 if layer.slots is None else layer.slots.vector_bytes,
                      doc="Bytes of the stored keys and values (a padded batch's empty slots included).")
    nbytes_parts = property(lambda layer: {}, doc="``nbytes`` by part, for a layer that stores them quantized.")
    state_nbytes = property(lambda layer: 0 if layer.slots is None else layer.slots.bookkeeping_bytes,
                            doc="Bytes of the token indices, log weights and method state.")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Its tensors by name, and what else ``load_state_dict`` needs."""
        return self._saved(self.slots)

    def _saved(self, table: SlotTable) -> tuple[dict[str, torch.Tensor], dict]:
        """``state_dict`` with ``table`` as the layer's slot table."""
        tensors = {**table.state_dict(),
                   **{name: getattr(self, name) for name in self.row_fields if getattr(self, name) is not None}}
        layout = {}
        if self.state is not None:
            state, layout = self.state.state_dict()
            tensors.update({f"state.{name}": tensor for name, tensor in state.items()})
        return tensors, {"seen": self.seen, "observing": self.observing, "state": layout,
                         "dims": [self.key_dim, self.value_dim]}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        index = tensors["token_index"]
        self.lazy_initialization(*(index.new_empty((*index.shape[:2], 0, dim), dtype=dtype) for dim in meta["dims"]))
        self._set(SlotTable.from_state_dict(tensors))
        for name in self.row_fields:
            setattr(self, name, tensors.get(name))
        self.seen, self.observing = meta["seen"], meta["observing"]
        if self.state is not None:
            self.state = self.state.load_state_dict(named(tensors, "state."), meta["state"])
