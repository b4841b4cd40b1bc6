"""D2O, the released code's D2O, and the library's own: ``d2o-plus``, ``d2o-plus-words``, ``d2o-novelty``."""

from d2o.methods.d2o.merging import SimilarityMerge
from d2o.methods.d2o.method import D2O, D2OOfficial
from d2o.methods.d2o.plus import D2OPlus, D2OPlusWords, attention_weighted_merge
from d2o.methods.d2o.novelty import D2ONovelty

__all__ = ["D2O", "D2ONovelty", "D2OOfficial", "D2OPlus", "D2OPlusWords", "SimilarityMerge",
           "attention_weighted_merge"]
