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

from d2o.engine.policy import STATE_VALUE_BYTES
from d2o.engine.stats import AttentionStats, StatsRequest
from d2o.errors import D2OError
from d2o.options import whole

MASS, VOTES, SURPRISAL = "mass", "votes", "surprisal"  # slot state


class Scoring(Protocol):
    """The part of a method that scores tokens: the statistics it needs, and the scores."""

    needs_surprisal: bool
    keeps: tuple[str, ...]  # the slot states it keeps (what a merge may weigh tokens by)

    def stats_request(self, layer, n_query: int) -> StatsRequest | None: ...

    def observe(self, layer, stats: AttentionStats) -> None: ...

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None: ...

    def score(self, layer) -> torch.Tensor: ...

    def slot_state_bytes(self, group: int) -> int:
        """Bytes of the slot states it keeps, per slot and KV head of ``group`` query heads."""


@dataclass
class AccumulatedAttention:
    """The attention a token has received so far (column mass of the prefill, then every decode
    query's attention), summed over the query heads of its KV head, in float32."""

    needs_surprisal: ClassVar[bool] = False

    @property
    def keeps(self) -> tuple[str, ...]:
        return (MASS,)

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES * group  # the mass of each query head

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
    - the votes of the latest queries: at the prefill the prompt's last ``window`` (SnapKV's
      observation window: a question at the end of the prompt points at what it needs), then each
      pass's own (a question fed after the context was compressed, each new token). ``votes="max"``
      scores a token by the strongest attention any of those queries (any head of its group) pays
      it, ``"sum"`` by their total (SnapKV's rule, under which many weak attentions of the context's
      own queries outvote the one strong look of a retrieving query);
    - the token's surprisal ``-log p(token | before)`` in a pass, weighted by ``surprisal``: what
      the model could not predict is information, wherever the question comes. ``surprisal=0``
      drops the share (and the logits it costs).

    Votes and surprisal then spread in token order: a vote on a token reaches the ``span[0]``
    tokens before it and the ``span[1]`` after it (each token keeps the largest that reaches it;
    ``span=(3, 3)`` is SnapKV's max-pool kernel of 7). Reading goes forward: a query that finds a
    token next reads the tokens that follow it (the digits after a passkey's first, the rest of a
    needle's phrase, each found by the previous one only once it is generated), so a vote reaches
    further forward than back; a surprising token opens new information that runs on for a
    clause (``surprisal_span``).
    """

    mean: bool = False
    window: int = 32
    votes: str = "max"
    span: tuple[int, int] = (3, 8)
    surprisal: float = 2.0
    surprisal_span: tuple[int, int] = (3, 16)

    def __post_init__(self):
        if not whole(self.window) or self.window < 0:
            raise D2OError(f"window={self.window!r} must be a whole number >= 0")
        if self.votes not in VOTE_RULES:
            raise D2OError(f"votes={self.votes!r} must be one of {', '.join(VOTE_RULES)}")
        for name in ("span", "surprisal_span"):
            value = getattr(self, name)
            if (not isinstance(value, (tuple, list)) or len(value) != 2
                    or any(not whole(v) or v < 0 for v in value)):
                raise D2OError(f"{name}={value!r} must be two whole numbers >= 0: the tokens before and after "
                               f"a voted one")
            setattr(self, name, tuple(value))
        if not self.surprisal >= 0:
            raise D2OError(f"surprisal={self.surprisal!r} must be >= 0")

    @property
    def needs_surprisal(self) -> bool:
        return self.surprisal > 0

    @property
    def keeps(self) -> tuple[str, ...]:
        return (MASS,) + ((VOTES,) if self.window else ()) + ((SURPRISAL,) if self.surprisal else ())

    def slot_state_bytes(self, group: int) -> int:
        return super().slot_state_bytes(group) + STATE_VALUE_BYTES * (len(self.keeps) - 1)  # votes, surprisal

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(column_mass=True, window=self.window)

    def observe(self, layer, stats: AttentionStats) -> None:
        accumulate_mass(layer, stats)
        if stats.window is not None:  # the votes of this pass's last queries replace the last pass's
            # (B, G, N): over the group's heads and the window's queries (padding queries' rows are 0)
            votes = stats.window.amax(dim=(2, 3)) if self.votes == "max" else stats.window.sum(dim=(2, 3))
            layer.slot_state[VOTES] = spread_in_token_order(votes, layer.token_index, self.span)

    def observe_tokens(self, cache, surprisal: torch.Tensor) -> None:
        record_surprisal(cache, spread(surprisal, self.surprisal_span))

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


VOTE_RULES = ("max", "sum")


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


def spread(values: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Over the last dimension, each value reaches the ``span[0]`` positions before it and the
    ``span[1]`` after it: a position gets the largest value reaching it (a 1-D max pool of
    ``values`` >= 0, shape kept)."""
    before, after = span
    if after == before == 0:
        return values
    flat = F.pad(values.reshape(-1, 1, values.shape[-1]), (after, before))  # position t: t-after .. t+before
    return F.max_pool1d(flat, before + after + 1, stride=1).view(values.shape)


def spread_in_token_order(values: torch.Tensor, token_index: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """``spread`` of ``values`` (B, G, N) over each slot's neighbours in token order (slots hold
    tokens in no order; empty ones, -1, neither give nor get a value)."""
    empty = token_index < 0
    if span == (0, 0):
        return values.masked_fill(empty, 0.0)
    order = token_index.masked_fill(empty, torch.iinfo(token_index.dtype).max).argsort(dim=-1)  # empty ones last
    spread_values = spread(values.masked_fill(empty, 0.0).gather(-1, order), span)
    return torch.empty_like(spread_values).scatter_(-1, order, spread_values).masked_fill_(empty, 0.0)


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
