"""A cache layer that stores its keys and values at 8, 4 or 2 bits (``quantization``).

Between passes the layer holds each slot's packed levels, steps and zero points, its key's and its
value's side by side (per-slot tensors (B, G, N, 2, ...), so eviction, merging and batching move
them as they move full-precision keys, and one encoding or decoding serves both), and the newest
``residual`` tokens of each row and KV head also in full precision: ``ring``, their slots and
vectors. A pass that attends opens the layer: every slot decoded, the residual's tokens written
over their decoded copies, the new tokens written in full precision; the attention reads that, and
the layer is settled (closed) after it. A decode step's token is encoded later, with the others
written since, before anything reads the stored bytes or the token leaves the residual: until then
its slot's bytes are never read (the residual is read instead), and one encoding serves many steps. Nothing
else is re-quantized: a method that reads the keys or values (a merge, a scorer) gets the open
copy, and when the layer settles only the slots whose vectors it changed are encoded again.
Statistics and scores are computed from the open copy, in float32, as in an unquantized layer.
"""

from __future__ import annotations

import torch

from d2o.engine.quantization import KVQuantization
from d2o.engine.storage import CompressedLayer, _flat
from d2o.errors import D2OError

KEY, VALUE = 0, 1  # where keys and values sit in the stored and open tensors (B, G, N, 2, ...)
VECTORS = ("keys", "values")


def _vectors(which: int) -> property:
    """``keys`` or ``values`` as methods see them: the open copy's, handed out (see ``_expose``);
    only None can be set (a reset)."""
    return property(lambda layer: layer._expose(which), lambda layer, value: layer._reset(value))


