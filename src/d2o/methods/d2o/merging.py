"""D2O's token level compensation: evicted tokens merged into their most similar kept token.

For every evicted slot e (per KV head): its best cosine similarity m_e with a kept key (keys as
cached, after RoPE) and that kept slot c*(e). A threshold tau, one per layer and per row, follows
an exponential moving average of the mean best similarity of each eviction's tokens (first
value: that mean; then tau <- alpha * tau + (1 - alpha) * mean); e is merged into c*(e) when
m_e >= tau. Paper weights, for a kept c with merged set E_c (e = Euler's number):
    w_e = exp(m_e) / (sum_{E_c} exp(m_e') + e),  w_c = e / (sum_{E_c} exp(m_e') + e),
a convex combination applied to keys and values alike. tau lives in the cache layer, so it
starts afresh with every cache (the released code carries it from one prompt to the next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from d2o.engine.policy import Evicted
from d2o.engine.stats import CHUNK_ELEMENTS
from d2o.engine.storage import RowState
from d2o.errors import D2OError
from d2o.methods.scoring import MASS, VOTES

SIMILARITY_ON = ("key", "value")
WEIGHTINGS = ("paper", "official", "normalized", "count", "attention")
ATTENTION_STATES = (VOTES, MASS)
DECISIONS = ("per_head", "mean_over_heads")
MERGES = "merges"  # slot state: evicted (token, KV head) pairs each kept slot has absorbed
NO_TARGET = -2.0  # the similarity of an evicted token with no slot allowed to absorb it
NORM_EPS = 1e-12  # as torch.nn.functional.normalize


@dataclass
class MergeState(RowState):
    """Per layer: the merge threshold of each row (NaN before its first eviction) and its history."""

    tau: torch.Tensor | None = None  # (B,)
    tau_history: list[torch.Tensor] = field(default_factory=list)  # (B,) per eviction; NaN: the row evicted none


@dataclass
class SimilarityMerge:
    """``on``: similarity of keys (paper's choice) or values; ``decision``: merge per KV head, or per
    token on its similarity averaged over heads (released code); ``weighting``, for a kept slot c
    absorbing the evicted tokens E_c, each e with best similarity m_e:
      - ``paper``: (e * c + sum exp(m_e) e) / (e + sum exp(m_e)) (convex, Euler's e for c itself);
      - ``official``: (c + sum m_e e) / (1 + |E_c|) (the released code; the vector shrinks);
      - ``normalized``: (c + sum m_e e) / (1 + sum m_e) (the released weights, made convex);
      - ``count``: each vector weighted by the number of tokens it stands for (a token-count mean);
      - ``attention``: each vector weighted by the attention it is expected to receive. A kept slot
        standing for n_c tokens that received attention a_c, absorbing e (n_e tokens, attention
        a_e), weighs n_c and e weighs min(n_e, n_c * a_e / a_c): a query that attends to c far more
        than to e (the one that retrieves c) is answered with c's value, not a blend. ``attention``
        names the slot state a is read from: ``votes``, the strongest look of the latest queries
        (kept by ``BlendedScores``: the best guess at the queries to come), or ``mass``, the
        accumulated attention per query that could see the token (kept by every attention score).

    Options beyond the paper (all off in ``d2o``): ``mass``, a slot standing for n tokens gets
    log n added to its attention logits (and statistics), so it receives the attention of n tokens;
    ``values_only``, the kept slot keeps its own key (RoPE-consistent) and only values merge;
    ``max_merges``, a kept slot absorbs at most that many evicted tokens (the most similar first);
    ``skip_first``/``skip_newest``, the first tokens (attention sinks) and the newest ones (1: the
    current token) never absorb."""

    alpha: float = 0.5
    on: str = "key"
    weighting: str = "paper"
    decision: str = "per_head"
    mass: bool = False
    values_only: bool = False
    max_merges: int | None = None
    skip_first: int = 0
    skip_newest: int = 0
    attention: str = VOTES

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise D2OError(f"alpha={self.alpha!r} must be in [0, 1]")
        for name, value, allowed in (("on", self.on, SIMILARITY_ON), ("weighting", self.weighting, WEIGHTINGS),
                                     ("decision", self.decision, DECISIONS), ("attention", self.attention,
                                                                               ATTENTION_STATES)):
            if value not in allowed:
                raise D2OError(f"{name}={value!r} must be one of {', '.join(allowed)}")
        if self.max_merges is not None and (isinstance(self.max_merges, bool) or not isinstance(self.max_merges, int)
                                            or self.max_merges < 0):
            raise D2OError(f"max_merges={self.max_merges!r} must be a whole number >= 0 (or None: no cap)")
        for name in ("skip_first", "skip_newest"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise D2OError(f"{name}={value!r} must be a whole number >= 0")
        for name in ("mass", "values_only"):
            if not isinstance(getattr(self, name), bool):
                raise D2OError(f"{name}={getattr(self, name)!r} must be true or false")

    def new_state(self) -> MergeState:
        return MergeState()

    def report(self, layer) -> dict[str, list]:
        """Per row: its threshold at each eviction, and the most evicted tokens one slot absorbed."""
        history = torch.stack(layer.state.tau_history, dim=1).tolist() if layer.state.tau_history else None
        rows = layer.merged.shape[0]
        taus = [[t for t in row if t == t] for row in history] if history else [[] for _ in range(rows)]
        merges = layer.slot_state.get(MERGES)
        most = merges.flatten(1).amax(-1).tolist() if merges is not None and merges.numel() else [0] * rows
        return {"tau": taus, "most_merges_in_a_slot": most}

    def merge(self, layer, evicted: Evicted) -> torch.Tensor:
        keys, values = layer.keys, layer.values
        batch, heads, width = evicted.token_index.shape
        if width == 0:
            return torch.zeros(batch, dtype=torch.long, device=keys.device)
        kept_basis, gone_basis = (keys, evicted.keys) if self.on == "key" else (values, evicted.values)
        best, target = most_similar(gone_basis, kept_basis, self._targets(layer))  # (B, G, E)
        gone = evicted.valid[:, None, :]  # (B, 1, E)
        if self.skip_first or self.skip_newest:  # a token with no slot left to absorb it is just dropped
            gone = gone & (best > NO_TARGET)

        # One threshold per row: EMA of the mean best similarity over heads and evicted tokens; a row
        # that evicted nothing keeps its threshold.
        count = gone.sum((1, 2)) if gone.shape[1] > 1 else evicted.valid.sum(-1) * heads
        mean_best = (best * gone).sum((1, 2)) / count.clamp_min(1)
        state = layer.state
        if state.tau is None:
            tau = mean_best
        else:
            ema = self.alpha * state.tau + (1 - self.alpha) * mean_best
            tau = torch.where(state.tau.isnan(), mean_best, ema)
        state.tau = torch.where(count > 0, tau, state.tau if state.tau is not None else math.nan)
        state.tau_history.append(torch.where(count > 0, tau, math.nan))

        if self.decision == "per_head":
            merged = (best >= state.tau[:, None, None]) & gone
        else:
            merged = ((best * gone).mean(1, keepdim=True) >= state.tau[:, None, None]) & gone
            merged = merged.expand_as(best)
        absorbed = layer.slot_state.get(MERGES)
        if absorbed is None:
            absorbed = layer.slot_state[MERGES] = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
        if self.max_merges is not None:
            merged = merged & (absorbed.gather(2, target) + rank_within_target(target, merged, best) < self.max_merges)
        self._fold(layer, evicted, best, target, merged)
        absorbed.scatter_add_(2, target, merged.int())
        return merged.sum((1, 2))

    def _targets(self, layer) -> torch.Tensor:
        """(B, G, N) bool: the kept slots that may absorb evicted tokens."""
        eligible = layer.valid
        if self.skip_first:
            eligible = eligible & (layer.token_index >= self.skip_first)
        if self.skip_newest:
            eligible = eligible & (layer.token_index < (layer.real_seen - self.skip_newest)[:, None, None])
        return eligible

    def _fold(self, layer, evicted: Evicted, best, target, merged) -> None:
        """Write the merged vectors (and, with ``mass``, the slots' new weights) into the layer.

        A kept slot c receiving tokens becomes (w_c * c + sum_e w_e * e) / (d_c + sum_e d_e), with the
        weights w and denominators d of ``weighting``; the others are left exactly as they are.
        """
        keys, values = layer.keys, layer.values
        if self.weighting in ("count", "attention") or self.mass:
            kept_count = layer.weights().exp()  # (B, G, N) tokens each slot stands for
            gone_count = evicted.log_weight.exp() if evicted.log_weight is not None else torch.ones_like(best)
        if self.weighting == "paper":
            self_weight, source_weight = math.e, best.exp()
        elif self.weighting == "count":
            self_weight, source_weight = kept_count, gone_count
        elif self.weighting == "attention":
            kept_attention = self._attention(layer, layer.slot_state, layer.token_index).gather(2, target)
            gone_attention = self._attention(layer, evicted.slot_state, evicted.token_index)
            expected = kept_count.gather(2, target) * gone_attention / kept_attention.clamp_min(NORM_EPS)
            self_weight, source_weight = kept_count, torch.minimum(gone_count, expected)
        else:
            self_weight, source_weight = 1.0, best
        source_weight = torch.where(merged, source_weight, 0.0)
        counts = merged.float() if self.weighting == "official" else source_weight
        parts = ((values, evicted.values),) if self.values_only else ((keys, evicted.keys), (values, evicted.values))
        if target.shape[-1] == 1:  # a decode step: at most one evicted token per row and head, so one target
            # As shares of the denominator: a slot that absorbs nothing keeps exactly 1 x itself + 0.
            row_index, head_index = layer.grid()
            slot = target[..., 0]
            own = self_weight if isinstance(self_weight, float) else self_weight[row_index, head_index, slot]
            denominator = own + counts[..., 0]
            own_share, source_share = (own / denominator)[..., None], (source_weight[..., 0] / denominator)[..., None]
            for kept, sources in parts:
                current = kept[row_index, head_index, slot].float()
                blended = torch.addcmul(current * own_share, sources[:, :, 0].float(), source_share)
                kept[row_index, head_index, slot] = blended.to(kept.dtype)
        else:
            received = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
            received.scatter_add_(2, target, merged.int())
            own = torch.full(keys.shape[:3], self_weight, device=keys.device) if isinstance(self_weight, float) \
                else self_weight
            denominator = own.clone().scatter_add_(2, target, counts)
            for kept, sources in parts:
                numerator = kept.float() * own[..., None]
                contribution = sources.float() * source_weight[..., None]
                numerator.scatter_add_(2, target[..., None].expand_as(contribution), contribution)
                kept.copy_(torch.where(received[..., None] > 0, numerator / denominator[..., None], kept.float()))
        if self.mass:  # a slot's weight: the tokens it now stands for (as much of them as its attention says)
            stands_for = source_weight if self.weighting == "attention" else gone_count
            added = torch.zeros_like(kept_count).scatter_add_(2, target, torch.where(merged, stands_for, 0.0))
            layer.log_weight = torch.where(added > 0, (kept_count + added).log(), layer.log_weight)


    def _attention(self, layer, slot_state: dict, token_index: torch.Tensor) -> torch.Tensor:
        """(B, G, n) the attention the slots of ``slot_state`` received, as ``attention`` says."""
        if self.attention not in slot_state:
            raise D2OError(f"weighting='attention' reads the attention each slot received from its slot state "
                           f"{self.attention!r}, which this method's scoring does not keep")
        if self.attention == VOTES:
            return slot_state[VOTES].float()
        queries_seen = (layer.real_seen[:, None, None] - token_index).clamp_min(1)
        return slot_state[MASS].float().sum(-1) / queries_seen


def rank_within_target(target: torch.Tensor, merged: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """(B, G, E): for each evicted token, how many merged tokens bound for the same kept slot are
    more similar to it (ties: the earlier in the list) - its place in that slot's queue."""
    order = (target.double() * 4 - best.double().clamp(-1, 1)).argsort(dim=-1, stable=True)  # by slot, best first
    slots, chosen = target.gather(-1, order), merged.gather(-1, order).long()
    position = torch.arange(slots.shape[-1], device=slots.device).expand_as(slots)
    starts = torch.ones_like(slots, dtype=torch.bool)
    starts[..., 1:] = slots[..., 1:] != slots[..., :-1]
    group_start = torch.where(starts, position, 0).cummax(-1).values
    before = chosen.cumsum(-1) - chosen
    rank = before - before.gather(-1, group_start)
    return torch.empty_like(rank).scatter_(-1, order, rank)


def most_similar(sources: torch.Tensor, targets: torch.Tensor, target_valid: torch.Tensor):
    """Best cosine similarity of each source (B, G, E, D) with a valid target (B, G, K, D) (validity
    per KV head, (B, G, K)), and its index.

    The targets are the whole kept cache, at every decode step: their dot products with the
    normalised sources are divided by their norms rather than normalising them, so they are read
    twice and never copied."""
    sources = torch.nn.functional.normalize(sources.float(), dim=-1)
    targets = targets.float()
    target_scale = torch.linalg.vector_norm(targets, dim=-1).clamp_min_(NORM_EPS).reciprocal_()[:, :, None, :]
    targets_t = targets.transpose(-1, -2)
    invalid = ~target_valid[:, :, None, :]  # scored NO_TARGET: below any cosine similarity
    batch, heads, n_sources, _ = sources.shape
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * targets.shape[2]))
    best, index = [], []
    for start in range(0, n_sources, chunk):
        similarity = torch.matmul(sources[:, :, start : start + chunk], targets_t).mul_(target_scale)
        values, indices = similarity.masked_fill_(invalid, NO_TARGET).max(dim=-1)
        best.append(values)
        index.append(indices)
    if len(best) == 1:
        return best[0], index[0]
    return torch.cat(best, dim=-1), torch.cat(index, dim=-1)
