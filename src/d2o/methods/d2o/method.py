"""D2O: Dynamic Discriminative Operations (Wan et al., ICLR 2025, arXiv 2406.13035).

Three separable parts, each a field an ablation can swap:
1. layer level (``allocation``): budgets from the spread of each layer's prefill attention,
   inverse-variance softmax, conserving the total (``InverseVariance``);
2. token level (inherited from H2O): accumulated float32 attention scores, per KV head, an N:M
   heavy-hitter/recent split of each layer's budget (3:1, the paper's best), 4 attention sinks;
   eviction at the end of the prefill, then one token per decode step;
3. compensation (``merge``): evicted tokens merged into their most similar kept token when the
   similarity reaches a per-layer EMA threshold (``SimilarityMerge``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from d2o.budget import UNLIMITED, Budget
from d2o.engine.api import Allocated, Merge, Observed
from d2o.methods.allocation import Allocation, InverseVariance, layer_density
from d2o.methods.base import register
from d2o.methods.d2o.merging import MergeState, SimilarityMerge
from d2o.methods.h2o import H2O
from d2o.methods.scoring import MASS


@register
@dataclass
class D2O(H2O):
    """D2O with the paper's choices: inverse-variance layer budgets (r_min 0.01), 3:1 split,
    4 sinks, key-similarity merging with alpha 0.5 and the paper's convex weights."""

    name = "d2o"
    summary = "D2O: inverse-variance layer budgets + H2O eviction (3:1, 4 sinks) + similarity merging"

    split: tuple[int, int] = (3, 1)
    n_sinks: int = 4
    allocation: Allocation = field(default_factory=InverseVariance)
    merge: Merge | None = field(default_factory=SimilarityMerge)


@dataclass
class OfficialState(MergeState):
    """The released code's per-layer state: its merge threshold, the layer's density F_l as the
    prefill left it, and each row's recent part."""

    density: torch.Tensor | None = None  # (B,) F_l from the prefill's attention only
    recent: torch.Tensor | None = None  # (B,) newest tokens kept, fixed at allocation


@register
@dataclass
class D2OOfficial(D2O):
    """The released code's choices (verified step by step against it), to reproduce
    published numbers: compression at the first decode step (its query's attention included);
    layer ratios clamp(L * rho * softmax(-F), 0.01, 1) over all layers, exempt ones included (their
    share is lost); heavy and recent parts floor((S + 1) * part) separately, split 1:1; layers 0, 1
    and L-1 kept whole; a merge decided per token on its similarity averaged over heads and applied
    as (k + sum m_e k_e) / (1 + n); KV heads stored once per query head, so scores, eviction and
    merging are per query head (the cache is H/G times larger: its reported bytes show it); no
    floor under a ratio budget unless one is asked for (``--min-tokens``)."""

    name = "d2o-official"
    summary = "D2O as released: 1:1, exempt layers 0,1,L-1, first-decode compression, mean merge"
    compress_after_forward = 2
    repeats_kv_heads = True
    conserves_budget = False  # its exempt layers' share is lost, each other layer floors (S + 1) * ratio

    split: tuple[int, int] = (1, 1)
    exempt_layers: tuple[int, ...] = (0, 1, -1)
    merge: Merge | None = field(
        default_factory=lambda: SimilarityMerge(weighting="official", decision="mean_over_heads")
    )

    def new_layer_state(self) -> OfficialState:
        return OfficialState()

    def budget_for(self, budget: Budget) -> Budget:
        """The released code has no floor: under a ratio budget the library's default one is dropped
        (small layers would keep more than the released code keeps, and the logits part from the
        first decode step); a floor asked for (``--min-tokens``) is kept."""
        if budget.ratio is None or budget.floor_given:
            return budget
        return replace(budget, min_tokens=0)

    def observe(self, layer, stats) -> Observed:
        observed = super().observe(layer, stats)
        if layer.cache.forwards == 0:  # the prefill: its attention alone gives F_l, as in the released code
            mass = layer.slot_state.get(MASS)
            added = observed.added[MASS]
            observed.state = replace(layer.state, density=layer_density(layer, added if mass is None else mass + added))
        return observed

    def allocate(self, cache, totals: torch.Tensor) -> Allocated:
        n_layers = len(cache.compressible)  # the layers a budget shares (not sliding-window ones)
        exempt = set(self.exempt_among(cache.n_layers, cache.compressible))
        density = torch.stack([cache.layers[i].state.density for i in cache.compressible], dim=-1)  # (B, L)
        seen = cache.layers[0].real_seen  # the prompt and the first generated token: S + 1
        rho = cache.budget.ratio if cache.budget.ratio is not None else cache.budget.tokens / (seen - 1).clamp_min(1)
        rho = torch.as_tensor(rho, dtype=torch.float64, device=seen.device)
        ratios = (n_layers * rho[..., None] * torch.softmax(-density.double(), -1)).clamp(0.01, 1.0)
        scored, recent = self.split
        heavy = ((seen[:, None] * ratios * scored / (scored + recent)).floor()).long()
        recent_part = ((seen[:, None] * ratios * recent / (scored + recent)).floor()).long()
        budgets = torch.full((len(seen), cache.n_layers), UNLIMITED, dtype=torch.long)
        budgets[:, cache.compressible] = (heavy + recent_part).clamp_min(self.min_layer_budget).cpu()
        states = {}
        for position, i in enumerate(cache.compressible):
            states[i] = replace(cache.layers[i].state, recent=recent_part[:, position])
            if i in exempt:
                budgets[:, i] = UNLIMITED
        return Allocated(budgets, states)

    def protected(self, layer, target: torch.Tensor) -> torch.Tensor:
        index = layer.token_index
        recent_from = layer.real_seen - torch.minimum(layer.state.recent, target - self.n_sinks)
        return (index >= 0) & ((index < self.n_sinks) | (index >= recent_from[:, None, None]))
