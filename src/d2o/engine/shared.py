"""Layers whose rows attend to one read-only prefix in place: many questions on one compressed context.

The prefix is another layer's keys and values (1, G, P, D), never written and never copied per row;
the tokens fed after it go to a part of the layer's own (B, G, N, D). The slot table is full width
(P + N slots per row and KV head: the prefix's first), so policies, statistics and the schedule
see one layer. What differs per row is bookkeeping only:

- evicting a prefix slot empties it in that row's table (its vectors stay for the other rows);
- keeping (``keep``) leaves the prefix's slots where they are and gathers the own part's alone;
- a merge that changes a prefix slot's vectors in a row moves that slot into the row's own part
  first (copy on write), so the prefix is the same for every row, always;
- a decode step's attention reads the prefix in place beside the own part: every row's queries
  against the prefix as one row's, then against the own parts, one softmax over both (what cascade
  attention's two passes joined by their log-sum-exp compute; ``attention._one_query_attention``);
  its evictions and merges too: the evicted and target slots' vectors are taken where they are
  (``vectors_at``), and a merge compares the evicted keys with the prefix and the own part as two
  parts (``vector_parts``: every row's evicted keys against the prefix in one product);
- a longer pass, and a merge of several tokens at once, read a gathered view (the prefix repeated
  for the batch, then the own part), made once per pass and dropped after it (``settle``), as a
  quantized layer's open copy.

The prefix's bytes count once (``nbytes``); a saved layer is written whole (a plain layer's form).

When the method evicts nothing once the prompt is compressed, rows read a context's layer (plain,
or a ``RaggedLayer`` of runs: a count per KV head) with ``SharedRunsLayer`` instead: no row ever
evicts from, merges into or scores the prefix, so the rows hold no bookkeeping of it at all.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import torch

from d2o.engine.api import Merged
from d2o.engine.ragged import RaggedLayer
from d2o.engine.selection import take_slots
from d2o.engine.slots import SlotTable
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError

VECTORS = ("keys", "values")


def _marked(slots: torch.Tensor, where: torch.Tensor, width: int) -> torch.Tensor:
    """(B, G, ``width``) bool: True at the ``slots`` (B, G, K) where ``where`` (the others go to a spare
    slot past the end)."""
    marked = torch.zeros((*slots.shape[:2], width + 1), dtype=torch.bool, device=slots.device)
    return marked.scatter_(2, torch.where(where, slots, width), True)[:, :, :width]


def _ordered(where: torch.Tensor, values: torch.Tensor, end: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and head the ``values`` (slots below ``end``) where ``where``, in increasing order, the
    first ``count`` (B, G, count), and which of them are real (``end`` fills the rest)."""
    order = torch.where(where, values, end).sort(-1).values[..., :count]
    return order, order < end


class ReadsPrefix(CompressedLayer):
    """A layer whose rows read ``prefix`` (keys and values, by name) in place beside a part of their
    own: what rows of one prefix share."""

    prefix: dict[str, torch.Tensor]

    def join(self, others: list[CompressedLayer]) -> None:
        for other in others:
            if type(other) is not type(self) or any(other.prefix[name] is not self.prefix[name] for name in VECTORS):
                raise D2OError("rows sharing a prefix join only rows of the same prefix")
        super().join(others)

    nbytes = property(lambda layer: 0 if layer.slots is None else
                      layer.slots.vector_bytes + sum(vectors.nbytes for vectors in layer.prefix.values()),
                      doc="Bytes of the own part's keys and values, and the prefix's once.")


