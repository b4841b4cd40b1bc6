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

from dataclasses import dataclass, field

from d2o.methods.allocation import Allocation, InverseVariance
from d2o.methods.base import Merge, register
from d2o.methods.d2o.merging import SimilarityMerge
from d2o.methods.h2o import H2O


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
