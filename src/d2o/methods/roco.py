"""RoCo (Ren & Zhu 2024, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative
Language Model Inference", arXiv 2402.06262)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.engine.api import STATE_VALUE_BYTES, AttentionStats, Observed, StatsRequest
from d2o.methods.base import HeavyRecent, check, register
from d2o.options import whole


@register
@dataclass
class RoCo(HeavyRecent):
    """Robust cache omission as we read its paper (Ren and Zhu, 2024): a token's score is the mean
    attention it received from the last ``window`` queries that could see it, summed over the
    query heads of its KV head; among equal means, the lower standard deviation is evicted first
    (a robustly unimportant token; float means rarely tie, so in effect the mean decides). Plus 4
    sinks and a recent window of 10% of the budget (split 9:1). The window's attention rows are
    kept per slot (``window`` floats per token and KV head).

    The authors' released code (EasyKV, policy ``roco``) differs: its mean and standard deviation
    run over every query since the token arrived (of the attention averaged over the group's
    heads), the standard deviation bounds an eviction scope (the budget - recent - sinks tokens of
    lowest deviation; the last 10 tokens and the sinks are never in it) and the lowest mean within
    that scope is evicted; tokens of the 10% window other than the last 10 may go. It also evicts
    while it encodes the prompt, in strides (8 in its README); here the prompt is scored once, at
    the end of the prefill, by its last ``window`` queries, as every method here compresses it."""

    name = "roco"
    summary = "RoCo: mean attention over the last 32 queries (std breaks ties) + sinks + recent window"

    n_sinks: int = 4
    split: tuple[int, int] = (9, 1)
    window: int = 32

    def __post_init__(self):
        super().__post_init__()
        check(whole(self.window) and self.window >= 1, "window", self.window, "must be at least 1")

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(window=self.window)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        # This pass's rows only (under a hold the window also holds earlier passes'; they are in history).
        fresh = stats.window[:, :, :, -min(stats.n_query, stats.window.shape[3]):]
        rows = fresh.sum(dim=2).permute(0, 1, 3, 2)  # (B, G, N, w): per KV head
        history = layer.slot_state.get("recent_rows")
        if history is not None:
            rows = torch.cat([history, rows], dim=-1)[..., -self.window :]
        elif rows.shape[-1] < self.window:
            rows = torch.nn.functional.pad(rows, (self.window - rows.shape[-1], 0))
        return Observed({"recent_rows": rows.contiguous()})

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES * self.window  # the window's attention rows

    def score(self, layer) -> torch.Tensor:
        rows = layer.slot_state["recent_rows"]
        # Queries of the window that could see the token: those at or after it.
        seen_by = (layer.real_seen[:, None, None] - layer.token_index).clamp(1, self.window).float()
        mean = rows.sum(-1) / seen_by
        std = (rows.square().sum(-1) / seen_by - mean.square()).clamp_min(0).sqrt()
        # Rank by (mean, std): a stable sort by std, then by mean.
        by_std = std.argsort(dim=-1, stable=True)
        order = by_std.gather(-1, mean.gather(-1, by_std).argsort(dim=-1, stable=True))
        rank = torch.empty_like(mean)
        rank.scatter_(-1, order, torch.arange(mean.shape[-1], dtype=mean.dtype, device=mean.device).expand_as(mean))
        return rank
