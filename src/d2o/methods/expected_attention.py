"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's ``ExpectedAttentionPress``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from d2o.engine.api import AttentionStats, Observed, RowState, StatsRequest
from d2o.methods.base import Method, check, register
from d2o.options import whole


@dataclass
class QueryMoments(RowState):
    """Per row and query head, the sums that give the mean and covariance of a layer's prompt
    queries before RoPE (scaled by the attention's factor): their count (B,), sum (B, H, D) and sum
    of outer products (B, H, D, D), float32."""

    count: torch.Tensor | None = None
    total: torch.Tensor | None = None
    squares: torch.Tensor | None = None


@register
@dataclass
class ExpectedAttention(Method):
    """Scores a token by the attention that queries to come are expected to pay it. During the
    prefill each layer records the mean and covariance of its queries before RoPE (every prompt
    position but the first ``n_sinks``); at compression both are rotated by RoPE averaged over the
    next ``future`` positions, and a key k is scored, per query head, by
    softmax_k(k . mu + k^T Sigma k / 2) (the Gaussian expectation of exp(q . k), the attention's
    scale inside mu and Sigma), averaged over the heads of its KV head, times ||v|| (kvpress's
    ``use_vnorm``). The first ``n_sinks`` tokens stay; the same budget in every layer; compressed
    once after the prefill, nothing evicted while decoding. No second pass: the statistics come
    from the prefill's own queries (which see the question only when it is in the prompt).

    Choices and differences from kvpress's ``ExpectedAttentionPress`` (0.5.5): the queries are the
    attention's own, un-rotated (kvpress recomputes them from the hidden states: the same
    numbers); the logits' scale is the attention's (kvpress divides by sqrt(head_dim): equal on
    the supported models but Gemma 3, whose scale is ``query_pre_attn_scalar``); statistics in
    float32; a chunked prefill's passes add to one mean and covariance; the future positions
    start after each row's own prompt.
    """

    name = "expected-attention"
    summary = "Expected Attention: tokens scored by the attention future queries are expected to pay (query-agnostic)"
    evicts_during_decode = False

    n_sinks: int = 4
    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check(whole(self.future) and self.future >= 1, "future", self.future, "must be a whole number >= 1")
        check(self.epsilon >= 0, "epsilon", self.epsilon, "must be >= 0")

    def new_layer_state(self) -> QueryMoments:
        return QueryMoments()

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(queries=True)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        index = stats.query_index  # (B, q)
        work = torch.promote_types(stats.queries.dtype, torch.float32)  # float32 at least
        cos, sin = layer.cache.rotary(layer.layer_idx, index.clamp_min(0), work)  # (B, q, D)
        rotated = stats.queries.to(work)  # (B, H, q, D)
        cos, sin = cos[:, None].to(work), sin[:, None].to(work)
        # RoPE turned back: a rotation by -theta, divided by the tables' own scale (cos^2 + sin^2).
        queries = (rotated * cos - rotate_half(rotated) * sin) / (cos * cos + sin * sin) * stats.scaling
        weight = (index >= self.n_sinks).to(work)  # padding (-1) and the sinks count for nothing
        state = layer.state
        count = weight.sum(-1)
        weighted = queries * weight[:, None, :, None]
        total = weighted.sum(2)
        # Two operands at a time: a three-way einsum may build the (B, H, q, D, D) outer products first.
        squares = weighted.transpose(-1, -2) @ queries  # (B, H, D, D)
        if state.count is not None:
            count, total, squares = state.count + count, state.total + total, state.squares + squares
        return Observed(state=replace(state, count=count, total=total, squares=squares))

    def score(self, layer) -> torch.Tensor:
        state = layer.state
        count = state.count.clamp_min(1)[:, None, None]
        mean = state.total / count  # (B, H, D)
        start = layer.real_seen[:, None]
        future = start + torch.arange(self.future, device=start.device)  # (B, F)
        work = mean.dtype
        cos, sin = (table.mean(1) for table in layer.cache.rotary(layer.layer_idx, future, work))  # (B, D)
        mean = mean * cos[:, None] + rotate_half(mean) * sin[:, None]
        keys = layer.keys.to(work)  # (B, G, N, D)
        batch, kv_heads, n_slots, dim = keys.shape
        heads = mean.shape[1]
        keys = keys[:, :, None].expand(batch, kv_heads, heads // kv_heads, n_slots, dim).reshape(batch, heads,
                                                                                                  n_slots, dim)
        logits = torch.einsum("bhnd,bhd->bhn", keys, mean)
        if self.covariance:
            covariance = state.squares / count[..., None] - mean_outer(state.total / count)
            rotation = torch.diag_embed(cos) + torch.diag_embed(sin) @ half_turn(dim, cos)  # (B, D, D)
            covariance = rotation[:, None] @ covariance @ rotation[:, None].transpose(-1, -2)
            logits = logits + 0.5 * ((keys @ covariance) * keys).sum(-1)
        index = layer.token_index
        sinks = (index >= 0) & (index < self.n_sinks)
        scored = (index >= 0) & ~sinks  # (B, G, N)
        hidden = ~scored.repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1).nan_to_num(0.0)
        scores = probs.view(batch, kv_heads, heads // kv_heads, n_slots).mean(2)
        if self.value_norm:
            scores = (scores + self.epsilon) * layer.values.to(work).norm(dim=-1)
        return scores.float().masked_fill(sinks, torch.finfo(torch.float32).max)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing of a head's two halves: (x1, x2) -> (-x2, x1)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def half_turn(dim: int, like: torch.Tensor) -> torch.Tensor:
    """The (dim, dim) matrix P with P x = rotate_half(x), in ``like``'s dtype and device."""
    return rotate_half(torch.eye(dim, dtype=like.dtype, device=like.device)).t()


def mean_outer(mean: torch.Tensor) -> torch.Tensor:
    """(..., D, D): the outer product of a mean with itself."""
    return mean[..., :, None] * mean[..., None, :]
