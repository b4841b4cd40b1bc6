"""D2O, its ablations, and the library's own D2O (``d2o-plus``) with its ablations."""

from d2o.methods.allocation import Uniform
from d2o.methods.d2o.merging import SimilarityMerge
from d2o.methods.d2o.method import D2O, variant
from d2o.methods.d2o.plus import D2OPlus, D2OPlusWords, attention_weighted_merge
from d2o.methods.d2o.novelty import D2ONovelty
from d2o.methods.scoring import BlendedScores

variant("d2o-plus-nomerge", "d2o-plus ablation: evicted tokens dropped, not merged", D2OPlus, merge=lambda: None)
variant("d2o-plus-papermerge", "d2o-plus ablation: D2O's own merging (the paper's)", D2OPlus, merge=SimilarityMerge)
variant("d2o-plus-countmerge", "d2o-plus ablation: values blended by token count, one per kept slot, not by attention",
        D2OPlus, merge=lambda: SimilarityMerge(values_only=True, mass=True, weighting="count", max_merges=1,
                                               skip_first=4, skip_newest=1))
variant("d2o-plus-nearmerge", "d2o-plus ablation: evicted tokens may merge into their neighbours (no min_distance)",
        D2OPlus, merge=lambda: attention_weighted_merge(min_distance=0))
variant("d2o-plus-blend", "d2o-plus ablation: evicted values blended into the slot too, by the attention each received",
        D2OPlus, merge=lambda: attention_weighted_merge(blend=True))
variant("d2o-plus-blend-nomass", "d2o-plus-blend without the mass correction: a merged slot is attended as one token",
        D2OPlus, merge=lambda: attention_weighted_merge(blend=True, mass=False))
variant("d2o-plus-blend-nearmerge", "d2o-plus-blend with merges into neighbours (no min_distance)",
        D2OPlus, merge=lambda: attention_weighted_merge(blend=True, min_distance=0))
variant("d2o-plus-nowindow", "d2o-plus without the last queries' votes: for a context compressed before its question",
        D2OPlus, scoring=lambda: BlendedScores(window=0), merge=lambda: attention_weighted_merge("mass"))
variant("d2o-plus-nosurprisal", "d2o-plus ablation: no surprisal share", D2OPlus,
        scoring=lambda: BlendedScores(surprisal=0.0))
variant("d2o-plus-uniform", "d2o-plus ablation: the same budget in every layer", D2OPlus, allocation=Uniform)
variant("d2o-plus-recent", "d2o-plus ablation: H2O's 1:1 split, half of each layer's budget to the newest tokens",
        D2OPlus, split=lambda: (1, 1))
variant("d2o-plus-sumvotes", "d2o-plus ablation: votes summed over the latest queries (SnapKV's rule), not their max",
        D2OPlus, scoring=lambda: BlendedScores(votes="sum"))
variant("d2o-plus-noreach", "d2o-plus ablation: votes and surprisal spread 3 tokens each way (SnapKV's kernel 7)",
        D2OPlus, scoring=lambda: BlendedScores(span=(3, 3), surprisal_span=(3, 3)))

variant("d2o-novelty-uniform", "d2o-novelty ablation: the same budget in every layer", D2ONovelty, allocation=Uniform)
variant("d2o-novelty-nomerge", "d2o-novelty ablation: evicted tokens dropped, not merged", D2ONovelty,
        merge=lambda: None)

__all__ = ["D2O", "D2ONovelty", "D2OPlus", "D2OPlusWords", "SimilarityMerge"]
