"""d2o-novelty: the library's D2O for a context compressed before its questions are asked."""

from __future__ import annotations

from dataclasses import dataclass, field

from d2o.engine.api import Merge
from d2o.methods.base import register
from d2o.methods.d2o.method import D2O
from d2o.methods.d2o.plus import attention_weighted_merge
from d2o.methods.scoring import BlendedScores, Scoring

NOVELTY_WEIGHT = 10.0


def novelty_scores(**options) -> BlendedScores:
    return BlendedScores(window=0, novelty=NOVELTY_WEIGHT, **{"sum_heads": True, **options})


@register
@dataclass
class D2ONovelty(D2O):
    """D2O's layer level (inverse-variance budgets), its 3:1 split, 4 sinks and eviction at every
    step, with scores that need no question: a document, a chat's earlier turns or a cached prefix
    is compressed before anyone asks, so the attention of the prompt's last queries (the votes of
    ``d2o-plus``) points at the context's own end, not at what a question will need. Instead:

    - ``scoring``: ``BlendedScores`` without votes: D2O's accumulated attention, plus twice each
      token's surprisal (reaching 16 tokens on, as in ``d2o-plus``), plus ten times the novelty of
      its sentence, the mean surprisal of the sentence it belongs to (each share normalised to the
      same total first: the novelty decides most of what is kept, attention and surprisal order
      the tokens of sentences alike). What a later question asks about is a fact, a sentence the
      model could not predict as a whole; kept by its sentence's novelty, it stays whole. A token's
      own surprisal is high for rare words everywhere and moderate for a passkey's digits (about
      2.3 nats each), so alone it keeps the digits only at large budgets;
    - ``merge``: ``d2o-plus``'s mass-moving merge, each evicted token's attention measured by the
      accumulated attention it received (``attention="mass"``: the votes it would weigh by are not
      kept here).

    Once the budgets are allocated its attention mass is kept summed over each KV head's query
    heads (``sum_heads``): a context is asked many questions, and each row holds this bookkeeping
    of every slot it reads.

    The novelty's weight (10, against 1 and 3) was chosen on development seeds 1 and 5 of the
    passkey and NIAH tasks, both protocols, and the perplexity of a later part of the essays
    (10 kept the most at 10% with the question fed later, 0.88 / 0.93 pooled, against 0.78 / 0.87
    at 3; perplexity at 10% 22.51 against 22.30); the sentence's 64-token limit was not tuned.
    """

    name = "d2o-novelty"
    summary = "d2o for a context compressed before its question: scores by attention, surprisal and sentence novelty"

    scoring: Scoring = field(default_factory=novelty_scores)
    merge: Merge | None = field(default_factory=lambda: attention_weighted_merge("mass"))
