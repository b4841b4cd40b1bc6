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

SIMILARITY_ON = ("key", "value")
WEIGHTINGS = ("paper", "official")
DECISIONS = ("per_head", "mean_over_heads")
MERGES = "merges"  # slot state: evicted (token, KV head) pairs each kept slot has absorbed


@dataclass
class MergeState(RowState):
    """Per layer: the merge threshold of each row (NaN before its first eviction) and its history."""

    tau: torch.Tensor | None = None  # (B,)
    tau_history: list[torch.Tensor] = field(default_factory=list)  # (B,) per eviction; NaN: the row evicted none


@dataclass
class SimilarityMerge:
    """``on``: similarity of keys (paper's choice) or values; ``weighting``: the paper's convex
    weights or the released code's ``(k_c + sum m_e k_e) / (1 + |E_c|)``; ``decision``: merge
    per KV head, or per token on its similarity averaged over heads (released code)."""

    alpha: float = 0.5
    on: str = "key"
    weighting: str = "paper"
    decision: str = "per_head"

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise D2OError(f"alpha={self.alpha!r} must be in [0, 1]")
        for name, value, allowed in (("on", self.on, SIMILARITY_ON), ("weighting", self.weighting, WEIGHTINGS),
                                     ("decision", self.decision, DECISIONS)):
            if value not in allowed:
                raise D2OError(f"{name}={value!r} must be one of {', '.join(allowed)}")

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
        best, target = most_similar(gone_basis, kept_basis, layer.valid)  # (B, G, E)
        gone = evicted.valid[:, None, :]  # (B, 1, E)

        # One threshold per row: EMA of the mean best similarity over heads and evicted tokens; a row
        # that evicted nothing keeps its threshold.
        count = evicted.valid.sum(-1) * heads
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

        if self.weighting == "paper":
            source_weight = torch.where(merged, best.exp(), 0.0)
            self_weight = math.e
        else:
            source_weight = torch.where(merged, best, 0.0)
            self_weight = 1.0
        counts = merged.float() if self.weighting == "official" else source_weight
        # Each kept slot c that receives tokens becomes (w_c * c + sum_e w_e * e) / (w_c + sum_e counts_e);
        # the others are left as they are.
        if width == 1:  # a decode step: at most one evicted token per row and head, so one target
            row_index, head_index = layer.grid()
            slot, hit = target[..., 0], merged[..., 0, None]
            denominator = self_weight + counts[..., 0, None]
            for kept, sources in ((keys, evicted.keys), (values, evicted.values)):
                current = kept[row_index, head_index, slot]
                blended = current.float() * self_weight + sources[:, :, 0].float() * source_weight[..., 0, None]
                kept[row_index, head_index, slot] = torch.where(hit, (blended / denominator).to(kept.dtype), current)
        else:
            received = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
            received.scatter_add_(2, target, merged.int())
            denominator = torch.full(keys.shape[:3], self_weight, dtype=torch.float32, device=keys.device)
            denominator.scatter_add_(2, target, counts)
            for kept, sources in ((keys, evicted.keys), (values, evicted.values)):
                numerator = kept.float() * self_weight
                contribution = sources.float() * source_weight[..., None]
                numerator.scatter_add_(2, target[..., None].expand_as(contribution), contribution)
                kept.copy_(torch.where(received[..., None] > 0, numerator / denominator[..., None], kept.float()))
        absorbed = layer.slot_state.get(MERGES)
        if absorbed is None:
            absorbed = layer.slot_state[MERGES] = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
        absorbed.scatter_add_(2, target, merged.int())
        return merged.sum((1, 2))


def most_similar(sources: torch.Tensor, targets: torch.Tensor, target_valid: torch.Tensor):
    """Best cosine similarity of each source (B, G, E, D) with a valid target (B, G, K, D) (validity
    per KV head, (B, G, K)), and its index."""
    sources = torch.nn.functional.normalize(sources.float(), dim=-1)
    targets_t = torch.nn.functional.normalize(targets.float(), dim=-1).transpose(-1, -2)
    invalid = ~target_valid[:, :, None, :]
    batch, heads, n_sources, _ = sources.shape
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * targets.shape[2]))
    best, index = [], []
    for start in range(0, n_sources, chunk):
        similarity = torch.matmul(sources[:, :, start : start + chunk], targets_t).masked_fill_(invalid, -2.0)
        values, indices = similarity.max(dim=-1)
        best.append(values)
        index.append(indices)
    return torch.cat(best, dim=-1), torch.cat(index, dim=-1)
