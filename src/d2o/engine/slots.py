"""A layer's per-slot fields as one table, and the vacancies decoding writes into.

Every field of a ``SlotTable`` is (B, G, N, ...): rows, stored KV heads, slots. They are listed
here, once: the keys and values as stored (``vectors``: themselves, or their packed parts), each
slot's token index among its row's real tokens (``token_index``; -1: empty), the log of the tokens
it stands for (``log_weight``; None: one each) and the method's state (``state``, by name).
Gathering, selecting rows, padding, joining, copying, snapshots and state dicts map over them all;
an empty slot holds -1 as its token index and zeros in every other field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.engine.selection import flat_offsets, take_flat, take_slots

EMPTY_INDEX = -1  # the token index of an empty slot (every other field holds zeros there)
TOKEN_INDEX_DTYPE = torch.int32  # each slot's token index, per KV head: 2**31 tokens are enough


def _with_empty_slots(tensor: torch.Tensor, count: int, fill) -> torch.Tensor:
    """``tensor`` (B, G, N, ...) with ``count`` more slots holding ``fill``."""
    return tensor if count <= 0 else \
        torch.cat([tensor, tensor.new_full((*tensor.shape[:2], count, *tensor.shape[3:]), fill)], dim=2)


class SlotTable:
    """A layer's per-slot fields (see the module)."""

    def __init__(self, vectors: dict[str, torch.Tensor], token_index: torch.Tensor,
                 log_weight: torch.Tensor | None = None, state: dict[str, torch.Tensor] | None = None):
        self.vectors, self.token_index, self.log_weight = vectors, token_index, log_weight
        self.state = {} if state is None else state
        self._offsets: torch.Tensor | None = None  # (B, G, 1): where each row and head starts in a flat view
        self._known: list[tuple[torch.Tensor, torch.Tensor]] = []  # `flat`'s last two slots, and answers

    def map(self, fn) -> SlotTable:
        """A new table of ``fn(tensor, fill)`` for every field (``fill``: what an empty slot holds)."""
        return SlotTable({name: fn(tensor, 0) for name, tensor in self.vectors.items()},
                         fn(self.token_index, EMPTY_INDEX),
                         None if self.log_weight is None else fn(self.log_weight, 0),
                         {name: fn(tensor, 0) for name, tensor in self.state.items()})

    width = property(lambda table: table.token_index.shape[2])

    def flat(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots (B, G, K) as one index into the flat views (B * G * N, ...) of every field."""
        batch, heads, width = self.token_index.shape
        if self._offsets is None or self._offsets.shape[:2] != (batch, heads) or self._offsets_width != width:
            self._offsets, self._offsets_width = flat_offsets(batch, heads, width, self.token_index.device), width
            self._known = []
        # A decode step asks four times for the victims' slots (copied, emptied, written, admitted) and
        # a merge for its targets': each is computed once.
        for known, index in self._known:
            if known is slots:
                return index
        index = (slots + self._offsets).flatten()
        self._known = [(slots, index), *self._known[:1]]
        return index

    def take(self, slots: torch.Tensor, valid: torch.Tensor | None = None, slack: int = 0) -> SlotTable:
        """The slots (B, G, K) gathered into new tensors, emptied where ``valid`` (B, K), or (B, G, K)
        per KV head, is False (a row keeping fewer than K), ``slack`` empty ones after them."""
        empty = None if valid is None or bool(valid.all()) else ~(valid[:, None, :] if valid.dim() == 2 else valid)

        def gather(tensor: torch.Tensor, fill) -> torch.Tensor:
            taken = take_slots(tensor, slots)
            if empty is not None:
                taken.masked_fill_(empty.view(*empty.shape, *(1,) * (taken.dim() - 3)), fill)
            return _with_empty_slots(taken, slack, fill)

        return self.map(gather)

    def narrow(self, start: int, stop: int) -> SlotTable:
        """The slots ``start:stop`` of every field but the vectors (views): bookkeeping alone."""
        return SlotTable({}, self.token_index[:, :, start:stop],
                         None if self.log_weight is None else self.log_weight[:, :, start:stop],
                         {name: state[:, :, start:stop] for name, state in self.state.items()})

    def emptied(self, where: torch.Tensor) -> SlotTable:
        """A new table with the slots ``where`` (B, G, N) empty: -1 as token index, zeros elsewhere."""
        return self.map(lambda tensor, fill: tensor.masked_fill(where.view(*where.shape, *(1,) * (tensor.dim() - 3)),
                                                                fill))

    def beside(self, other: SlotTable) -> SlotTable:
        """``other``'s slots after this table's, in new tensors; a table without vectors (``narrow``'s)
        adds none, and a field one side lacks is zeros there (``cat``)."""
        vectors = self.vectors if not other.vectors else other.vectors if not self.vectors else \
            {name: torch.cat([self.vectors[name], other.vectors[name]], dim=2) for name in self.vectors}
        joined = SlotTable.cat([SlotTable({}, table.token_index, table.log_weight, table.state)
                                for table in (self, other)])
        return SlotTable(vectors, joined.token_index, joined.log_weight, joined.state)

    def slots_between(self, start: int, stop: int, heads: slice = slice(None)) -> SlotTable:
        """The slots ``start:stop`` (of the KV heads ``heads``) of every field: views."""
        return self.map(lambda tensor, _: tensor[:, heads, start:stop])

    @staticmethod
    def cat(tables: list[SlotTable]) -> SlotTable:
        """The slots of ``tables`` (the same rows and KV heads) one after the other, in new tensors; a
        field one table lacks is zeros there."""
        def cat(parts: list, fill) -> torch.Tensor | None:
            example = next((part for part in parts if part is not None), None)
            if example is None:
                return None
            return torch.cat([example.new_full((*table.token_index.shape, *example.shape[3:]), fill) if part is None
                              else part for part, table in zip(parts, tables)], dim=2)

        def by_name(dicts: list[dict]) -> dict[str, torch.Tensor]:
            return {name: cat([fields.get(name) for fields in dicts], 0)
                    for name in dict.fromkeys(name for fields in dicts for name in fields)}

        return SlotTable(by_name([table.vectors for table in tables]),
                         cat([table.token_index for table in tables], EMPTY_INDEX),
                         cat([table.log_weight for table in tables], 0), by_name([table.state for table in tables]))

    def select_rows(self, index: torch.Tensor) -> SlotTable:
        return self.map(lambda tensor, _: tensor.index_select(0, index))

    @staticmethod
    def join(tables: list[SlotTable]) -> SlotTable:
        """The rows of ``tables`` one after the other, each padded with empty slots to the widest; a
        field one table lacks (state a method sets late, a log weight) is zeros there."""
        width = max(table.width for table in tables)

        def cat(parts: list, fill) -> torch.Tensor:
            example = next(part for part in parts if part is not None)
            return torch.cat([_with_empty_slots(example.new_zeros((*table.token_index.shape, *example.shape[3:]))
                                                if part is None else part, width - table.width, fill)
                              for part, table in zip(parts, tables)])

        def by_name(dicts: list[dict]) -> dict[str, torch.Tensor]:
            return {name: cat([fields.get(name) for fields in dicts], 0)
                    for name in dict.fromkeys(name for fields in dicts for name in fields)}

        weights = [table.log_weight for table in tables]
        return SlotTable(by_name([table.vectors for table in tables]),
                         cat([table.token_index for table in tables], EMPTY_INDEX),
                         None if all(weight is None for weight in weights) else cat(weights, 0),
                         by_name([table.state for table in tables]))

    def shared(self) -> SlotTable:
        """A table sharing the vectors and token indices, with copies of the log weights and state."""
        return SlotTable(dict(self.vectors), self.token_index,
                         None if self.log_weight is None else self.log_weight.clone(),
                         {name: state.clone() for name, state in self.state.items()})

    def forked(self, prefix: str) -> SlotTable:
        """Another method's table over the same vectors and tokens: the state under ``prefix``, copied."""
        return SlotTable(dict(self.vectors), self.token_index,
                         state={name: state.clone() for name, state in named(self.state, prefix).items()})

    def grow(self, token_index: torch.Tensor) -> None:
        """Append the slots of tokens whose vectors were appended already: their token indices
        (B, G, q), zeros in the other fields."""
        count = token_index.shape[2]
        self.token_index = torch.cat([self.token_index, token_index], dim=2)
        if self.log_weight is not None:
            self.log_weight = _with_empty_slots(self.log_weight, count, 0)
        self.state = {name: _with_empty_slots(state, count, 0) for name, state in self.state.items()}

    def restored(self, snapshot: SlotTable) -> SlotTable:
        """The table at ``snapshot`` (a shallow copy) but for the state the passes since wrote into its
        slots (a probe's statistics)."""
        width = snapshot.width
        return SlotTable(dict(snapshot.vectors), snapshot.token_index, snapshot.log_weight,
                         {name: state[:, :, :width].contiguous() for name, state in self.state.items()})

    def snapshot(self) -> SlotTable:
        return SlotTable(dict(self.vectors), self.token_index, self.log_weight, dict(self.state))

    def copies(self, index: torch.Tensor, shape: torch.Size, states: tuple[str, ...] | None) -> dict:
        """Copies of the token indices, log weights and ``states`` (None: all) of the slots at flat
        ``index``, each shaped ``shape`` (B, G, K)."""
        return {"token_index": take_flat(self.token_index, index, shape),
                "log_weight": None if self.log_weight is None else take_flat(self.log_weight, index, shape),
                "slot_state": {name: take_flat(state, index, shape) for name, state in self.state.items()
                               if states is None or name in states}}

    def clear(self, index: torch.Tensor) -> None:
        """Zero the state and log weight of the slots at flat ``index``, in place."""
        for state in self.state.values():
            flat(state).index_fill_(0, index, 0)
        if self.log_weight is not None:
            self.log_weight.view(-1).index_fill_(0, index, 0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fields by name: ``stored.NAME`` (vectors), ``token_index``, ``log_weight``, ``slot.NAME``."""
        return {**{f"stored.{name}": tensor for name, tensor in self.vectors.items()}, "token_index": self.token_index,
                **({} if self.log_weight is None else {"log_weight": self.log_weight}),
                **{f"slot.{name}": tensor for name, tensor in self.state.items()}}

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor]) -> SlotTable:
        return cls(named(tensors, "stored."), tensors["token_index"], tensors.get("log_weight"),
                   named(tensors, "slot."))

    vector_bytes = property(lambda table: sum(tensor.nbytes for tensor in table.vectors.values()))
    bookkeeping_bytes = property(lambda table: sum(tensor.nbytes for name, tensor in table.state_dict().items()
                                                   if not name.startswith("stored.")), doc="All but the vectors.")


def named(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose names begin with ``prefix``, by the rest of their names."""
    return {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A (B, G, N, ...) tensor as (B * G * N, rest): a view, so writes into it land in ``tensor``."""
    return tensor.view(tensor.shape[0] * tensor.shape[1] * tensor.shape[2], -1)


@dataclass
class Vacancies:
    """The slots an eviction emptied in every row and KV head, taken by the next tokens in order, each
    step's prepared: ``slots`` (B, G, 1), as scatter indices into the logit bias (``bias_slots``) and
    the keys and values (``key_slots``/``value_slots``), the token's index and the row's real tokens
    after it (``token_index``, ``real_seen``: right while every token is real)."""

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
        token_index = (real_seen[:, None, None] + steps).to(TOKEN_INDEX_DTYPE).expand(batch, heads, count)
        return cls(slots=slots.split(1, 2), bias_slots=slots[:, :, None, :].split(1, 3), key_slots=key_slots,
                   value_slots=value_slots, token_index=token_index.split(1, 2),
                   real_seen=(real_seen[None, :] + steps[:, None] + 1).unbind(0))

    @property
    def left(self) -> int:
        return len(self.slots) - self.taken
