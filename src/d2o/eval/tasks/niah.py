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
# (needle, question, answer prefix, fact): the needles a haystack hides under ``needles`` > 1.
NEEDLES = (
    (NEEDLE, QUESTION, ANSWER_PREFIX, FACT),
    ("The password to the old lighthouse on Marrow Island is silver heron.",
     "What is the password to the old lighthouse on Marrow Island?",
     "The password to the old lighthouse on Marrow Island is", "silver heron"),
    ("Professor Alvarez keeps her spare keys inside an old violin case.",
     "Where does Professor Alvarez keep her spare keys?", "Professor Alvarez keeps her spare keys",
     "inside an old violin case"),
    ("The best time to visit the Kettle Valley orchards is the second week of October.",
     "When is the best time to visit the Kettle Valley orchards?",
     "The best time to visit the Kettle Valley orchards is", "the second week of October"),
    ("The name of Captain Okafor's ship is the Amber Tide.", "What is the name of Captain Okafor's ship?",
     "The name of Captain Okafor's ship is", "the Amber Tide"),
    ("The winning number in the Harbor Street raffle was 4719.",
     "What was the winning number in the Harbor Street raffle?",
     "The winning number in the Harbor Street raffle was", "4719"),
    ("The treasure of Fenwick Castle is buried beneath the third oak tree.",
     "Where is the treasure of Fenwick Castle buried?", "The treasure of Fenwick Castle is buried",
     "beneath the third oak tree"),
    ("Doctor Lindqvist's favourite instrument is the bass clarinet.",
     "What is Doctor Lindqvist's favourite instrument?", "Doctor Lindqvist's favourite instrument is",
     "the bass clarinet"),
)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def depth_cut(hay: str, depth: float) -> int:
    """Where a needle at ``depth`` (0: the start, 1: the end) goes in ``hay``: a sentence's end."""
    return sentence_boundary(hay, int(depth * len(hay))) if depth < 1.0 else len(hay)


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
    number of haystacks per cell of the length x depth grid (1 by default).

    ``needles`` > 1: each haystack hides that many different needles (built in), spread evenly
    from its start to its end, and each is asked in a sample of its own: the samples of a haystack
    share one context (``--protocol context`` compresses it once, then asks the needles one by
    one); ``--limit`` is then the number of haystacks per length."""

    name = "niah"
    summary = "needle in a haystack over lengths x depths; score = the needle's fact in the answer"
    metrics = ("recall",)

    lengths: tuple[int, ...] = (500, 1000, 2000)
    depths: tuple[float, ...] = DEPTHS
    haystack: str | None = None
    needle: str = NEEDLE
    question: str = QUESTION
    answer_prefix: str = ANSWER_PREFIX
    fact: str = FACT
    needles: int = 1

    def __post_init__(self):
        if not whole(self.needles) or not 1 <= self.needles <= len(NEEDLES):
            raise D2OError(f"needles={self.needles!r} must be a whole number from 1 to {len(NEEDLES)}")
        if self.needles > 1:
            custom = [name for name, default in (("needle", NEEDLE), ("question", QUESTION),
                                                 ("answer_prefix", ANSWER_PREFIX), ("fact", FACT), ("depths", DEPTHS))
                      if getattr(self, name) != default]
            if custom:
                raise D2OError(f"needles={self.needles} hides built-in needles spread evenly over the haystack: "
                               f"{', '.join(custom)} cannot be set with it")
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
        if self.needles > 1:
            return self._many_needles(tokenizer, limit, seed)
        tail = f"\n\nQuestion: {self.question}\nAnswer: {self.answer_prefix}"
        overhead = len(tokenizer(self.needle + tail, add_special_tokens=False).input_ids) + 2
        samples = []
        for repeat, length, hay in self._haystacks(tokenizer, limit, seed, overhead, "the needle and question"):
            for depth in self.depths:
                cut = depth_cut(hay, depth)
                prompt = hay[:cut].rstrip() + " " + self.needle + " " + hay[cut:].lstrip() + tail
                samples.append(Sample(f"niah-{length}-{depth:g}-{seed}-{repeat}", prompt, self.fact,
                                      max_new_tokens=16, stop=("\n",), question=tail,
                                      meta={"length": length, "depth": depth}))
        return samples

    def _many_needles(self, tokenizer, limit, seed) -> list[Sample]:
        """Per haystack, ``needles`` needles at depths 0 .. 1 and a sample asking each."""
        needles = NEEDLES[: self.needles]
        tails = [f"\n\nQuestion: {question}\nAnswer: {prefix}" for _, question, prefix, _ in needles]
        overhead = len(tokenizer(" ".join(n[0] for n in needles) + max(tails, key=len),
                                 add_special_tokens=False).input_ids) + 2 * len(needles)
        depths = [i / (len(needles) - 1) for i in range(len(needles))]
        samples = []
        for repeat, length, hay in self._haystacks(tokenizer, limit, seed, overhead,
                                                   f"{len(needles)} needles and their question"):
            pieces, previous = [], 0
            for cut, (needle, *_) in zip((depth_cut(hay, depth) for depth in depths), needles):
                pieces += [hay[previous:cut].strip(), needle]
                previous = cut
            context = " ".join(piece for piece in [*pieces, hay[previous:].strip()] if piece)
            for index, ((_, _, _, fact), tail, depth) in enumerate(zip(needles, tails, depths)):
                samples.append(Sample(f"niah{len(needles)}-{length}-{index}-{seed}-{repeat}", context + tail, fact,
                                      max_new_tokens=16, stop=("\n",), question=tail,
                                      meta={"length": length, "depth": depth, "needle": index}))
        return samples

    def _haystacks(self, tokenizer, limit, seed, overhead: int, what: str):
        """(repeat, length, text): for each of ``limit`` repeats and each length, a seeded stretch of
        the haystack leaving ``overhead`` tokens of each length to ``what`` is put in it."""
        text = read_text_file(self.haystack) if self.haystack else essays()
        ids = tokenizer(text, add_special_tokens=False).input_ids
        rng = random.Random(seed)
        for repeat in range(limit or 1):
            for length in self.lengths:
                room = length - overhead
                if room < 16 or room > len(ids):
                    raise D2OError(f"haystack length {length} is out of range: the haystack text has {len(ids)} "
                                   f"tokens and {what} take {overhead}")
                start = rng.randint(0, len(ids) - room)
                yield repeat, length, tokenizer.decode(ids[start : start + room])

    def score(self, prediction, sample):
        return {"recall": fact_recall(prediction, sample.gold)}
