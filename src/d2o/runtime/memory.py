"""How much KV memory a request needs: at its prefill, and at most while it decodes.

What a server admits and what ``bench fit`` packs under a memory cap. A layer holds K and V for
every kept slot; a prompt is prefilled whole before it is compressed, so the prefill holds every
prompt token in every layer; while decoding, a method that evicts holds its budget (plus the one
slot a new token is written into), a method that compresses once grows by every generated token,
and the full cache holds everything. A sliding-window layer (Gemma 3) holds its window whatever the
method.
"""

from __future__ import annotations

from dataclasses import dataclass

from d2o.budget import Budget
from d2o.engine.cache import sliding_windows
from d2o.methods.base import Method


@dataclass(frozen=True)
class KVPlan:
    """Bytes of KV cache one sequence holds: during its prefill, and at most afterwards."""

    prefill_bytes: int
    held_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.prefill_bytes, self.held_bytes)


def slot_bytes(config, dtype_bytes: int, method: Method) -> int:
    """Bytes of one slot (K and V of one token) in one layer."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_attention_heads if method.repeats_kv_heads else config.num_key_value_heads
    return 2 * heads * head_dim * dtype_bytes


def plan(config, method: Method, budget: Budget, prompt_tokens: int, new_tokens: int, dtype_bytes: int = 4) -> KVPlan:
    """The KV bytes of one sequence of ``prompt_tokens`` + ``new_tokens`` under ``method`` at ``budget``."""
    windows = sliding_windows(config.get_text_config())
    per_slot = slot_bytes(config, dtype_bytes, method)
    length = prompt_tokens + new_tokens
    compressible = [i for i, window in enumerate(windows) if window is None]
    exempt = len({compressible[i % len(compressible)] for i in method.exempt_layers})
    active = len(compressible) - exempt
    if method.keeps_everything or budget.unlimited:
        held = len(compressible) * length
    else:
        share = budget.total(len(compressible), prompt_tokens) - exempt * prompt_tokens  # the active layers'
        if method.evicts_during_decode:
            # At its budget, or growing to the floor; plus the slot each step writes before it evicts.
            held = max(share, active * budget.floor(length)) + active
        else:
            held = share + active * new_tokens
        held += exempt * length
    held += sum(min(length, window) for window in windows if window is not None)
    return KVPlan(prefill_bytes=len(windows) * prompt_tokens * per_slot, held_bytes=held * per_slot)
