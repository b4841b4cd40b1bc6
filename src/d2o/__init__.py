"""d2o: long-context inference under a KV-cache budget, on Hugging Face transformers."""

from d2o.budget import Budget
from d2o.engine import CacheReport, CompressedCache, install
from d2o.errors import D2OError
from d2o.generation import generate
from d2o.methods import REGISTRY as METHODS
from d2o.methods import get_method
from d2o.models import load_model

__all__ = [
    "METHODS",
    "Budget",
    "CacheReport",
    "CompressedCache",
    "D2OError",
    "generate",
    "get_method",
    "install",
    "load_model",
]
