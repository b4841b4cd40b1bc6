"""A layer whose KV heads keep different numbers of tokens: ``RaggedLayer``.

A compression that gives each KV head a count of its own (``Policy.head_targets``) leaves the
layer as one run of slots per KV head, laid end to end in one slot table of one head axis,
(B, 1, T, ...): KV head g's slots are ``bounds[g]:bounds[g + 1]``, each run as wide as its widest
row (the other rows' tails empty). So the layer holds the kept (token, KV head) pairs and no more
(a batch pads each run to its widest row), where a (B, G, N) table would pad every KV head to the
widest one and free nothing. Attention reads each run as a view, one product per KV head with its
query heads stacked (``attention._ragged_attention``); on a GPU a variable-length kernel
(FlashAttention's varlen over the runs' offsets) would take the place of that loop.

Every pass since appends its tokens at the end of every run (one copy of the layer per pass, as any
layer that does not evict appends). A layer that is observed (``observing``: a method that evicts
while decoding, or any while a prompt comes in chunks) is read by its method as (B, G, N) slots: for
each pass and each compression the layer is opened, its runs padded side by side into an ordinary
``CompressedLayer`` (``opened``) that attends, is observed, evicts and merges as any (after a
prefill, each KV head evicting as many as the row's excess, so that its count holds; between chunks,
the layer shared among its heads anew), and closed again into runs (``close``): the padding lives
for one layer's pass or compression at a time. A decode step's evictions open every layer at once
(their merges go in one call) and let the runs go meanwhile (``opened_instead``): for that while
the layers are held padded, not twice. Such a step's passes leave their layers opened for it
(``open_pass``, ``settle``): each layer is opened and closed once a step. Probe passes are taken
out again (``snapshot``, ``restore``) as from any layer.
Rows, copies and saving work on the one table as in ``CompressedLayer``; joining rows pads each run
on its own.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from d2o.engine.api import LayerView
from d2o.engine.quantization import KVQuantization
from d2o.engine.quantized import QuantizedLayer
from d2o.engine.selection import take_flat
from d2o.engine.slots import SlotTable
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError


class RaggedLayer(CompressedLayer):
    """A layer of one run of slots per KV head (see the module); ``bounds``: the runs' offsets."""

    bounds: list[int]
    fresh: torch.Tensor | None = None  # (B, q): the token index of each token of the last pass (-1: padding)
    _open: CompressedLayer | None = None  # the layer opened (``open_pass``, ``opened_instead``), its runs let go
    _kept_open = False  # the pass's opened layer stays for the step's eviction (``open_pass``)
    opened_kind = CompressedLayer  # what ``opened`` makes
    keeps_open = True  # whether a decode step's pass may hand its opened layer to the step's eviction
    own_fields = ("bounds", "fresh", "_open", "_kept_open", "_fed")  # what a plain layer of its slots lacks

    attends_opened = property(lambda layer: layer.observing,
                              doc="Whether a pass runs on the layer opened (``open_pass``), not on its runs.")

    @classmethod
    def holding(cls, layer: CompressedLayer) -> RaggedLayer:
        """``layer`` (B, G, N), whose KV heads hold counts of their own, as runs (``_hold``)."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        new._hold(layer.slots)
        new.owns_storage, new.vacancies, new.written = True, None, None
        return new

    def _hold(self, table: SlotTable) -> None:
        """Hold each KV head's valid slots of ``table`` (B, G, N), in slot order, as its run: one
        gather of each field."""
        batch, heads, width = table.token_index.shape
        valid = table.token_index >= 0
        counts = valid.sum(-1)
        keep = (~valid).to(torch.uint8).argsort(dim=-1, stable=True)  # each row and head's valid slots first
        widths = counts.amax(0).tolist()  # each KV head's widest row
        slots = torch.cat([keep[:, g, :run] for g, run in enumerate(widths)], dim=1)  # (B, T)
        empty = torch.cat([torch.arange(run, device=slots.device) >= counts[:, g:g + 1]
                           for g, run in enumerate(widths)], dim=1)[:, None, :]
        head = torch.repeat_interleave(torch.arange(heads, device=slots.device),
                                       torch.tensor(widths, device=slots.device))
        index = ((torch.arange(batch, device=slots.device)[:, None] * heads + head) * width + slots).flatten()

        def gather(tensor: torch.Tensor, fill) -> torch.Tensor:
            taken = take_flat(tensor, index, empty.shape)
            return taken.masked_fill_(empty.view(*empty.shape, *(1,) * (taken.dim() - 3)), fill)

        self._set(table.map(gather))
        self.bounds = [0, *accumulate(widths)]

    kv_heads = property(lambda layer: len(layer.bounds) - 1)
    runs = property(lambda layer: list(zip(layer.bounds, layer.bounds[1:])), doc="Each KV head's (start, stop).")
    n_kept = property(lambda layer: (layer._table.token_index >= 0).sum((1, 2)) // layer.kv_heads,
                      doc="(B,) tokens held per row and KV head on average: the layer's pairs over its KV heads.")
    _table = property(lambda layer: layer._open.slots if layer.slots is None else layer.slots,
                      doc="What the layer holds: its runs, or while it is held opened instead, the opened layer's.")
    nbytes = property(lambda layer: layer._open.nbytes if layer.slots is None else CompressedLayer.nbytes.fget(layer))
    state_nbytes = property(lambda layer: layer._open.state_nbytes if layer.slots is None else
                            CompressedLayer.state_nbytes.fget(layer))

    def head_counts(self) -> torch.Tensor:
        """(B, G): the tokens each KV head holds."""
        valid = self.slots.token_index[:, 0] >= 0
        return torch.stack([valid[:, start:stop].sum(-1) for start, stop in self.runs], dim=1)

    def opened(self, extra: int = 0) -> CompressedLayer:
        """This layer as an ordinary one, (B, G, N): its runs side by side, each padded with empty
        slots to the widest and ``extra`` more, in new tensors, with its rows' counts and state;
        ``close`` takes it back."""
        batch, _, length = self.slots.token_index.shape
        widths = [stop - start for start, stop in self.runs]
        width = max(widths) + extra
        position = torch.cat([torch.arange(run, device=self.device) + g * width for g, run in enumerate(widths)])

        def spread(tensor: torch.Tensor, fill) -> torch.Tensor:
            padded = tensor.new_full((batch, self.kv_heads, width, *tensor.shape[3:]), fill)
            padded.view(batch, self.kv_heads * width, -1).index_copy_(1, position, tensor.reshape(batch, length, -1))
            return padded

        opened = self.opened_kind.__new__(self.opened_kind)
        opened.__dict__.update({name: value for name, value in self.__dict__.items()
                                if name not in self.own_fields})
        opened._set(self.slots.map(spread))
        opened.owns_storage, opened.vacancies, opened.written, opened.pending = True, None, None, 0
        opened._open = None  # (a quantized layer's decoded copy)
        opened.view = LayerView(opened, self.view.cache)
        return opened

    def opened_instead(self) -> CompressedLayer:
        """``opened``, this layer's runs let go until ``close`` takes it back (its counts and bytes read
        from the opened layer meanwhile): the layer held once, padded, while every layer of a step is
        opened. A decode step's pass may have left it opened already (``open_pass``)."""
        if self._open is None:
            self._open, self.slots = self.opened(), None
        return self._open

    def _take_fields(self, opened: CompressedLayer) -> None:
        for name in (*self.row_fields, "state", "seen"):
            setattr(self, name, getattr(opened, name))

    def close(self, opened: CompressedLayer) -> None:
        """Hold what ``opened`` (``opened()``'s, since attended, evicted from or merged into) holds, as
        runs (``_hold``), with its rows' counts and state."""
        self._take_fields(opened)
        self._open = None
        self._hold(opened.slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hold the pass's keys and values (B, G, q, D) until ``admit`` appends them to every run;
        the attention reads the runs (``attention._ragged_attention``), not what this returns."""
        self._check_hooked()
        self.pending, self._fed = key_states.shape[-2], (key_states, value_states)
        return key_states, value_states

    def open_pass(self, new_valid: torch.Tensor | None) -> CompressedLayer:
        """The layer ``opened`` with the pass's tokens (``update``'s) written and admitted: what the
        attention of a layer that evicts while decoding reads and its method observes; ``settle``
        closes it once the attention is done."""
        keys, values = self._fed
        step = keys.shape[-2] == 1
        opened = self.opened(extra=1 if step else 0)  # a decode step's token written into its slot
        opened.update(keys, values)
        opened.admit(new_valid)
        self.fresh = opened.fresh_index(keys.shape[-2])
        self.pending, self._fed, self._open = 0, None, opened
        # A decode step that may end in an eviction: the step's eviction takes this opened layer as it
        # is (closing and opening it again would give the same layout: runs keep their slots in order).
        schedule = self.cache.schedule
        self._kept_open = step and self.keeps_open and schedule.allocated and schedule.chunks is None and \
            schedule.may_evict_after(1)
        return opened

    def settle(self) -> None:
        """After a pass: the opened layer closed into runs, or held (its runs let go) for the step's
        eviction (``opened_instead``); after a compression: closed."""
        if self._open is None:
            return
        if self._kept_open:
            self._kept_open = False
            self._take_fields(self._open)
            self.slots = None
            return
        self.close(self._open)

    def fresh_index(self, q: int) -> torch.Tensor:
        return self.fresh

    def record(self, name: str, values: torch.Tensor, decay: float) -> None:
        """The last pass's tokens' ``values`` (B, q) into the slot state ``name`` of every run (found
        by their token index), the others' times ``decay``; of the opened layer while it is held."""
        if self.slots is None:
            self._open.record(name, values, decay)
            return
        index = self.slots.token_index[:, 0]  # (B, T)
        fresh = self.fresh[:, None, :]  # (B, 1, q)
        match = (index[:, :, None] == fresh) & (fresh >= 0)
        scores = self.slots.state.get(name)
        if scores is None:
            scores = torch.zeros(self.slots.token_index.shape, dtype=torch.float32, device=values.device)
        elif decay != 1.0:
            scores *= decay
        new = (match * values[:, None, :]).sum(-1)
        self.slots.state[name] = torch.where(match.any(-1)[:, None], new[:, None], scores)

    def admit(self, new_valid: torch.Tensor | None) -> None:
        q, (keys, values) = self.pending, self._fed
        index, added = self._new_index(q, new_valid)
        self.fresh = index
        pieces = []
        for g, (start, stop) in enumerate(self.runs):
            pieces += [self.slots.slots_between(start, stop),
                       SlotTable({"keys": keys[:, g:g + 1], "values": values[:, g:g + 1]}, index[:, None, :])]
        self._set(SlotTable.cat(pieces))
        self.bounds = [bound + q * g for g, bound in enumerate(self.bounds)]
        self.seen += q
        self.real_seen = self.real_seen + added
        self.pending, self._fed = 0, None

    def _joined_table(self, layers: list[CompressedLayer]) -> SlotTable:
        """Each run of every layer's rows padded to its widest, the runs end to end."""
        if not all(isinstance(layer, RaggedLayer) and layer.kv_heads == self.kv_heads for layer in layers):
            raise D2OError("rows whose KV heads keep counts of their own join only rows that do too")
        runs = [SlotTable.join([layer.slots.slots_between(*layer.runs[g]) for layer in layers])
                for g in range(self.kv_heads)]
        self.bounds = [0, *accumulate(run.width for run in runs)]
        return SlotTable.cat(runs)

    def snapshot(self) -> tuple:
        return super().snapshot(), list(self.bounds)

    def restore(self, snapshot: tuple) -> None:
        """The layer at ``snapshot`` but for the state the passes since wrote into its slots: a pass
        appends to every run and closing keeps each row's held slots first, in order, so each run's
        first slots are still the snapshot's run's."""
        taken, bounds = snapshot
        starts = list(self.bounds)
        state = {name: torch.cat([field[:, :, now:now + stop - start]
                                  for now, start, stop in zip(starts, bounds, bounds[1:])], dim=2)
                 for name, field in self.slots.state.items()}
        super().restore(taken)
        self.bounds = bounds
        empty = self.slots.token_index < 0  # a snapshot's empty slot may now hold a pass's token
        self.slots.state = {name: field.masked_fill(empty.view(*empty.shape, *(1,) * (field.dim() - 3)), 0)
                            for name, field in state.items()}

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        raise D2OError("a layer whose KV heads keep counts of their own evicts only when opened")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = super().state_dict()
        return tensors, {**meta, "bounds": self.bounds}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        super().load_state_dict(tensors, meta, dtype)
        self.bounds = list(meta["bounds"])


