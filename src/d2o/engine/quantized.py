"""A cache layer that stores its keys and values at 8, 4 or 2 bits (``quantization``).

Between passes the layer holds each slot's packed levels, steps and zero points (per-slot tensors,
so eviction, merging and batching move them as they move full-precision keys), and the newest
``residual`` tokens of each row and KV head also in full precision: ``ring``, their slots and
vectors. A pass that attends opens the layer: every slot decoded, the residual's tokens written
over their decoded copies, the new tokens written in full precision; the attention reads that, and
the layer is settled (closed) after it, the new tokens' bytes written beside the others. Nothing
else is re-quantized: a method that reads the keys or values (a merge, a scorer) gets the open
copy, and when the layer settles only the slots whose vectors it changed are encoded again.
Statistics and scores are computed from the open copy, in float32, as in an unquantized layer.
"""

from __future__ import annotations

import torch

from d2o.engine.quantization import PARTS, KVQuantization
from d2o.engine.storage import CompressedLayer, _flat

VECTORS = ("keys", "values")


class QuantizedLayer(CompressedLayer):
    """A ``CompressedLayer`` whose keys and values are stored quantized (see the module)."""

    def __init__(self, cache, layer_idx: int, window: int | None, quantization: KVQuantization):
        self.quantization = quantization
        super().__init__(cache, layer_idx, window)

    def _clear(self) -> None:
        self._open_keys = self._open_values = None  # full precision, while a pass uses them
        self._exposed = False  # the open copy was handed out: a method may have written into it
        self._packed: dict[str, torch.Tensor] | None = None  # "keys.data", "keys.scale", ...: (B, G, N, ...)
        # The newest tokens in full precision: slots (B, G, r) (-1: no longer held there), keys, values.
        self.ring: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        super()._clear()

    # -- the keys and values, as methods see them ---------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return self._expose()[0]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise TypeError("a quantized layer's keys are set through adopt()")
        self._open_keys = self._packed = self.ring = None

    @property
    def values(self) -> torch.Tensor | None:
        return self._expose()[1]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise TypeError("a quantized layer's values are set through adopt()")
        self._open_values = self._packed = self.ring = None

    def _expose(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._packed is None:
            return None, None
        self._exposed = True
        return self.attended()

    # -- storage --------------------------------------------------------------------------------
    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The open copy: every slot decoded, the residual's tokens in full precision."""
        if self._open_keys is None:
            self._open_keys, self._open_values = self._decoded()
        return self._open_keys, self._open_values

    def _decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (self.quantization.decode({part: self._packed[f"{name}.{part}"] for part in PARTS}, self.dtype)
                        for name in VECTORS)
        if self.ring is not None:
            slots, *held = self.ring
            valid, index = slots >= 0, slots.clamp_min(0)[..., None]
            for tensor, vectors in zip((keys, values), held):
                index_d = index.expand(*index.shape[:3], tensor.shape[-1])
                # Added, not written (entries no longer held point at slot 0 and add nothing): the
                # decoded vector is taken away, which leaves exactly 0, then the held one added.
                held_here = valid[..., None]
                tensor.scatter_add_(2, index_d, torch.where(held_here, -tensor.gather(2, index_d), 0))
                tensor.scatter_add_(2, index_d, torch.where(held_here, vectors, 0))
        return keys, values

    def settle(self) -> None:
        """Drop the open copy; slots a method changed in it are encoded again first, and the
        residual's copies of them follow."""
        if self._open_keys is None:
            return
        if self._exposed:
            for name, opened, before in zip(VECTORS, (self._open_keys, self._open_values), self._decoded()):
                changed = (opened != before).any(-1, keepdim=True)
                if bool(changed.any()):  # a new dict: a copy of this cache may share the old one
                    encoded = self.quantization.encode(opened)
                    self._packed = {**self._packed, **{f"{name}.{part}": torch.where(
                        changed, encoded[part], self._packed[f"{name}.{part}"]) for part in PARTS}}
            if self.ring is not None:
                slots, *held = self.ring
                index = slots.clamp_min(0)[..., None]
                self.ring = (slots, *(opened.gather(2, index.expand(*index.shape[:3], opened.shape[-1]))
                                      for opened in (self._open_keys, self._open_values)))
        self._open_keys = self._open_values = None
        self._exposed = False

    def _stored(self) -> dict[str, torch.Tensor]:
        self.settle()
        return dict(self._packed)

    def _store(self, stored: dict[str, torch.Tensor]) -> None:
        self._packed = dict(stored)
        self._open_keys = self._open_values = None
        self._exposed = False

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._store(self._encoded(keys, values))
        self.ring = None
        count = min(self.quantization.residual, keys.shape[2])
        slots = torch.arange(keys.shape[2] - count, keys.shape[2], device=keys.device)
        self._hold_newest(slots.expand(*keys.shape[:2], count), keys[:, :, keys.shape[2] - count:],
                          values[:, :, keys.shape[2] - count:])

    def _encoded(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"{name}.{part}": tensor for name, vectors in zip(VECTORS, (keys, values))
                for part, tensor in self.quantization.encode(vectors).items()}

    def _write(self, written, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, key_slots, value_slots = written
        keys, values = self.attended()
        keys.scatter_(2, key_slots, key_states)
        values.scatter_(2, value_slots, value_states)
        rows = self.rows_of(slots)
        for name, tensor in self._encoded(key_states, value_states).items():
            _flat(self._packed[name]).index_copy_(0, rows, tensor.reshape(rows.shape[0], -1))
        self._hold_newest(slots, key_states, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        keys, values = self.attended()
        n_slots, added = keys.shape[2], key_states.shape[2]
        self._open_keys = torch.cat([keys, key_states], dim=2)
        self._open_values = torch.cat([values, value_states], dim=2)
        encoded = self._encoded(key_states, value_states)
        self._packed = {name: torch.cat([tensor, encoded[name]], dim=2) for name, tensor in self._packed.items()}
        count = min(self.quantization.residual, added)
        slots = torch.arange(n_slots + added - count, n_slots + added, device=keys.device)
        self._hold_newest(slots.expand(*keys.shape[:2], count), key_states[:, :, added - count:],
                          value_states[:, :, added - count:])

    def _hold_newest(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold the tokens just written to ``slots`` (B, G, q) in full precision, as the residual's
        newest; an older entry for one of those slots (a token evicted from it) is dropped."""
        residual = self.quantization.residual
        if not residual or not slots.shape[2]:
            return
        if self.ring is None:
            self.ring = (slots, keys, values)
            return
        held_slots, held_keys, held_values = self.ring
        if slots.shape[2] == 1:
            held_slots = held_slots.masked_fill(held_slots == slots, -1)
        self.ring = tuple(torch.cat([old, new], dim=2)[:, :, -residual:]
                          for old, new in ((held_slots, slots), (held_keys, keys), (held_values, values)))

    def _take_vectors(self, take, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if self._open_keys is not None:
            opened = dict(zip(VECTORS, (self._open_keys, self._open_values)))
            return {name: take(opened[name]) for name in vectors}
        return {name: self.quantization.decode({part: take(self._packed[f"{name}.{part}"]) for part in PARTS},
                                               self.dtype) for name in vectors}

    # -- slot operations: the residual's slots follow -------------------------------------------
    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        self.settle()
        if self.ring is not None:
            position = torch.arange(keep.shape[2], device=keep.device).expand_as(keep)
            position = torch.where(keep_valid[:, None, :], position, -1)
            moved = torch.full(self.token_index.shape, -1, dtype=keep.dtype, device=keep.device)
            moved.scatter_reduce_(2, keep, position, "amax")  # each old slot's new slot (-1: evicted)
            slots, *held = self.ring
            self.ring = (torch.where(slots >= 0, moved.gather(2, slots.clamp_min(0)), -1), *held)
        super().keep(keep, keep_valid, slack)

    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)
        if self.ring is not None:
            index = torch.as_tensor(index, dtype=torch.long, device=self.device)
            self.ring = tuple(tensor.index_select(0, index) for tensor in self.ring)

    def join(self, others: list[CompressedLayer]) -> None:
        layers = [self, *others]
        rings = [layer.ring for layer in layers]
        super().join(others)
        if all(ring is None for ring in rings):
            return
        longest = max(0 if ring is None else ring[0].shape[2] for ring in rings)
        parts = []
        for layer, ring in zip(layers, rings):
            batch, heads = layer.token_index.shape[:2]
            if ring is None:
                ring = (layer.token_index.new_empty((batch, heads, 0)),
                        torch.empty((batch, heads, 0, layer.key_dim), dtype=layer.dtype, device=layer.device),
                        torch.empty((batch, heads, 0, layer.value_dim), dtype=layer.dtype, device=layer.device))
            missing = longest - ring[0].shape[2]  # older entries, held nowhere
            parts.append(tuple(torch.cat([tensor.new_full((*tensor.shape[:2], missing, *tensor.shape[3:]), fill),
                                          tensor], dim=2) for tensor, fill in zip(ring, (-1, 0, 0))))
        self.ring = tuple(torch.cat(tensors) for tensors in zip(*parts))

    def snapshot(self) -> tuple:
        return super().snapshot(), self.ring

    def restore(self, snapshot: tuple) -> None:
        stored, self.ring = snapshot
        super().restore(stored)

    # -- memory ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_parts.values())

    @property
    def nbytes_parts(self) -> dict[str, int]:
        """Bytes of the packed levels, of the steps and zero points, and of the residual (its
        full-precision vectors and their slots)."""
        if not self.is_initialized:
            return {"levels": 0, "scales": 0, "residual": 0}
        stored = self._stored()
        return {"levels": sum(stored[f"{name}.data"].nbytes for name in VECTORS),
                "scales": sum(stored[f"{name}.{part}"].nbytes for name in VECTORS for part in ("scale", "zero")),
                "residual": 0 if self.ring is None else sum(tensor.nbytes for tensor in self.ring)}