class QuantizedLayer(CompressedLayer):
    """A ``CompressedLayer`` whose keys and values are stored quantized (see the module)."""

    def __init__(self, cache, layer_idx: int, window: int | None, quantization: KVQuantization):
        self.quantization = quantization
        super().__init__(cache, layer_idx, window)

    def _clear(self) -> None:
        self._open: torch.Tensor | None = None  # (B, G, N, 2, D) in full precision, while a pass uses them
        # The open copy as it was when handed out to a method, which may write into the copy (None: not handed out).
        self._before: torch.Tensor | None = None
        self._packed: dict[str, torch.Tensor] | None = None  # PARTS, each (B, G, N, 2, ...)
        # The newest tokens in full precision: slots (B, G, r) (-1: no longer held there), vectors (B, G, r, 2, D).
        self.ring: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unencoded = 0  # the residual's newest entries whose bytes are not written yet
        super()._clear()

    # -- the keys and values, as methods see them ---------------------------------------------
    keys = _vectors(KEY)
    values = _vectors(VALUE)

    def _reset(self, value) -> None:
        if value is not None:
            raise TypeError("a quantized layer's keys and values are set through adopt()")
        self._open = self._packed = self.ring = None

    def _expose(self, which: int) -> torch.Tensor | None:
        if self._packed is None:
            return None
        self.attended()
        if self._before is None:  # a copy without the scratch slot, so that a method may view it flat (B * G * N, D)
            self._before, self._open = self._open, self._open.clone(memory_format=torch.contiguous_format)
        return self._open[:, :, :, which]

    # -- storage --------------------------------------------------------------------------------
    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The open copy: every slot decoded, the residual's tokens in full precision."""
        if self._open is None:
            self._open = self._decoded()
        return self._open[:, :, :, KEY], self._open[:, :, :, VALUE]

    def _decoded(self) -> torch.Tensor:
        data = self._packed["data"]
        batch, heads, n_slots = data.shape[:3]
        # One slot more than stored: where the residual's entries no longer held write (and nothing reads).
        opened = torch.empty((batch, heads, n_slots + 1, 2, self.key_dim), dtype=torch.float32, device=data.device)
        self.quantization.decode(self._packed, out=opened[:, :, :n_slots])
        opened = opened.to(self.dtype)
        if self.ring is not None:
            slots, held = self.ring
            opened.scatter_(2, torch.where(slots >= 0, slots, n_slots)[..., None, None].expand(held.shape), held)
        return opened[:, :, :n_slots]

    def settle(self) -> None:
        """Drop the open copy; slots a method changed in it are encoded again first, and the
        residual's copies of them follow."""
        opened = self._open
        if opened is None:
            return
        if self._before is not None:
            self._encode_newest()
            rows = (opened != self._before).flatten(3).any(-1).flatten().nonzero()[:, 0]  # slots of the flat views
            if rows.numel():
                if not self.owns_storage:  # shared with a copy of this cache: written into a copy of its own
                    self._packed = {part: tensor.clone() for part, tensor in self._packed.items()}
                self._write_bytes(rows, opened.reshape(-1, *opened.shape[3:]).index_select(0, rows))
            if self.ring is not None:
                slots, held = self.ring
                self.ring = (slots, opened.gather(2, slots.clamp_min(0)[..., None, None].expand(held.shape)))
        self._open = self._before = None

    def _write_out(self) -> None:
        """Every stored byte up to date: the open copy settled, the residual's new entries encoded."""
        self.settle()
        self._encode_newest()

    def _stored(self) -> dict[str, torch.Tensor]:
        self._write_out()
        return dict(self._packed)

    def _store(self, stored: dict[str, torch.Tensor]) -> None:
        self._packed = dict(stored)
        self._open = self._before = None
        self._unencoded = 0

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape[-1] != values.shape[-1]:
            raise D2OError(f"kv_bits stores a key and a value side by side: this model's keys have {keys.shape[-1]} "
                           f"channels and its values {values.shape[-1]}")
        vectors = torch.stack([keys, values], dim=3)
        self._store(self.quantization.encode(vectors))
        self.ring = None
        self._hold_newest(0, vectors)

    def _write(self, written, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, key_slots, value_slots = written
        keys, values = self.attended()
        keys.scatter_(2, key_slots, key_states)
        values.scatter_(2, value_slots, value_states)
        vectors = torch.stack([key_states, value_states], dim=3)
        if not self.quantization.residual:  # nowhere else to read it from: its bytes now
            self._write_bytes(self.rows_of(slots), vectors.flatten(0, 2))
            return
        self._hold_newest(slots, vectors)
        self._unencoded += 1
        if self._unencoded == self.quantization.residual:  # the next one would push it out unencoded
            self._encode_newest()

    def _encode_newest(self) -> None:
        """Write the bytes of the residual's entries written since the last time (decode steps'
        tokens) into their slots; an entry whose slot took a newer token since has none to write."""
        count, self._unencoded = self._unencoded, 0
        if not count:
            return
        slots, held = self.ring
        slots, held = slots[:, :, -count:], held[:, :, -count:]
        rows, vectors = self.rows_of(slots), held.flatten(0, 2)
        still = (slots >= 0).flatten()
        if not bool(still.all()):
            rows, vectors = rows[still], vectors[still]
        self._write_bytes(rows, vectors)

    def _write_bytes(self, rows: torch.Tensor, vectors: torch.Tensor) -> None:
        """Encode ``vectors`` (K, 2, D) into the stored rows ``rows`` (K,) of the flat views, in place,
        in the mode the stored tensors were made in (a report after generate asks for bytes outside it)."""
        with torch.inference_mode(self._packed["data"].is_inference()):
            for part, tensor in self.quantization.encode(vectors).items():
                _flat(self._packed[part]).index_copy_(0, rows, tensor.reshape(rows.shape[0], -1))

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._encode_newest()  # the tokens appended push older ones out of the residual
        self.attended()
        vectors = torch.stack([key_states, value_states], dim=3)
        n_slots = self._open.shape[2]
        self._open = torch.cat([self._open, vectors], dim=2)
        encoded = self.quantization.encode(vectors)
        self._packed = {part: torch.cat([tensor, encoded[part]], dim=2) for part, tensor in self._packed.items()}
        self._hold_newest(n_slots, vectors)

    def _hold_newest(self, slots: torch.Tensor | int, vectors: torch.Tensor) -> None:
        """Hold the tokens just written, ``vectors`` (B, G, q, 2, D), in full precision as the
        residual's newest: into ``slots`` (B, G, 1) (an older entry for that slot, a token evicted
        from it, is dropped), or (an int) appended from that slot on."""
        residual = self.quantization.residual
        added = vectors.shape[2]
        if not residual or not added:
            return
        if isinstance(slots, int):
            count = min(residual, added)
            slots = torch.arange(slots + added - count, slots + added, device=vectors.device)
            slots, vectors = slots.expand(*vectors.shape[:2], count), vectors[:, :, added - count:]
        if self.ring is None:
            self.ring = (slots, vectors)
            return
        held_slots, held = self.ring
        if slots.shape[2] == 1:
            held_slots = held_slots.masked_fill(held_slots == slots, -1)
        self.ring = (torch.cat([held_slots, slots], dim=2)[:, :, -residual:],
                     torch.cat([held, vectors], dim=2)[:, :, -residual:])

    def _take_vectors(self, take, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        self._encode_newest()
        both = take(self._open) if self._open is not None else \
            self.quantization.decode({part: take(tensor) for part, tensor in self._packed.items()}).to(self.dtype)
        return {name: both[:, :, :, VECTORS.index(name)] for name in vectors}

    # -- slot operations: the residual's slots follow -------------------------------------------
    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        self._write_out()  # before the residual's slots move
        if self.ring is not None:
            position = torch.arange(keep.shape[2], device=keep.device).expand_as(keep)
            position = torch.where(keep_valid[:, None, :], position, -1)
            moved = torch.full(self.token_index.shape, -1, dtype=keep.dtype, device=keep.device)
            moved.scatter_reduce_(2, keep, position, "amax")  # each old slot's new slot (-1: evicted)
            slots, held = self.ring
            self.ring = (torch.where(slots >= 0, moved.gather(2, slots.clamp_min(0)), -1), held)
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
                        torch.empty((batch, heads, 0, 2, layer.key_dim), dtype=layer.dtype, device=layer.device))
            missing = longest - ring[0].shape[2]  # older entries, held nowhere
            parts.append(tuple(torch.cat([tensor.new_full((*tensor.shape[:2], missing, *tensor.shape[3:]), fill),
                                          tensor], dim=2) for tensor, fill in zip(ring, (-1, 0))))
        self.ring = tuple(torch.cat(tensors) for tensors in zip(*parts))

    def snapshot(self) -> tuple:
        return super().snapshot(), self.ring

    def copy_for(self, cache) -> CompressedLayer:
        if self.is_initialized:  # the copy shares the stored tensors, which neither then writes in place
            self._write_out()
        return super().copy_for(cache)

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
        return {"levels": stored["data"].nbytes, "scales": stored["scale"].nbytes + stored["zero"].nbytes,
                "residual": 0 if self.ring is None else sum(tensor.nbytes for tensor in self.ring)}
