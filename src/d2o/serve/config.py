"""The server's options, checked before torch and the model load."""

from __future__ import annotations

from dataclasses import dataclass, field

from d2o.budget import EVICT_EVERY, Budget
from d2o.errors import D2OError
from d2o.options import check_kv_bits, check_prefill_chunk

@dataclass(frozen=True)
class ServeConfig:
    """What ``d2o serve`` runs: the model, the default method and budget of a request that names
    none, the KV memory cap (and its share for compressed prefixes), the queue, and the default
    ``max_tokens``."""

    model: str = "smollm2"
    method: str = "d2o"
    budget: str = "0.2"
    min_tokens: int | None = None  # the floor under ratio budgets (None: the library's default)
    kv_memory: int = 512 * 10**6
    max_queue: int = 64  # requests waiting for memory; more get HTTP 503
    max_tokens: int = 256  # when a request does not say
    dtype: str = "float32"
    attention: str = "sdpa"
    device_map: str | None = None
    prefix_cache_memory: int = 0  # bytes of --kv-memory for compressed prefixes (0: no prefix cache)
    evict_every: int = EVICT_EVERY  # evict in batches of decode steps (CompressedCache's)
    kv_bits: int | None = None  # keys and values stored at 8, 4 or 2 bits (None: the model's dtype)
    prefill_chunk: int | None = None  # prompts prefilled this many tokens at a time (None: whole)
    # Prompts prefilled on a thread of their own beside the decode steps, each taking half the cores
    # while both run (False: a round runs a prefill chunk, then the decode steps).
    prefill_thread: bool = False
    # Requests on a kept document read its keys and values in place (False: each copies them, as a
    # server sharing only uncompressed prefixes would; ``d2o bench serve --prefix-sharing`` compares).
    share_prefixes: bool = True
    # Options of a method, for every request of it: {"kvzip": {"heads": "adaptive"}} (--option kvzip.heads=adaptive).
    method_options: dict = field(default_factory=dict, hash=False)

    def check(self):
        """Refuse bad options before anything heavy loads (the method and budget too); returns the
        default method and budget, resolved."""
        budget = Budget.parse(self.budget, self.min_tokens)
        if self.max_queue < 0:
            raise D2OError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_tokens < 1:
            raise D2OError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.evict_every < 1:
            raise D2OError(f"evict_every must be at least 1, got {self.evict_every}")
        check_kv_bits(self.kv_bits)
        check_prefill_chunk(self.prefill_chunk)
        if not 0 <= self.prefix_cache_memory < self.kv_memory:
            raise D2OError(f"--prefix-cache-memory ({self.prefix_cache_memory:,} bytes) is part of --kv-memory "
                           f"({self.kv_memory:,}): it must be >= 0 and leave room for the requests")

        from d2o.methods import get_method  # torch loads here, the model not yet
        from d2o.runtime.generation import resolve

        for name, options in self.method_options.items():
            get_method(name, **options)  # a bad option fails now, not at a request
        return resolve(self.method, budget, **self.method_options.get(self.method, {}))
