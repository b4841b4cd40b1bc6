"""Compression methods, each a small policy on the engine, registered by name."""

from d2o.methods import full, h2o  # noqa: F401  (registration)
from d2o.methods.allocation import ExponentialDecay, InverseVariance, Pyramid, Uniform
from d2o.methods.base import REGISTRY, Method, get_method
from d2o.methods.d2o import D2O, SimilarityMerge
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
