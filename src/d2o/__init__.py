"""d2o: long-context inference under a KV-cache budget, on Hugging Face transformers.

The names below load lazily, so that ``d2o`` (and its command line) can check its input before
importing torch and transformers.
"""

from importlib import import_module

from d2o.budget import Budget
from d2o.errors import D2OError

_LAZY = {
    "CacheReport": "d2o.engine.report",
    "CompressedCache": "d2o.engine.cache",
    "KVQuantization": "d2o.engine.quantization",
    "install": "d2o.engine.attention",
    "uninstall": "d2o.engine.attention",
    "METHODS": "d2o.methods",
    "get_method": "d2o.methods",
    "generate": "d2o.runtime.generation",
    "compress": "d2o.runtime.context",
    "load_context": "d2o.runtime.context",
    "load_model": "d2o.models",
}

__all__ = ["Budget", "D2OError", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'd2o' has no attribute {name!r}")
    module = import_module(_LAZY[name])
    return getattr(module, "REGISTRY" if name == "METHODS" else name)
