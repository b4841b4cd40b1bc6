"""The server's options, checked before torch and the model load."""

from __future__ import annotations

import re
from dataclasses import dataclass

from d2o.budget import Budget
from d2o.errors import D2OError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``512MB``, ``2GiB``, ``1.5GB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if unit not in UNITS:
        raise D2OError(f"memory size {text!r}: expected a number of bytes or a number with a unit "
                       f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MB or 2GiB")
    size = int(float(match.group(1)) * UNITS[unit])
    if size < 1:
        raise D2OError(f"memory size {text!r} must be at least 1 byte")
    return size


@dataclass(frozen=True)
class ServeConfig:
    """What ``d2o serve`` runs: the model, the default method and budget of a request that names
    none, the KV memory cap, the queue, and the default ``max_tokens``."""

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

    def check(self) -> None:
        """Refuse bad options before anything heavy loads (the method and budget too)."""
        budget = Budget.parse(self.budget, self.min_tokens)
        if self.max_queue < 0:
            raise D2OError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_tokens < 1:
            raise D2OError(f"max_tokens must be at least 1, got {self.max_tokens}")

        from d2o.runtime.generation import resolve  # torch loads here, the model not yet

        resolve(self.method, budget)
