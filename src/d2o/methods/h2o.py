"""H2O: heavy hitters plus a recent window (Zhang et al., NeurIPS 2023, arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from d2o.engine.api import AttentionStats, Observed, StatsRequest, TokenValues
from d2o.errors import D2OError
from d2o.methods.base import HeavyRecent, check, register
from d2o.methods.scoring import VOTES, AccumulatedAttention, Scoring


@register
@dataclass
class H2O(HeavyRecent):
    """Heavy-Hitter Oracle. A token's score is the attention it has received so far (column
    mass of the prefill, then every decode query's attention), summed over the query heads of its
    KV head, in float32. Each layer keeps its ``heavy:recent`` split of the budget (1:1 in the
    paper): the newest tokens, and the highest-scoring others; from then on every decode step
    appends one token and evicts one. Same budget in every layer; no sinks in the original.
    ``scoring`` is the part that scores (``AccumulatedAttention``; swappable, see ``scoring``).
    """

    name = "h2o"
    summary = "heavy hitters (accumulated attention) + recent window, 1:1, evicting at every step"

    scoring: Scoring = field(default_factory=AccumulatedAttention)

    @property
    def needs_surprisal(self) -> bool:
        return self.scoring.needs_surprisal

    @property
    def question_tokens(self) -> int:
        return getattr(self.scoring, "window", 0)  # the latest queries whose votes it scores with

    def check_parts(self) -> None:
        super().check_parts()
        check(all(callable(getattr(self.scoring, name, None)) for name in ("stats_request", "observe", "score")),
              "scoring", self.scoring, "must be a scoring: accumulated or blended")
        missing = [name for name in getattr(self.merge, "reads", ()) if name not in self.scoring.keeps]
        if VOTES in missing:
            raise D2OError(f"{self.name}: its merge weighs tokens by the votes of the latest queries, which "
                           f"scoring.window={getattr(self.scoring, 'window', 0)!r} does not keep: use a window "
                           f"of at least 1, or merge.attention=mass")
        if missing:
            raise D2OError(f"{self.name}: its merge reads {', '.join(missing)}, which its scoring does not keep")

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return self.scoring.stats_request(layer, n_query)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        return self.scoring.observe(layer, stats)

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues | None:
        return self.scoring.observe_tokens(cache, surprisal, input_ids)

    def once_allocated(self, layer) -> Observed | None:
        return self.scoring.once_allocated(layer)

    def score(self, layer) -> torch.Tensor:
        return self.scoring.score(layer)

    def slot_state_bytes(self, group: int) -> int:
        return super().slot_state_bytes(group) + self.scoring.slot_state_bytes(group)

    def allocated_state_bytes(self, group: int) -> int:
        return super().slot_state_bytes(group) + self.scoring.slot_state_bytes(group, allocated=True)
