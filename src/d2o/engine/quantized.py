"""A cache layer that stores its keys and values at 8, 4 or 2 bits (``quantization``).

Its slot table's ``vectors`` are each slot's packed levels, steps and zero points, its key's and its
value's side by side ((B, G, N, 2, ...) each, so eviction, merging and batching move them as they
move full-precision keys, and one encoding or decoding serves both). The newest ``residual``
tokens of each row and KV head are also held in full precision: ``ring``, their slots and vectors.
A pass that attends opens the layer: every slot decoded, the residual's tokens written over their
decoded copies, the new tokens written in full precision; the attention and the method read that
open copy, and the layer is settled (closed) after it. A decode step's token is encoded later,
with the others written since, before anything reads the stored bytes or the token leaves the
residual: until then its slot's bytes are never read (the residual is read instead), and one
encoding serves many steps. Nothing else is re-quantized: a merge names the slots it rewrote, and
those (where their vectors really changed) are encoded again, no others.
"""

from __future__ import annotations

import torch

from d2o.engine.api import Merged
from d2o.engine.quantization import KVQuantization
from d2o.engine.slots import flat
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError

KEY, VALUE = 0, 1  # where keys and values sit in the stored and open tensors (B, G, N, 2, ...)
VECTORS = ("keys", "values")


