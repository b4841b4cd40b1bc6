"""A layer whose KV heads keep different numbers of tokens: ``RaggedLayer``.

A compression that gives each KV head a count of its own (``Policy.head_targets``) leaves the
layer as one run of slots per KV head, laid end to end in one slot table of one head axis,
(B, 1, T, ...): KV head g's slots are ``bounds[g]:bounds[g + 1]``, each run as wide as its widest
row (the other rows' tails empty). So the layer holds the kept (token, KV head) pairs and no more
(a batch pads each run to its widest row), where a (B, G, N) table would pad every KV head to the
widest one and free nothing. Attention reads each run as a view, one product per KV head with its
query heads stacked (``attention._ragged_attention``); on a GPU a variable-length kernel
(FlashAttention's varlen over the runs' offsets) would take the place of that loop.

The layer is compressed once, after the prefill: every pass since appends its tokens at the end of
every run (one copy of the layer per pass, as any layer that does not evict appends), and nothing
is evicted from it again. Rows, copies and saving work on the one table as in ``CompressedLayer``;
joining rows pads each run on its own.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from d2o.engine.slots import SlotTable
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError


class RaggedLayer(CompressedLayer):
    """A layer of one run of slots per KV head (see the module); ``bounds``: the runs' offsets."""

    bounds: list[int]

    @classmethod
    def kept_from(cls, layer: CompressedLayer, keep: torch.Tensor, keep_valid: torch.Tensor) -> RaggedLayer:
        """``layer`` shrunk to the slots ``keep`` (B, G, K) where ``keep_valid`` (B, G, K), each KV
        head's kept slots first (``selection.select_kept``'s)."""
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)
        widths = keep_valid.sum(-1).amax(0).tolist()  # each KV head's widest row
        new._set(SlotTable.cat([layer.slots.slots_between(0, layer.slots.width, slice(g, g + 1))
                                .take(keep[:, g:g + 1, :width], keep_valid[:, g:g + 1, :width])
                                for g, width in enumerate(widths)]))
        new.bounds = [0, *accumulate(widths)]
        new.owns_storage, new.vacancies, new.written = True, None, None
        return new

    kv_heads = property(lambda layer: len(layer.bounds) - 1)
    runs = property(lambda layer: list(zip(layer.bounds, layer.bounds[1:])), doc="Each KV head's (start, stop).")
    n_kept = property(lambda layer: (layer.slots.token_index >= 0).sum((1, 2)) // layer.kv_heads,
                      doc="(B,) tokens held per row and KV head on average: the layer's pairs over its KV heads.")

    def head_counts(self) -> torch.Tensor:
        """(B, G): the tokens each KV head holds."""
        valid = self.slots.token_index[:, 0] >= 0
        return torch.stack([valid[:, start:stop].sum(-1) for start, stop in self.runs], dim=1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hold the pass's keys and values (B, G, q, D) until ``admit`` appends them to every run;
        the attention reads the runs (``attention._ragged_attention``), not what this returns."""
        self._check_hooked()
        self.pending, self._fed = key_states.shape[-2], (key_states, value_states)
        return key_states, value_states

    def admit(self, new_valid: torch.Tensor | None) -> None:
        q, (keys, values) = self.pending, self._fed
        index, added = self._new_index(q, new_valid)
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
        raise D2OError("a probe pass cannot run over a layer whose KV heads keep counts of their own: run probes "
                       "before the compression")

    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        raise D2OError("a layer whose KV heads keep counts of their own is compressed once")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = super().state_dict()
        return tensors, {**meta, "bounds": self.bounds}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        super().load_state_dict(tensors, meta, dtype)
        self.bounds = list(meta["bounds"])
