"""Passkey retrieval (Mohtashami & Jaggi 2023): a random key hidden in real filler text.

The prompt is a raw completion ending in "The pass key is" (the 135M default model answers it
reliably that way, not through its chat template); the score is exact match of the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from d2o.data import check_text_file, essays, read_text_file
from d2o.errors import D2OError
from d2o.eval.tasks.base import Sample, Task, register_task

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# Measured on the 135M default model with full cache at 1.5K tokens (8 prompts): this ending 7/8,
# "What is the pass key? The pass key is" 3/4 on the same setup with a lower rate at other seeds.
QUESTION = "\n\nThe pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    key: str
    depth: float  # where the needle sits in the filler, 0 = start, 1 = end
    n_tokens: int


def make_passkey_prompt(tokenizer, filler: str, n_tokens: int, rng: random.Random, depth: float | None = None,
                        key: str | None = None) -> PasskeyPrompt:
    """A prompt of about ``n_tokens`` tokens: the needle at ``depth`` (random if None) in a random
    stretch of ``filler``, with a random 5-digit key unless ``key`` is given."""
    key = key or str(rng.randint(10000, 99999))
    depth = rng.random() if depth is None else depth
    needle = NEEDLE.format(key=key)
    overhead = len(tokenizer(INTRO + needle + QUESTION, add_special_tokens=False).input_ids) + 2
    budget = n_tokens - overhead
    if budget < 16:
        raise D2OError(f"a passkey prompt needs more than {overhead + 16} tokens, got {n_tokens}")
    filler_ids = tokenizer(filler, add_special_tokens=False).input_ids
    if len(filler_ids) < budget:
        raise D2OError(f"the filler text has {len(filler_ids)} tokens, fewer than the {budget} needed")
    start = rng.randint(0, len(filler_ids) - budget)
    text = tokenizer.decode(filler_ids[start : start + budget])
    cut = sentence_boundary(text, int(depth * len(text)))
    prompt = INTRO + text[:cut].rstrip() + " " + needle + " " + text[cut:].lstrip() + QUESTION
    return PasskeyPrompt(prompt, key, depth, len(tokenizer(prompt).input_ids))


def sentence_boundary(text: str, position: int) -> int:
    """The end of the sentence at or after ``position`` (so a needle never splits a sentence)."""
    match = re.compile(r"[.!?]\s").search(text, position)
    return match.end() if match else len(text)


def passkey_score(prediction: str, key: str) -> float:
    """1.0 when the first number of the answer is the key."""
    numbers = re.findall(r"\d+", prediction)
    return float(bool(numbers) and numbers[0] == key)


@register_task
@dataclass
class Passkey(Task):
    """``length`` tokens of filler (the essays, or ``haystack``: a text file) with a random
    5-digit key at a random depth; 10 prompts unless ``--limit`` says otherwise."""

    name = "passkey"
    summary = "passkey retrieval: exact match of a random key hidden in real text"
    metrics = ("accuracy",)

    length: int = 1500
    haystack: str | None = None

    def __post_init__(self):
        if self.haystack:
            check_text_file(self.haystack)

    def samples(self, tokenizer, limit, seed):
        filler = read_text_file(self.haystack) if self.haystack else essays()
        rng = random.Random(seed)
        prompts = [make_passkey_prompt(tokenizer, filler, self.length, rng) for _ in range(limit or 10)]
        return [
            Sample(f"passkey-{self.length}-{seed}-{i}", p.text, p.key, max_new_tokens=8, question=QUESTION,
                   meta={"depth": round(p.depth, 3), "tokens": p.n_tokens})
            for i, p in enumerate(prompts)
        ]

    def score(self, prediction, sample):
        return {"accuracy": passkey_score(prediction, sample.gold)}
