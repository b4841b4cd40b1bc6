"""Full cache: no compression, the reference every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.budget import UNLIMITED
from d2o.engine.api import Allocated
from d2o.methods.base import Method, register


@register
@dataclass
class Full(Method):
    """Keeps every token (the budget is ignored); reports the same statistics as the others."""

    name = "full"
    summary = "no compression: every token is kept (the reference)"
    keeps_everything = True

    def allocate(self, cache, totals: torch.Tensor) -> Allocated:
        return Allocated(torch.full((len(totals), cache.n_layers), UNLIMITED, dtype=torch.long))