class SharedPrefixLayer(ReadsPrefix):
    """A ``CompressedLayer`` whose first ``prefix_width`` slots read ``prefix`` (see the module)."""

    @staticmethod
    def can_share(layer: CompressedLayer) -> bool:
        """Whether ``layer`` can be a prefix: a plain layer (not quantized, not itself sharing) of one row."""
        return type(layer) is CompressedLayer and layer.is_initialized and layer.token_index.shape[0] == 1

    @classmethod
    def over(cls, source: CompressedLayer, cache) -> SharedPrefixLayer:
        """A layer of ``cache`` going on from ``source`` (``can_share``), reading its keys and values as
        its prefix: the bookkeeping copied, an own part of no slots."""
        layer = cls.__new__(cls)
        layer.__dict__.update(source.copy_for(cache).__dict__)
        keys, values = source.attended()
        layer.prefix = {"keys": keys, "values": values}
        layer.prefix_width = keys.shape[2]
        layer._open = None
        table = layer.slots
        layer._set(SlotTable({name: vectors[:, :, :0] for name, vectors in layer.prefix.items()}, table.token_index,
                             table.log_weight, table.state))
        return layer

    keys = property(lambda layer: layer.slots and layer.attended()[0])
    values = property(lambda layer: layer.slots and layer.attended()[1])
    own_width = property(lambda layer: layer.slots.width - layer.prefix_width)

    def _set(self, table: SlotTable) -> None:
        super()._set(table)
        self._open = None

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered view: the prefix for every row, then the own part, (B, G, P + N, D)."""
        if self._open is None:
            batch = self.slots.token_index.shape[0]
            self._open = tuple(torch.cat([self.prefix[name].expand(batch, -1, -1, -1), self.slots.vectors[name]], 2)
                               for name in VECTORS)
        return self._open

    def passed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's: the own part alone, which the attention reads beside the prefix (or it asks
        for the gathered view, ``attended``, where it cannot); a longer pass's: the gathered view."""
        if self.pending == 1:
            return self.slots.vectors["keys"], self.slots.vectors["values"]
        return self.attended()

    def settle(self) -> None:
        self._open = None

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super()._append(key_states, value_states)
        self._open = None

    def _next_slot(self):
        """The first empty slot of the own part in every row and KV head (never a prefix slot, whose
        vectors are not the row's to write); None: appended."""
        if not self.owns_storage:
            return None
        self.vacancies = None  # an eviction's vacancies may be prefix slots: the own part is searched instead
        free = self.slots.token_index[:, :, self.prefix_width:] < 0
        if free.shape[2] == 0 or not bool(free.any(-1).all()):
            return None
        own = free.to(torch.uint8).argmax(-1, keepdim=True)
        slots = own + self.prefix_width
        self._zeroed, self._prepared, self._bias_slots = False, None, slots[:, :, None, :]
        batch, heads = own.shape[:2]
        return slots, own[..., None].expand(batch, heads, 1, self.key_dim), \
            own[..., None].expand(batch, heads, 1, self.value_dim)

    def _write(self, written, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, key_slots, value_slots = written  # into the own part
        self.slots.vectors["keys"].scatter_(2, key_slots, key_states)
        self.slots.vectors["values"].scatter_(2, value_slots, value_states)
        self._open = None

    def _take_vectors(self, slots: torch.Tensor, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {name: self.vectors_at(name, slots) for name in vectors}

    def vector_parts(self, name: str) -> tuple[torch.Tensor, ...]:
        """The prefix (1, G, P, D), read in place, then the own part (B, G, N, D)."""
        return self.prefix[name], self.slots.vectors[name]

    def vectors_at(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """The vectors of the ``slots`` (B, G, K), each from the prefix or the own part where it is
        (no gathered view)."""
        width, own = self.prefix_width, self.slots.vectors[name]
        shape = (*slots.shape, own.shape[-1])
        taken = self.prefix[name].expand(slots.shape[0], -1, -1, -1).gather(
            2, slots.clamp_max(width - 1)[..., None].expand(shape))
        if own.shape[2] == 0:
            return taken
        from_own = own.gather(2, (slots - width).clamp(0, own.shape[2] - 1)[..., None].expand(shape))
        return torch.where((slots < width)[..., None], taken, from_own)

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        """``CompressedLayer.keep`` that leaves the prefix's slots in place, emptying those not kept,
        and gathers the own part's kept slots (in slot order, each row and head's count padded to the
        most) with ``slack`` empty ones after them."""
        width = self.prefix_width
        kept = keep_valid[:, None, :].expand_as(keep)
        prefix_part = self.slots.narrow(0, width).emptied(~_marked(keep, kept & (keep < width), width))
        own = kept & (keep >= width)
        order, valid = _ordered(own, keep - width, self.own_width, int(own.sum(-1).max()))
        own_part = self._own_part().take(order.clamp_max(max(self.own_width - 1, 0)), valid, slack)
        self._set(prefix_part.beside(own_part))
        self.owns_storage, self.vacancies = True, None

    def _own_part(self) -> SlotTable:
        """The own part's slots: its vectors and (views of) its bookkeeping."""
        own = self.slots.narrow(self.prefix_width, self.slots.width)
        return SlotTable(self.slots.vectors, own.token_index, own.log_weight, own.state)

    def apply_merged(self, merged: Merged) -> None:
        """Counts, weights and state as any layer; new vectors into the own part, a prefix slot's
        moved there first (copy on write)."""
        super().apply_merged(replace(merged, keys=None, values=None))
        if merged.keys is None and merged.values is None:
            return
        width = self.prefix_width
        if merged.slots is None:  # new vectors of every slot, of which `changed` differ
            changed = merged.changed
            moving = torch.ones_like(self.slots.token_index[:, :, :width], dtype=torch.bool) if changed is None \
                else changed[:, :, :width] != 0
            new = {name: getattr(merged, name) for name in VECTORS}
            for name, vectors in new.items():
                if vectors is not None:
                    self.slots.vectors[name] = vectors[:, :, width:].clone()
            self._unshare(moving & (self.slots.token_index[:, :, :width] >= 0),
                          {name: vectors[:, :, :width] for name, vectors in new.items() if vectors is not None})
            self._compact()
            return
        slots = merged.slots  # (B, G, K): a decode step's targets
        self._write_targets(merged, slots, width)
        self._compact()

    def _write_targets(self, merged: Merged, slots: torch.Tensor, width: int) -> None:
        """A decode step's merged vectors into their target ``slots``, those in the prefix moved first."""
        changed = torch.ones_like(slots, dtype=torch.bool) if merged.changed is None else merged.changed != 0
        in_prefix = changed & (slots < width)
        if bool(in_prefix.any()):
            moved_to = self._unshare(_marked(slots, in_prefix, width), {})
            slots = torch.where(in_prefix, moved_to.gather(2, slots.clamp_max(width - 1)), slots)
        writing = changed & (slots >= width)
        if not bool(writing.any()):
            return
        own = (slots - width).clamp_min(0)
        for name in VECTORS:
            new = getattr(merged, name)
            if new is None:
                continue
            stored = self.slots.vectors[name]
            index = own[..., None].expand(*own.shape, stored.shape[-1])
            stored.scatter_(2, index, torch.where(writing[..., None], new.to(stored.dtype), stored.gather(2, index)))
        self._open = None

    def _compact(self) -> None:
        """Keep the own part at most ``evict_every`` slots wider than its fullest row and head (what a
        memory plan counts on): a copy appends a slot for every row, where the others may have room."""
        own = self.slots.token_index[:, :, self.prefix_width:] >= 0
        room = self.cache.evict_every
        fullest, width = int(own.sum(-1).max()), own.shape[2]
        if width <= fullest + room:
            return
        order, valid = _ordered(own, torch.arange(width, device=own.device), width, fullest + room)
        self._set(self.slots.narrow(0, self.prefix_width).beside(self._own_part().take(order.clamp_max(width - 1),
                                                                                       valid)))

    def _unshare(self, moving: torch.Tensor, vectors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Move the prefix slots ``moving`` (B, G, P) of each row and head into new slots of its own
        part, with their bookkeeping and ``vectors`` (by name, (B, G, P, D): the new vectors of every
        prefix slot; the prefix's own otherwise); the prefix slots emptied. Returns (B, G, P): each
        moved slot's new slot."""
        width, table = self.prefix_width, self.slots
        count = int(moving.sum(-1).max())
        if count == 0:
            return None
        order, valid = _ordered(moving, torch.arange(width, device=moving.device), width, count)  # (B, G, count)
        source = order.clamp_max(width - 1)
        batch = table.token_index.shape[0]
        taken = {name: take_slots(vectors.get(name, self.prefix[name].expand(batch, -1, -1, -1)), source)
                 for name in VECTORS}
        bookkeeping = table.narrow(0, width)
        moved = bookkeeping.take(source, valid)  # their token indices, weights and state; then their vectors
        moved = SlotTable(taken, moved.token_index, moved.log_weight, moved.state).emptied(~valid)
        own_part = self._own_part()
        self._set(bookkeeping.emptied(moving).beside(own_part.beside(moved)))
        # Where each moved slot went: after the own part, in the order taken (an index past the prefix
        # takes the rows and heads that moved fewer).
        new_slots = width + own_part.width + torch.arange(count, device=moving.device).expand_as(order)
        moved_to = torch.zeros((*moving.shape[:2], width + 1), dtype=torch.long, device=moving.device)
        return moved_to.scatter_(2, torch.where(valid, order, width), new_slots)[:, :, :width]

    # -- rows, copies and saving -------------------------------------------------------------------
    def copy_for(self, cache) -> SharedPrefixLayer:
        new = super().copy_for(cache)
        new._open = None
        return new

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """A plain layer's: the prefix written out for every row (loaded, it is a ``CompressedLayer``)."""
        tensors, meta = super().state_dict()
        tensors.update({f"stored.{name}": vectors for name, vectors in zip(VECTORS, self.attended())})
        self.settle()
        return tensors, meta


class SharedRunsLayer(ReadsPrefix):
    """Rows reading a context's layer in place, for a method that evicts nothing once the prompt is
    compressed (``can_share``): the layer's keys, values and token indices are one read-only prefix,
    each KV head's part of it a run (``prefix_runs``: its head axis and slots; a ``RaggedLayer``'s
    runs, (1, 1, T), or a plain layer's heads, (1, G, P)); the tokens fed after it go to an ordinary
    part of the layer's own, (B, G, N), as every KV head takes every new token. So a row holds no
    bookkeeping of the prefix at all (nothing of it is evicted, merged into or scored again): its
    slot table is its own part alone (``prefix_width`` 0), which rows, copies and memory plans treat
    as any layer. The attention reads, per KV head, its run of the prefix (every row's queries
    against it as one row's) beside the row's own part, one softmax over both
    (``attention._shared_runs_attention``). Saved, it is written as the layer it reads, with every
    row's own part after each KV head's run (loaded, a ``RaggedLayer`` or a plain one)."""

    prefix_width = 0  # slots of the prefix in the slot table (none) and in each row's plan

    @staticmethod
    def can_share(layer: CompressedLayer) -> bool:
        """Whether rows can read ``layer`` in place this way: a layer of one row, of runs or plain (not
        quantized, not a sliding window's), that no longer observes (its method evicts nothing while
        decoding) and weighs no slot."""
        return type(layer) in (RaggedLayer, CompressedLayer) and layer.is_initialized and layer.window is None \
            and not layer.observing and layer.token_index.shape[0] == 1 and layer.log_weight is None

    @classmethod
    def over(cls, source: CompressedLayer, cache) -> SharedRunsLayer:
        """A layer of ``cache`` going on from ``source`` (``can_share``), read as the prefix: the rows'
        counts and state copied, an own part of no slots."""
        layer = cls.__new__(cls)
        fields = dict(source.copy_for(cache).__dict__)
        for name in ("slots", *RaggedLayer.own_fields):
            fields.pop(name, None)
        layer.__dict__.update(fields)
        layer.prefix = {"keys": source.keys, "values": source.values}
        layer.prefix_index = source.token_index
        layer.prefix_plain = not isinstance(source, RaggedLayer)
        layer.prefix_runs = [(g, 0, source.slots.width) for g in range(source.token_index.shape[1])] \
            if layer.prefix_plain else [(0, start, stop) for start, stop in source.runs]
        heads = len(layer.prefix_runs)
        layer._set(SlotTable({name: vectors.new_empty((1, heads, 0, vectors.shape[-1]))
                              for name, vectors in layer.prefix.items()},
                             source.token_index.new_empty((1, heads, 0))))
        return layer

    kv_heads = property(lambda layer: len(layer.prefix_runs))
    n_kept = property(lambda layer: (layer.prefix_index >= 0).sum() // layer.kv_heads
                      + (layer.slots.token_index[:, 0] >= 0).sum(-1),
                      doc="(B,) tokens read per row and KV head on average: the prefix's pairs over its KV heads, "
                          "and the own part's.")

    def prefix_run(self, name: str, head: int) -> torch.Tensor:
        """KV head ``head``'s run of the prefix's ``name`` ("keys", "values", "token_index"), (1, 1, n, ...)."""
        axis, start, stop = self.prefix_runs[head]
        tensor = self.prefix_index if name == "token_index" else self.prefix[name]
        return tensor[:, axis:axis + 1, start:stop]

    def head_counts(self) -> torch.Tensor:
        """(B, G): the tokens each KV head reads, the prefix's run and the own part's."""
        prefix = torch.stack([(self.prefix_run("token_index", g) >= 0).sum() for g in range(self.kv_heads)])
        return prefix + super().head_counts()

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The layer it reads, every row's own part after each KV head's run: a layer of runs'
        (``RaggedLayer``) or, over a plain layer, a plain one's."""
        batch, width = self.slots.token_index.shape[0], self.slots.width
        heads = []
        for g in range(self.kv_heads):
            prefix = SlotTable({name: self.prefix_run(name, g).expand(batch, -1, -1, -1) for name in self.prefix},
                               self.prefix_run("token_index", g).expand(batch, -1, -1))
            heads.append(SlotTable.cat([prefix, self.slots.slots_between(0, width, slice(g, g + 1))]))
        if self.prefix_plain:  # its heads side by side
            return self._saved(SlotTable({name: torch.cat([head.vectors[name] for head in heads], 1)
                                          for name in self.prefix},
                                         torch.cat([head.token_index for head in heads], 1)))
        tensors, meta = self._saved(SlotTable.cat(heads))
        return tensors, {**meta, "bounds": [0, *accumulate(head.width for head in heads)]}


def reader_of(layer: CompressedLayer) -> type[ReadsPrefix] | None:
    """How rows read ``layer`` (a context's) in place: ``SharedRunsLayer`` where its method evicts
    nothing once the prompt is compressed (no bookkeeping of it per row), else ``SharedPrefixLayer``;
    None: it cannot be read in place (quantized, of a batch), and rows copy it."""
    return SharedRunsLayer if SharedRunsLayer.can_share(layer) else \
        SharedPrefixLayer if SharedPrefixLayer.can_share(layer) else None
