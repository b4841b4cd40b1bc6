"""CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference")."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from d2o.engine.api import STATE_VALUE_BYTES, AttentionStats, Evicted, Merge, Merged, Observed, StatsRequest
from d2o.methods.base import check, register
from d2o.methods.h2o import H2O
from d2o.methods.scoring import AccumulatedAttention, Scoring
from d2o.options import whole

LAST_LOOK = "last_look"  # slot state: the attention the pass's last query paid each slot


@dataclass
class AccumulatedWithLastLook(AccumulatedAttention):
    """H2O's scores, plus the attention the latest query (the pass's last) paid each held token,
    averaged over the query heads of its KV head: what CaM's merge weighs a token by."""

    @property
    def keeps(self) -> tuple[str, ...]:
        return (*super().keeps, LAST_LOOK)

    def slot_state_bytes(self, group: int, allocated: bool = False) -> int:
        return super().slot_state_bytes(group, allocated) + STATE_VALUE_BYTES

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(column_mass=True, window=1)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        observed = super().observe(layer, stats)
        observed.slot_state[LAST_LOOK] = stats.window[:, :, :, -1].mean(dim=2)  # (B, G, N)
        return observed


@dataclass
class ProminenceMerge:
    """CaM's merge: an evicted token's value is added, with probability p, to the ``span`` kept
    tokens that follow it in the sequence, each receiving value / span (fewer than ``span`` kept
    after it: the rest is lost, as in the released code); keys are dropped, not merged.
    p = clamp(a_e / mean(a over those kept tokens), 0, 1), a the attention the current query pays
    each token (the rule of the released decoding code, cam_hf: the token leaving is merged when
    the query still looks at it as much as at its neighbours; its lm-eval code divides by the
    largest attention over sinks and window instead, kvpress uses accumulated attention). Drawn per
    KV head from a generator seeded by (seed, layer, tokens seen, row), so runs are reproducible
    and a batch draws what its rows would alone."""

    uneven_heads: ClassVar[bool] = False  # a row's kept tokens in token order, counted per row
    span: int = 32
    seed: int = 0

    def __post_init__(self):
        check(whole(self.span) and self.span >= 1, "span", self.span, "must be at least 1")

    reads = (LAST_LOOK,)
    vectors = ("values",)  # keys are dropped
    changes_vectors: ClassVar[bool] = True  # the kept tokens' values

    def new_state(self) -> None:
        return None

    def report(self, layer) -> dict:
        return {}

    def slot_state_bytes(self, group: int) -> int:
        return 0

    def merge(self, layers: list, evicted: list[Evicted]) -> list[Merged]:
        return [self._merge_layer(layer, gone) for layer, gone in zip(layers, evicted)]

    def _merge_layer(self, layer, evicted: Evicted) -> Merged:
        values = layer.values.clone()
        batch, heads, _ = evicted.token_index.shape
        merged = torch.zeros(batch, dtype=torch.long, device=values.device)
        received = torch.zeros(values.shape[:3], dtype=torch.bool, device=values.device)
        kept_prominence = layer.slot_state[LAST_LOOK]  # (B, G, K)
        gone_prominence = evicted.slot_state[LAST_LOOK]  # (B, G, E)
        for b in range(batch):
            n_keep, n_evict = int(layer.n_kept[b]), int(evicted.valid[b].sum())
            if not n_evict or not n_keep:
                continue
            draw = torch.Generator().manual_seed(
                zlib.crc32(f"{self.seed}/{layer.layer_idx}/{int(layer.real_seen[b])}".encode()))
            uniform = torch.rand((heads, n_evict), generator=draw).to(values.device)
            for g in range(heads):
                # The kept tokens in token order, and for each evicted one the `span` kept after it.
                kept_slots = layer.valid[b, g].nonzero()[:, 0]
                kept_tokens = layer.token_index[b, g, kept_slots]
                order = kept_tokens.argsort()
                first = torch.searchsorted(kept_tokens[order], evicted.token_index[b, g, :n_evict])
                targets = first[:, None] + torch.arange(self.span, device=values.device)  # (E, span) in order
                reachable = targets < n_keep
                targets = kept_slots[order[targets.clamp_max(n_keep - 1)]]  # their slots
                weight = reachable.float()
                target_prominence = kept_prominence[b, g, targets]
                mean = (target_prominence * weight).sum(-1) / weight.sum(-1).clamp_min(1)
                ratio = torch.nan_to_num(gone_prominence[b, g, :n_evict] / mean, nan=0.0, posinf=1.0).clamp(0, 1)
                chosen = (uniform[g] < ratio) & reachable.any(-1)
                share = weight * chosen[:, None].float() / self.span
                contribution = share[..., None] * evicted.values[b, g, :n_evict][:, None, :].float()
                values[b, g].index_add_(0, targets.flatten(), contribution.flatten(0, 1).to(values.dtype))
                received[b, g, targets[share > 0]] = True
                merged[b] += int(chosen.sum())
        return Merged(merged, values=values, changed=received)


@register
@dataclass
class CaM(H2O):
    """H2O's eviction (accumulated attention, 1:1 heavy/recent split) whose evicted values are
    merged into the following kept tokens with a probability given by the current query's
    attention (Bernoulli mask, ``ProminenceMerge``), as the paper's comparison with D2O sets it up.
    The released code evicts as StreamingLLM does instead (sinks + a recent window, merging the
    token that leaves the window). At the end of the prefill all evicted tokens are merged at once;
    the paper merges them one by one as they leave the window."""

    name = "cam"
    summary = "CaM: H2O eviction + evicted values merged into the next kept tokens (Bernoulli)"

    scoring: Scoring = field(default_factory=AccumulatedWithLastLook)
    merge: Merge | None = field(default_factory=ProminenceMerge)
