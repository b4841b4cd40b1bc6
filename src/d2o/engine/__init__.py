"""The engine: compressed KV storage, the attention hook, exact chunked statistics. It names no method."""

from d2o.engine.attention import SUPPORTED_FAMILIES, install
from d2o.engine.cache import CacheReport, CompressedCache, CompressedLayer, LayerReport
from d2o.engine.stats import AttentionStats, StatsRequest

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttentionStats",
    "CacheReport",
    "CompressedCache",
    "CompressedLayer",
    "LayerReport",
    "StatsRequest",
    "install",
]
