"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from d2o.engine.api import STATE_VALUE_BYTES, AttentionStats, Observed, StatsRequest
from d2o.methods.base import Method, check, register
from d2o.options import whole

POOLINGS = ("max", "avg")


@register
@dataclass
class SnapKV(Method):
    """After the prefill, each prompt token is scored by the attention the last ``window`` prompt
    tokens (the observation window) pay it, summed over those queries, smoothed by 1-D pooling
    over positions (kernel 7, max pooling: the paper's LongBench configuration), then averaged
    over the query heads of each KV head (the released code repeats KV heads and selects per query
    head; kvpress averages the group, after average pooling, where the order does not matter;
    under max pooling, pooling each head first keeps a head's sharp peaks); the pooling runs over
    the prefix only, as in the paper's code. Each layer keeps the window and its best-scored other tokens;
    nothing is evicted while decoding (the cache grows by the generated tokens)."""

    name = "snapkv"
    summary = "SnapKV: observation-window votes (w=32, max-pool 7) after prefill, no decode eviction"
    evicts_during_decode = False

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        check(whole(self.window) and self.window >= 1, "window", self.window, "must be at least 1")
        check(self.kernel >= 1 and self.kernel % 2 == 1, "kernel", self.kernel, "must be odd and positive")
        check(self.pooling in POOLINGS, "pooling", self.pooling, f"must be one of {', '.join(POOLINGS)}")

    @property
    def reserved(self) -> int:
        return self.window

    @property
    def question_tokens(self) -> int:
        return self.window

    def min_budget_reason(self) -> str:
        return f"window {self.window} + {self.n_sinks} sinks + 1"

    def stats_request(self, layer, n_query: int) -> StatsRequest | None:
        return StatsRequest(window=self.window) if layer.cache.prefilling else None

    def observe(self, layer, stats: AttentionStats) -> Observed:
        votes = stats.window.sum(dim=-2)  # (B, G, group, N): summed over the window's queries
        batch, heads, group, n = votes.shape
        # The prefix is pooled alone (the window is kept anyway): the window's votes for its own
        # tokens, strong and local, must not spill onto the prefix tokens just before it.
        votes[..., n - stats.window.shape[-2]:] = 0.0
        flat = votes.reshape(-1, 1, n)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pooled = pool(flat, self.kernel, stride=1, padding=self.kernel // 2)
        return Observed({"votes": pooled.view(batch, heads, group, n).mean(dim=2)})

    def score(self, layer):
        return layer.slot_state["votes"]

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES

    def n_recent(self, target: torch.Tensor) -> torch.Tensor:
        return torch.clamp(target, max=self.window)
