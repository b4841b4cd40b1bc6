"""The server's compressed prefix cache: compressed contexts kept for the requests that begin with them.

A chat request that ends in a user message is, in effect, a question asked of the turns before it.
With a prefix cache, the engine compresses those turns alone (a ``CompressedContext``), keeps them
here at their boundary, and feeds the new message after them; the next request on the same turns
(another question on one document, the chat's next turn) finds the longest kept prefix of its
tokens, extends it to its own boundary if it has more turns, and prefills only the rest.

Entries are found by their token ids (a dict keyed by the ids of every kept length: a request's
candidates are its prefixes of those lengths), for the same method, budget and floor only; they
are evicted least recently used when a new one needs the room. A request copies an entry's state
when it starts (its first forward writes new tensors), so no entry is in use by a running request.
"""

from __future__ import annotations

from collections import OrderedDict

from d2o.runtime.context import CompressedContext

# Turns shorter than this are not kept: their prefill is cheap, and under a ratio budget the
# default floor (128 tokens) would keep them whole anyway.
MIN_PREFIX_TOKENS = 128


class PrefixCache:
    """Compressed contexts by (method key, token ids), within ``capacity`` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, CompressedContext] = OrderedDict()  # least recently used first
        self.hits = self.misses = self.cached_tokens = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(context.nbytes for context in self._entries.values())

    def contexts(self) -> list[CompressedContext]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, key: tuple, ids: list[int], most: int) -> CompressedContext | None:
        """The longest kept context of ``key`` whose ids begin ``ids``, at most ``most`` tokens long
        (a request feeds at least one token of its own after it)."""
        lengths = sorted({len(k[1]) for k in self._entries if k[0] == key and len(k[1]) <= most}, reverse=True)
        for length in lengths:
            found = self._entries.get((key, tuple(ids[:length])))
            if found is not None:
                self._entries.move_to_end((key, tuple(ids[:length])))
                return found
        return None

    def evict_oldest(self, keep: CompressedContext | None = None) -> CompressedContext | None:
        """Evict the least recently used entry that is not ``keep``; returns it (None: there is none)."""
        for key, context in self._entries.items():
            if context is not keep:
                del self._entries[key]
                self.evictions += 1
                return context
        return None

    def add(self, key: tuple, context: CompressedContext, room: int) -> bool:
        """Keep ``context`` if it fits, evicting the least recently used entries (never more than
        ``room`` bytes may be taken beyond what they free: the server's cap). False if it is not kept."""
        size = context.nbytes
        if size > min(self.capacity, room + self.nbytes):
            return False
        while self._entries and (self.nbytes + size > self.capacity or size > room):
            room += self.evict_oldest().nbytes
        self._entries[(key, tuple(context.ids))] = context
        return True
