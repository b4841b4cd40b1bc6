"""d2o: long-context inference under a KV-cache budget, on Hugging Face transformers."""

from d2o.budget import Budget
from d2o.engine import CacheReport, CompressedCache, install
from d2o.errors import D2OError
from d2o.methods import REGISTRY as METHODS
from d2o.methods import get_method

__all__ = ["METHODS", "Budget", "CacheReport", "CompressedCache", "D2OError", "get_method", "install"]
