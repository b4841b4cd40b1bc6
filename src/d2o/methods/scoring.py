"""Token scores: which tokens a layer keeps when it must evict (higher = keep).

H2O and D2O score a token by the attention it has received (``AccumulatedAttention``: the D2O
paper's token level). ``BlendedScores`` adds what that score misses when the question comes at
the end of a long prompt, or only after the context was compressed: the attention of the prompt's
last queries (which see the question), and each token's surprisal under the model (new
information, whatever is asked later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from d2o.engine.stats import AttentionStats, StatsRequest
from d2o.errors import D2OError

MASS, VOTES, SURPRISAL = "mass", "votes", "surprisal"  # slot state


class Scoring(Protocol):
    """The part of a method that scores tokens: the statistics it needs, and the scores."""

    needs_surprisal: bool

    def stats_request(self, layer, n_query: int) -> StatsRequest | None: ...

    def observe(self, layer, stats: AttentionStats) -> None: ...

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None: ...

    def score(self, layer) -> torch.Tensor: ...


@dataclass
class AccumulatedAttention:
    """The attention a token has received so far (column mass of the prefill, then every decode
    query's attention), summed over the query heads of its KV head, in float32."""

    needs_surprisal: ClassVar[bool] = False

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(column_mass=True)

    def observe(self, layer, stats: AttentionStats) -> None:
        accumulate_mass(layer, stats)

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None:
        pass

    def score(self, layer) -> torch.Tensor:
        return layer.slot_state[MASS].sum(-1)


@dataclass
class BlendedScores(AccumulatedAttention):
    """Three shares, each normalised to sum to one over a head's held tokens, then added:

    - accumulated attention, divided by the queries that could see each token when ``mean``
      (so an early token is not preferred for having been seen by more queries);
    - the attention of the latest queries (max-pooled over ``kernel`` neighbours): at the prefill
      the prompt's last ``window`` (SnapKV's observation window: a question at the end of the
      prompt points at what it needs), then each pass's own (a question fed after the context was
      compressed, each new token);
    - the token's surprisal ``-log p(token | before)``, max-pooled over ``surprisal_kernel``
      neighbours in the token order of a pass and weighted by ``surprisal``: what the model
      could not predict is information, wherever the question comes, and its neighbours are the
      span that carries it. ``surprisal=0`` drops the share (and the logits it costs).
    """

    mean: bool = False
    window: int = 32
    kernel: int = 7
    surprisal: float = 1.0
    surprisal_kernel: int = 7

    def __post_init__(self):
        for name in ("window", "kernel", "surprisal_kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "window" else 1):
                raise D2OError(f"{name}={value!r} must be a whole number >= {0 if name == 'window' else 1}")
        for name in ("kernel", "surprisal_kernel"):
            if getattr(self, name) % 2 == 0:
                raise D2OError(f"{name}={getattr(self, name)!r} must be odd")
        if not self.surprisal >= 0:
            raise D2OError(f"surprisal={self.surprisal!r} must be >= 0")

    @property
    def needs_surprisal(self) -> bool:
        return self.surprisal > 0

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(column_mass=True, window=self.window)

    def observe(self, layer, stats: AttentionStats) -> None:
        accumulate_mass(layer, stats)
        if stats.window is not None:  # the votes of this pass's last queries replace the last pass's
            votes = stats.window.sum(dim=(2, 3))  # (B, G, N): over the group's heads and the window's queries
            layer.slot_state[VOTES] = max_pool_in_token_order(votes, layer.token_index, self.kernel)

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None:
        record_surprisal(cache, max_pool(surprisal, self.surprisal_kernel))

    def score(self, layer) -> torch.Tensor:
        valid = layer.valid
        mass = layer.slot_state[MASS].sum(-1)
        if self.mean:
            mass = mass / (layer.real_seen[:, None, None] - layer.token_index).clamp_min(1)
        total = share(mass, valid)
        if VOTES in layer.slot_state:
            total += share(layer.slot_state[VOTES], valid)
        if self.surprisal and SURPRISAL in layer.slot_state:
            total += self.surprisal * share(layer.slot_state[SURPRISAL], valid)
        return total


def scoring_named(name: str) -> Scoring:
    """A scoring by name: accumulated (H2O's, the D2O paper's) or blended."""
    scorings = {"accumulated": AccumulatedAttention, "blended": BlendedScores}
    if name not in scorings:
        raise D2OError(f"scoring={name!r} must be one of {', '.join(scorings)}")
    return scorings[name]()


def share(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``scores`` (B, G, N) over valid slots, normalised to sum to one per row and head."""
    scores = scores.float().masked_fill(~valid, 0.0)
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-12)


def max_pool(values: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D max pooling over the last dimension (keeps the shape)."""
    if kernel == 1:
        return values
    flat = values.reshape(-1, 1, values.shape[-1])
    return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(values.shape)


def max_pool_in_token_order(values: torch.Tensor, token_index: torch.Tensor, kernel: int) -> torch.Tensor:
    """``values`` (B, G, N) max-pooled over each slot's neighbours in token order (slots hold tokens
    in no order; empty ones, -1, come last and hold zeros)."""
    if kernel == 1:
        return values
    order = token_index.masked_fill(token_index < 0, torch.iinfo(token_index.dtype).max).argsort(dim=-1)
    pooled = max_pool(values.masked_fill(token_index < 0, 0.0).gather(-1, order), kernel)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)


def accumulate_mass(layer, stats: AttentionStats) -> None:
    """Add this pass's column mass to the slot state ``mass`` (B, G, N, group), float32."""
    mass = stats.column_mass.permute(0, 1, 3, 2)
    if MASS in layer.slot_state:
        layer.slot_state[MASS] += mass
    else:
        layer.slot_state[MASS] = mass.contiguous()


def record_surprisal(cache, surprisal: torch.Tensor, decay: float = 1.0) -> None:
    """Write the new tokens' surprisal (B, q) into the slot state ``surprisal`` of every layer,
    the older tokens' first multiplied by ``decay``."""
    batch, n_new = surprisal.shape
    for layer in cache.layers:
        scores = layer.slot_state.get(SURPRISAL)
        if scores is None:
            scores = torch.zeros(layer.token_index.shape, dtype=torch.float32, device=surprisal.device)
        elif decay != 1.0:
            scores *= decay  # the new tokens' slots are overwritten just below
        fresh = layer.fresh_slots(n_new)
        scores.scatter_(2, fresh, surprisal[:, None, :].expand(batch, fresh.shape[1], n_new))
        layer.slot_state[SURPRISAL] = scores
