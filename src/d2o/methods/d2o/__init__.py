"""D2O and its ablations."""

from d2o.methods.d2o.merging import SimilarityMerge
from d2o.methods.d2o.method import D2O

__all__ = ["D2O", "SimilarityMerge"]