class QuantizedRaggedLayer(RaggedLayer):
    """A ``RaggedLayer`` whose keys and values are stored at ``kv_bits`` (``quantized``): its runs hold
    the packed levels, steps and zero points of its kept pairs. Every pass runs on the layer opened,
    a ``QuantizedLayer`` (B, G, N) whose slot j of KV head g is slot j of run g: so the residual (the
    newest tokens of each row and KV head in full precision, (B, G, r)) names its slots within each
    run and goes into the opened layer as it is; closing encodes what the pass wrote and renames the
    residual's slots as the runs are made again."""

    row_fields = QuantizedLayer.row_fields
    opened_kind = QuantizedLayer
    attends_opened = True
    keeps_open = False  # its opened layer holds its keys and values in full precision too
    nbytes = QuantizedLayer.nbytes
    nbytes_parts = QuantizedLayer.nbytes_parts

    def __init__(self, cache, layer_idx: int, window: int | None, quantization: KVQuantization):
        self.quantization = quantization
        super().__init__(cache, layer_idx, window)

    def _clear(self) -> None:
        self.ring_slots = self.ring_vectors = None
        self._unencoded = 0
        super()._clear()

    @classmethod
    def holding(cls, layer: QuantizedLayer) -> QuantizedRaggedLayer:
        layer._write_out()
        return super().holding(layer)

    def _hold(self, table: SlotTable) -> None:
        """``RaggedLayer._hold``, the residual's slots (of ``table``'s (B, G, N) layout) renamed to
        their places in the runs: a valid slot's rank among its head's valid slots."""
        if self.ring_slots is not None:
            valid = table.token_index >= 0
            slots = self.ring_slots.clamp_min(0)
            rank = valid.long().cumsum(-1) - 1
            kept = (self.ring_slots >= 0) & valid.gather(2, slots)
            self.ring_slots = torch.where(kept, rank.gather(2, slots), -1)
        super()._hold(table)

    def close(self, opened: QuantizedLayer) -> None:
        opened._write_out()  # every token it wrote encoded, before its slots move
        super().close(opened)
