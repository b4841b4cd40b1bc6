"""Needle in a haystack: one fact hidden at a grid of depths in haystacks of a grid of lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from d2o.data import check_text_file, essays, read_text_file
from d2o.errors import D2OError
from d2o.eval.metrics import normalize_answer
from d2o.eval.tasks.base import Sample, Task, register_task
from d2o.eval.tasks.passkey import sentence_boundary
from d2o.options import distinct, whole

NEEDLE = "The secret ingredient in Grandma Rosa's famous lemonade is a pinch of smoked sea salt."
QUESTION = "What is the secret ingredient in Grandma Rosa's famous lemonade?"
ANSWER_PREFIX = "The secret ingredient in Grandma Rosa's famous lemonade is"
FACT = "smoked sea salt"


def fact_recall(prediction: str, fact: str) -> float:
    """Share of the fact's words (SQuAD-normalised) that the answer contains."""
    words = normalize_answer(fact).split()
    said = set(normalize_answer(prediction).split())
    return sum(w in said for w in words) / len(words) if words else 0.0


@register_task
@dataclass
class NeedleInAHaystack(Task):
    """Haystack: the Paul Graham essays (or ``haystack``, a text file). The prompt ends with the
    question and the start of its answer (``answer_prefix``), a raw completion; the score is the
    share of ``fact``'s words in the answer (1.0: the needle's fact is there). ``--limit`` is the
    number of haystacks per cell of the length x depth grid (1 by default)."""

    name = "niah"
    summary = "needle in a haystack over lengths x depths; score = the needle's fact in the answer"
    metrics = ("recall",)

    lengths: tuple[int, ...] = (500, 1000, 2000)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    haystack: str | None = None
    needle: str = NEEDLE
    question: str = QUESTION
    answer_prefix: str = ANSWER_PREFIX
    fact: str = FACT

    def __post_init__(self):
        # A value given twice would make two samples of one id, both run and both counted.
        self.lengths = distinct(tuple(self.lengths), "niah's lengths")
        self.depths = distinct(tuple(self.depths), "niah's depths")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise D2OError(f"depths must be between 0 and 1, got {self.depths}")
        if not normalize_answer(self.fact):
            raise D2OError("the needle's fact is empty")
        missing = set(normalize_answer(self.fact).split()) - set(normalize_answer(self.needle).split())
        if missing:  # the score is the share of the fact's words in the answer: these could never be found
            raise D2OError(f"the fact {self.fact!r} is not in the needle {self.needle!r} "
                           f"(missing: {', '.join(sorted(missing))})")
        if any(not whole(n) or n < 1 for n in self.lengths):
            raise D2OError(f"lengths must be whole numbers of tokens >= 1, got {self.lengths}")
        if self.haystack:
            check_text_file(self.haystack)

    def samples(self, tokenizer, limit, seed):
        text = read_text_file(self.haystack) if self.haystack else essays()
        ids = tokenizer(text, add_special_tokens=False).input_ids
        tail = f"\n\nQuestion: {self.question}\nAnswer: {self.answer_prefix}"
        overhead = len(tokenizer(self.needle + tail, add_special_tokens=False).input_ids) + 2
        rng = random.Random(seed)
        samples = []
        for repeat in range(limit or 1):
            for length in self.lengths:
                room = length - overhead
                if room < 16 or room > len(ids):
                    raise D2OError(f"haystack length {length} is out of range: the haystack text has {len(ids)} "
                                   f"tokens and the needle and question take {overhead}")
                start = rng.randint(0, len(ids) - room)
                hay = tokenizer.decode(ids[start : start + room])
                for depth in self.depths:
                    cut = sentence_boundary(hay, int(depth * len(hay))) if depth < 1.0 else len(hay)
                    prompt = hay[:cut].rstrip() + " " + self.needle + " " + hay[cut:].lstrip() + tail
                    samples.append(Sample(f"niah-{length}-{depth:g}-{seed}-{repeat}", prompt, self.fact,
                                          max_new_tokens=16, stop=("\n",), question=tail,
                                          meta={"length": length, "depth": depth}))
        return samples

    def score(self, prediction, sample):
        return {"recall": fact_recall(prediction, sample.gold)}
