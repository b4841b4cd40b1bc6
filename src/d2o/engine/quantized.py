"""A cache layer that stores its keys and values at 8, 4 or 2 bits (``quantization``).

Its table's ``vectors`` are each slot's packed levels, steps and zero points, key and value side by
side ((B, G, N, 2, ...): eviction, merging and batching move them as full-precision keys, and one
encoding serves both). The newest ``residual`` tokens of each row and KV head are also held in full
precision (per-row fields: ``ring_slots`` and ``ring_vectors``). A pass opens the layer: every slot decoded, the
residual's tokens written over their copies, new tokens in full precision; attention and methods
read that open copy, closed (``settle``) after. A decode step's token is encoded later, with the
others written since, before anything reads its bytes or it leaves the residual. Nothing else is
re-quantized: a merge names the slots it rewrote, and those whose vectors changed are encoded again.
"""

from __future__ import annotations

import torch

from d2o.engine.api import Merged
from d2o.engine.quantization import KVQuantization
from d2o.engine.selection import take_flat
from d2o.engine.slots import flat
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError

KEY, VALUE = 0, 1  # where keys and values sit in the stored and open tensors (B, G, N, 2, ...)
VECTORS = ("keys", "values")


class QuantizedLayer(CompressedLayer):
    """A ``CompressedLayer`` whose keys and values are stored quantized (see the module)."""

    row_fields = (*CompressedLayer.row_fields, "ring_slots", "ring_vectors")

    def __init__(self, cache, layer_idx: int, window: int | None, quantization: KVQuantization):
        self.quantization = quantization
        super().__init__(cache, layer_idx, window)

    def _clear(self) -> None:
        self._open: torch.Tensor | None = None  # (B, G, N, 2, D) in full precision, while a pass uses them
        # The newest tokens in full precision: slots (B, G, r) (-1: none there now), vectors (B, G, r, 2, D).
        self.ring_slots: torch.Tensor | None = None
        self.ring_vectors: torch.Tensor | None = None
        self._unencoded = 0  # the residual's newest entries whose bytes are not written yet
        super()._clear()

    keys = property(lambda layer: layer.slots and layer.attended()[0])
    values = property(lambda layer: layer.slots and layer.attended()[1])

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
        if self.ring_slots is not None:
            slots, exact = self.ring_slots, self.ring_vectors
            opened.scatter_(2, torch.where(slots >= 0, slots, n_slots)[..., None, None].expand(exact.shape), exact)
        return opened[:, :, :n_slots]

    def settle(self) -> None:
        self._open = None  # what a merge changed in it is encoded already

    def _write_out(self) -> None:
        """Every stored byte up to date and the open copy dropped (before the slots move)."""
        self._encode_newest()
        self._open = None

    def _stored_form(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        if keys.shape[-1] != values.shape[-1]:
            raise D2OError(f"kv_bits stores a key and a value side by side: this model's keys have {keys.shape[-1]} "
                           f"channels and its values {values.shape[-1]}")
        vectors = torch.stack([keys, values], dim=3)
        self._open, self._unencoded = None, 0
        if self.quantization.residual:  # every row's residual as long as it will be, its entries empty
            batch, heads = vectors.shape[:2]
            self.ring_slots = torch.full((batch, heads, self.quantization.residual), -1, device=vectors.device)
            self.ring_vectors = vectors.new_zeros((batch, heads, self.quantization.residual, *vectors.shape[3:]))
        self._to_residual(0, vectors)
        return self.quantization.encode(vectors)

    def _write(self, written, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, key_slots, value_slots = written
        keys, values = self.attended()
        keys.scatter_(2, key_slots, key_states)
        values.scatter_(2, value_slots, value_states)
        vectors = torch.stack([key_states, value_states], dim=3)
        if not self.quantization.residual:  # nowhere else to read it from: its bytes now
            self._write_bytes(self.slots.flat(slots), vectors.flatten(0, 2))
            return
        self._to_residual(slots, vectors)
        self._unencoded += 1
        if self._unencoded == self.quantization.residual:  # the next one would push it out unencoded
            self._encode_newest()

    def _encode_newest(self) -> None:
        """Encode the residual's entries written since the last time (decode steps' tokens) into their
        slots (one whose slot took a newer token since has none to write)."""
        count, self._unencoded = self._unencoded, 0
        if not count:
            return
        slots, exact = self.ring_slots[:, :, -count:], self.ring_vectors[:, :, -count:]
        index, vectors = self.slots.flat(slots), exact.flatten(0, 2)
        still = (slots >= 0).flatten()
        if not bool(still.all()):
            index, vectors = index[still], vectors[still]
        self._write_bytes(index, vectors)

    def _write_bytes(self, index: torch.Tensor, vectors: torch.Tensor) -> None:
        """Encode ``vectors`` (K, 2, D) into the slots at flat ``index`` (K,), in place, in the mode the
        stored tensors were made in."""
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
        self._to_residual(n_slots, vectors)

    def _to_residual(self, slots: torch.Tensor | int, vectors: torch.Tensor) -> None:
        """Keep the tokens just written, ``vectors`` (B, G, q, 2, D), as the residual's newest: written
        into ``slots`` (B, G, 1) (an older entry for that slot is dropped), or appended from slot int."""
        residual = self.quantization.residual
        added = vectors.shape[2]
        if not residual or not added:
            return
        if isinstance(slots, int):
            count = min(residual, added)
            slots = torch.arange(slots + added - count, slots + added, device=vectors.device)
            slots, vectors = slots.expand(*vectors.shape[:2], count), vectors[:, :, added - count:]
        ring_slots = self.ring_slots
        if slots.shape[2] == 1:
            ring_slots = ring_slots.masked_fill(ring_slots == slots, -1)
        self.ring_slots = torch.cat([ring_slots, slots], dim=2)[:, :, -residual:]
        self.ring_vectors = torch.cat([self.ring_vectors, vectors], dim=2)[:, :, -residual:]

    def _write_vectors(self, merged: Merged) -> None:
        """A merge's vectors into the open copy, the slots they changed encoded again, the residual's
        copies following."""
        self._encode_newest()
        self.attended()
        self._open = opened = self._open.contiguous()
        batch, heads, n_slots = opened.shape[:3]
        index = torch.arange(batch * heads * n_slots, device=opened.device) if merged.slots is None \
            else self.slots.flat(merged.slots)
        named = slice(None) if merged.changed is None else merged.changed.flatten() != 0
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
        if self.ring_slots is not None:
            self.ring_vectors = opened.gather(2, self.ring_slots.clamp_min(0)[..., None, None].expand(
                self.ring_vectors.shape))

    def _take_vectors(self, slots: torch.Tensor, vectors: tuple[str, ...]) -> dict[str, torch.Tensor]:
        self._encode_newest()
        index = self.slots.flat(slots)

        def take(tensor: torch.Tensor) -> torch.Tensor:
            return take_flat(tensor, index, slots.shape)

        both = take(self._open) if self._open is not None else \
            self.quantization.decode({part: take(tensor) for part, tensor in self.slots.vectors.items()}).to(self.dtype)
        return {name: both[:, :, :, VECTORS.index(name)] for name in vectors}

    # -- slot operations: the residual's slots follow -------------------------------------------
    def keep(self, keep: torch.Tensor, keep_valid: torch.Tensor, slack: int = 0) -> None:
        self._write_out()  # before the residual's slots move
        if self.ring_slots is not None:
            position = torch.arange(keep.shape[2], device=keep.device).expand_as(keep)
            position = torch.where(keep_valid if keep_valid.dim() == 3 else keep_valid[:, None, :], position, -1)
            moved = torch.full(self.slots.token_index.shape, -1, dtype=keep.dtype, device=keep.device)
            moved.scatter_reduce_(2, keep, position, "amax")  # each old slot's new slot (-1: evicted)
            slots = self.ring_slots
            self.ring_slots = torch.where(slots >= 0, moved.gather(2, slots.clamp_min(0)), -1)
        super().keep(keep, keep_valid, slack)

    def select_rows(self, index: torch.Tensor) -> None:
        self._write_out()
        super().select_rows(index)

    def join(self, others: list[CompressedLayer]) -> None:
        for layer in (self, *others):
            layer._write_out()
        super().join(others)

    def snapshot(self) -> tuple:
        self._write_out()
        return super().snapshot()

    def restore(self, snapshot: tuple) -> None:
        super().restore(snapshot)
        self._open, self._unencoded = None, 0

    def copy_for(self, cache) -> CompressedLayer:
        if self.is_initialized:  # the copy shares the stored tensors, which neither then writes in place
            self._write_out()
        return super().copy_for(cache)

    # -- memory and saving --------------------------------------------------------------------------
    nbytes = property(lambda layer: sum(layer.nbytes_parts.values()))

    @property
    def nbytes_parts(self) -> dict[str, int]:
        """Bytes of the packed levels, of the steps and zero points, and of the residual."""
        if self.slots is None:
            return {"levels": 0, "scales": 0, "residual": 0}
        stored = self.slots.vectors
        return {"levels": stored["data"].nbytes, "scales": stored["scale"].nbytes + stored["zero"].nbytes,
                "residual": 0 if self.ring_slots is None else self.ring_slots.nbytes + self.ring_vectors.nbytes}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        self._write_out()
        return super().state_dict()
