"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass

from d2o.engine.api import STATE_VALUE_BYTES, AttentionStats, Observed, StatsRequest
from d2o.methods.base import Method, register


@register
@dataclass
class TOVA(Method):
    """Token Omission Via Attention: a token's score is the attention of the current (last)
    query only, averaged over all query heads of the layer, so every KV head of a layer keeps the
    same tokens. At the end of the prefill the last prompt token's attention cuts the prompt to
    the budget in one shot; then each step drops the lowest-scored token (possibly the new one).
    No sinks, no recent window, no accumulation (the paper's rule)."""

    name = "tova"
    summary = "TOVA: drops the token the current query attends to least (mean over heads)"

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(window=1)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        current = stats.window[:, :, :, -1, :].mean(dim=(1, 2))  # (B, N)
        return Observed({"current": current[:, None, :].expand(-1, stats.window.shape[1], -1).contiguous()})

    def score(self, layer):
        return layer.slot_state["current"]

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES
