"""Local window: the most recent tokens only (the simplest baseline of the D2O paper)."""

from __future__ import annotations

from dataclasses import dataclass

from d2o.methods.base import Method, recency, register


@register
@dataclass
class LocalWindow(Method):
    """Keeps the last B tokens of every layer; evicts the oldest at every step. No statistics."""

    name = "local"
    summary = "local window: the most recent tokens"

    def score(self, layer):
        return recency(layer)