class QuantizedLayer(CompressedLayer):
    """A ``CompressedLayer`` whose keys and values are stored quantized (see the module)."""

    def __init__(self, cache, layer_idx: int, window: int | None, quantization: KVQuantization):
        self.quantization = quantization
        super().__init__(cache, layer_idx, window)

    def _clear(self) -> None:
        self._open: torch.Tensor | None = None  # (B, G, N, 2, D) in full precision, while a pass uses them
        # The newest tokens in full precision: slots (B, G, r) (-1: no longer held there), vectors (B, G, r, 2, D).
        self.ring: tuple[torch.Tensor, torch.Tensor] | None = None
        self._unencoded = 0  # the residual's newest entries whose bytes are not written yet
        super()._clear()

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.slots is None else self.attended()[0]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.slots is None else self.attended()[1]

    # -- storage --------------------------------------------------------------------------------
    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The open copy: every slot decoded, the residual's tokens in full precision."""
        if self._open is None:
            self._open = self._decoded()
        return self._open[:, :, :, KEY], self._open[:, :, :, VALUE]

    def _decoded(self) -> torch.Tensor:
        data = self.slots.vectors["data"]
        batch, heads, n_slots = data.shape[:3]
        # One slot more than stored: where the residual's entries no longer held write (and nothing reads).
        opened = torch.empty((batch, heads, n_slots + 1, 2, self.key_dim), dtype=torch.float32, device=data.device)
        self.quantization.decode(self.slots.vectors, out=opened[:, :, :n_slots])
        opened = opened.to(self.dtype)
        if self.ring is not None:
            slots, exact = self.ring
            opened.scatter_(2, torch.where(slots >= 0, slots, n_slots)[..., None, None].expand(exact.shape), exact)
        return opened[:, :, :n_slots]

    def settle(self) -> None:
        """Drop the open copy (what a merge changed in it is encoded already)."""
        self._open = None

    def _write_out(self) -> None:
        """Every stored byte up to date and the open copy dropped, before the slots move."""
        self._encode_newest()
        self._open = None

    def _stored_form(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        if keys.shape[-1] != values.shape[-1]:
            raise D2OError(f"kv_bits stores a key and a value side by side: this model's keys have {keys.shape[-1]} "
                           f"channels and its values {values.shape[-1]}")
        vectors = torch.stack([keys, values], dim=3)
        self._open, self._unencoded, self.ring = None, 0, None
        self._hold_newest(0, vectors)
        return self.quantization.encode(vectors)

    def _write(self, written, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, key_slots, value_slots = written
        keys, values = self.attended()
        keys.scatter_(2, key_slots, key_states)
        values.scatter_(2, value_slots, value_states)
        vectors = torch.stack([key_states, value_states], dim=3)
        if not self.quantization.residual:  # nowhere else to read it from: its bytes now
            self._write_bytes(self.flat(slots), vectors.flatten(0, 2))
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
        slots, exact = self.ring
        slots, exact = slots[:, :, -count:], exact[:, :, -count:]
        index, vectors = self.flat(slots), exact.flatten(0, 2)
        still = (slots >= 0).flatten()
        if not bool(still.all()):
            index, vectors = index[still], vectors[still]
        self._write_bytes(index, vectors)

    def _write_bytes(self, index: torch.Tensor, vectors: torch.Tensor) -> None:
        """Encode ``vectors`` (K, 2, D) into the slots at ``index`` (K,) of the flat views, in place, in
        the mode the stored tensors were made in (a report after generate asks for bytes outside it)."""
        stored = self.slots.vectors
        with torch.inference_mode(stored["data"].is_inference()):
            for part, tensor in self.quantization.encode(vectors).items():
                flat(stored[part]).index_copy_(0, index, tensor.reshape(index.shape[0], -1))

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._encode_newest()  # the tokens appended push older ones out of the residual
        self.attended()
        vectors = torch.stack([key_states, value_states], dim=3)
        n_slots = self._open.shape[2]
        self._open = torch.cat([self._open, vectors], dim=2)
        encoded = self.quantization.encode(vectors)
        self.slots.vectors = {part: torch.cat([tensor, encoded[part]], dim=2)
                              for part, tensor in self.slots.vectors.items()}
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
        ring_slots, exact = self.ring
        if slots.shape[2] == 1:
            ring_slots = ring_slots.masked_fill(ring_slots == slots, -1)
        self.ring = (torch.cat([ring_slots, slots], dim=2)[:, :, -residual:],
                     torch.cat([exact, vectors], dim=2)[:, :, -residual:])

    def _write_vectors(self, merged: Merged) -> None:
        """Write a merge's vectors into the open copy and encode again the slots they really changed;
        the residual's copies of them follow."""
        self._encode_newest()
        self.attended()
        self._open = opened = self._open.contiguous()
        batch, heads, n_slots = opened.shape[:3]
        index = torch.arange(batch * heads * n_slots, device=opened.device) if merged.slots is None \
            else self.flat(merged.slots)
        named = slice(None) if merged.changed is None else merged.changed.flatten()
        index = index[named]
        before = flat(opened).view(-1, 2, self.key_dim).index_select(0, index)
        after = before.clone()
        for which, new in ((KEY, merged.keys), (VALUE, merged.values)):
            if new is not None:
                after[:, which] = new.reshape(-1, new.shape[-1])[named]
        differ = (after != before).flatten(1).any(-1)
        index, after = index[differ], after[differ]
        if index.numel():
            flat(opened).index_copy_(0, index, after.flatten(1))
            if not self.owns_storage:  # shared with a copy of this cache: written into a copy of its own
                self.slots.vectors = {part: tensor.clone() for part, tensor in self.slots.vectors.items()}
            self._write_bytes(index, after)
        if self.ring is not None:
            slots, exact = self.ring
            self.ring = (slots, opened.gather(2, slots.clamp_min(0)[..., None, None].expand(exact.shape)))

    def _take_vectors(self, take, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        self._encode_newest()
        both = take(self._open) if self._open is not None else \
            self.quantization.decode({part: take(tensor) for part, tensor in self.slots.vectors.items()}).to(self.dtype)
        return {name: both[:, :, :, VECTORS.index(name)] for name in vectors}

    # -- slot operations: the residual's slots follow -------------------------------------------
    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        self._write_out()  # before the residual's slots move
        if self.ring is not None:
            position = torch.arange(keep.shape[2], device=keep.device).expand_as(keep)
            position = torch.where(keep_valid[:, None, :], position, -1)
            moved = torch.full(self.slots.token_index.shape, -1, dtype=keep.dtype, device=keep.device)
            moved.scatter_reduce_(2, keep, position, "amax")  # each old slot's new slot (-1: evicted)
            slots, exact = self.ring
            self.ring = (torch.where(slots >= 0, moved.gather(2, slots.clamp_min(0)), -1), exact)
        super().keep(keep, keep_valid, slack)

    def select_rows(self, index: torch.Tensor) -> None:
        self._write_out()
        super().select_rows(index)
        if self.ring is not None:
            index = torch.as_tensor(index, dtype=torch.long, device=self.device)
            self.ring = tuple(tensor.index_select(0, index) for tensor in self.ring)

    def join(self, others: list[CompressedLayer]) -> None:
        layers = [self, *others]
        for layer in layers:
            layer._write_out()
        rings = [layer.ring for layer in layers]
        shapes = [layer.slots.token_index.shape[:2] for layer in layers]
        super().join(others)
        if all(ring is None for ring in rings):
            return
        longest = max(0 if ring is None else ring[0].shape[2] for ring in rings)
        parts = []
        for ring, (batch, heads) in zip(rings, shapes):
            if ring is None:
                ring = (torch.empty((batch, heads, 0), dtype=torch.long, device=self.device),
                        torch.empty((batch, heads, 0, 2, self.key_dim), dtype=self.dtype, device=self.device))
            missing = longest - ring[0].shape[2]  # older entries, held nowhere
            parts.append(tuple(torch.cat([tensor.new_full((*tensor.shape[:2], missing, *tensor.shape[3:]), fill),
                                          tensor], dim=2) for tensor, fill in zip(ring, (-1, 0))))
        self.ring = tuple(torch.cat(tensors) for tensors in zip(*parts))

    def snapshot(self) -> tuple:
        self._write_out()
        return super().snapshot(), self.ring

    def restore(self, snapshot: tuple) -> None:
        stored, self.ring = snapshot
        super().restore(stored)
        self._open, self._unencoded = None, 0

    def copy_for(self, cache) -> CompressedLayer:
        if self.is_initialized:  # the copy shares the stored tensors, which neither then writes in place
            self._write_out()
        return super().copy_for(cache)

    # -- memory and saving --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_parts.values())

    @property
    def nbytes_parts(self) -> dict[str, int]:
        """Bytes of the packed levels, of the steps and zero points, and of the residual (its
        full-precision vectors and their slots)."""
        if self.slots is None:
            return {"levels": 0, "scales": 0, "residual": 0}
        stored = self.slots.vectors
        return {"levels": stored["data"].nbytes, "scales": stored["scale"].nbytes + stored["zero"].nbytes,
                "residual": 0 if self.ring is None else sum(tensor.nbytes for tensor in self.ring)}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        self._write_out()
        tensors, meta = super().state_dict()
        return {**tensors, **{f"ring.{i}": tensor for i, tensor in enumerate(self.ring or ())}}, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        super().load_state_dict(tensors, meta, dtype)
        ring = [tensors[name] for name in sorted(tensors) if name.startswith("ring.")]
        self.ring = tuple(ring) if ring else None
