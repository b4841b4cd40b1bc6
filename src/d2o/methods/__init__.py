"""Compression methods, each a small policy on the engine, registered by name."""

# Importing a method's module registers it; the order is the order of `d2o methods`.
from d2o.methods import full, local, streamingllm, h2o, tova, snapkv, pyramidkv, cam, roco, sirllm  # noqa: F401, I001
from d2o.methods import kvzip, expected_attention  # noqa: F401, I001
from d2o.methods.d2o import D2O, SimilarityMerge
from d2o.methods import ablations  # noqa: F401  (after the methods it ablates)
from d2o.methods.allocation import ExponentialDecay, InverseVariance, Pyramid, Uniform
from d2o.methods.base import REGISTRY, Method, get_method
from d2o.methods.full import Full
from d2o.methods.h2o import H2O

__all__ = [
    "D2O",
    "REGISTRY",
    "ExponentialDecay",
    "Full",
    "H2O",
    "InverseVariance",
    "Method",
    "Pyramid",
    "SimilarityMerge",
    "Uniform",
    "get_method",
]
