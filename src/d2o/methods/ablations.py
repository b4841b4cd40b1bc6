"""Ablations: a method with one part removed or swapped, to explain what each part does (listed by
``d2o methods --all``, measured in docs/results). Each is data: the method it ablates, what it
changes, and the options it builds that method with."""

from d2o.methods.allocation import ExponentialDecay, Pyramid, Uniform
from d2o.methods.base import register_ablation
from d2o.methods.d2o import SimilarityMerge, attention_weighted_merge
from d2o.methods.scoring import BlendedScores

ABLATIONS = [
    ("d2o-uniform", "d2o", "D2O ablation: the same budget in every layer (no layer-level allocation)",
     {"allocation": Uniform()}),
    ("d2o-nomerge", "d2o", "D2O ablation: evicted tokens are dropped, not merged", {"merge": None}),
    ("d2o-valuesim", "d2o", "D2O ablation: merge by similarity of values instead of keys",
     {"merge": SimilarityMerge(on="value")}),
    ("d2o-expdecay", "d2o", "D2O ablation: layer budgets decaying exponentially with depth",
     {"allocation": ExponentialDecay()}),
    ("d2o-pyramid", "d2o", "D2O ablation: layer budgets falling linearly with depth (PyramidKV's)",
     {"allocation": Pyramid()}),
    ("d2o-plus-nomerge", "d2o-plus", "d2o-plus ablation: evicted tokens dropped, not merged", {"merge": None}),
    ("d2o-plus-papermerge", "d2o-plus", "d2o-plus ablation: D2O's own merging (the paper's)",
     {"merge": SimilarityMerge()}),
    ("d2o-plus-countmerge", "d2o-plus",
     "d2o-plus ablation: values blended by token count, one per kept slot, not by attention",
     {"merge": SimilarityMerge(values_only=True, mass=True, weighting="count", max_merges=1, skip_first=4,
                               skip_newest=1)}),
    ("d2o-plus-nearmerge", "d2o-plus",
     "d2o-plus ablation: evicted tokens may merge into their neighbours (no min_distance)",
     {"merge": attention_weighted_merge(min_distance=0)}),
    ("d2o-plus-blend", "d2o-plus",
     "d2o-plus ablation: evicted values blended into the slot too, by the attention each received",
     {"merge": attention_weighted_merge(blend=True)}),
    ("d2o-plus-blend-nomass", "d2o-plus",
     "d2o-plus-blend without the mass correction: a merged slot is attended as one token",
     {"merge": attention_weighted_merge(blend=True, mass=False)}),
    ("d2o-plus-blend-nearmerge", "d2o-plus", "d2o-plus-blend with merges into neighbours (no min_distance)",
     {"merge": attention_weighted_merge(blend=True, min_distance=0)}),
    ("d2o-plus-nowindow", "d2o-plus",
     "d2o-plus without the last queries' votes: for a context compressed before its question",
     {"scoring": BlendedScores(window=0), "merge": attention_weighted_merge("mass")}),
    ("d2o-plus-nosurprisal", "d2o-plus", "d2o-plus ablation: no surprisal share",
     {"scoring": BlendedScores(surprisal=0.0)}),
    ("d2o-plus-uniform", "d2o-plus", "d2o-plus ablation: the same budget in every layer", {"allocation": Uniform()}),
    ("d2o-plus-recent", "d2o-plus",
     "d2o-plus ablation: H2O's 1:1 split, half of each layer's budget to the newest tokens", {"split": (1, 1)}),
    ("d2o-plus-sumvotes", "d2o-plus",
     "d2o-plus ablation: votes summed over the latest queries (SnapKV's rule), not their max",
     {"scoring": BlendedScores(votes="sum")}),
    ("d2o-plus-noreach", "d2o-plus",
     "d2o-plus ablation: votes and surprisal spread 3 tokens each way (SnapKV's kernel 7)",
     {"scoring": BlendedScores(span=(3, 3), surprisal_span=(3, 3))}),
    ("d2o-novelty-uniform", "d2o-novelty", "d2o-novelty ablation: the same budget in every layer",
     {"allocation": Uniform()}),
    ("d2o-novelty-nomerge", "d2o-novelty", "d2o-novelty ablation: evicted tokens dropped, not merged",
     {"merge": None}),
]

for name, base, summary, options in ABLATIONS:
    register_ablation(name, base, summary, options)
