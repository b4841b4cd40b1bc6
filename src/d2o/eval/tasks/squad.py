"""SQuAD v1.1 (dev) made long: the question's passage packed among passages of other articles."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from d2o.errors import D2OError
from d2o.eval.downloads import BIGBENCH, archive_member
from d2o.eval.metrics import qa_scores
from d2o.eval.tasks.base import Sample, Task, asked, chat_prompt, pack_passages, register_task, take

INSTRUCTION = "Answer the question with a short phrase copied from the passages below.\n\n"


def squad_records() -> list[dict]:
    """(title, passage, question, answers) of SQuAD v1.1 dev, read from the bigbench sdist."""
    data = json.loads(archive_member(BIGBENCH, "squad_shifts/squaddev_v1.1.json").read_text(encoding="utf-8"))
    records = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = sorted({a["text"] for a in qa["answers"]})
                records.append({"id": qa["id"], "title": article["title"], "context": paragraph["context"],
                                "question": qa["question"], "answers": answers})
    return records


@register_task
@dataclass
class Squad(Task):
    """Extractive QA over about ``length`` tokens: the gold passage at a random place among
    passages of other articles. Scored by F1 and exact match with SQuAD's normalisation (best
    over the gold answers). ``questions`` > 1: up to that many of each passage's questions, on one
    context (``--protocol context`` compresses it once for them all)."""

    name = "squad"
    summary = "SQuAD v1.1 dev, passages packed to a long context; F1 / exact match"
    metrics = ("f1", "exact_match")

    length: int = 1500
    chat: bool = True  # through the model's chat template when it has one (the default model answers only so)
    questions: int = 1  # questions asked of each passage (> 1: --limit counts passages)

    def __post_init__(self):
        if self.length < 1:  # the context is packed to about this many tokens
            raise D2OError(f"length={self.length} must be at least 1 token")
        if self.questions < 1:
            raise D2OError(f"questions={self.questions} must be at least 1 (questions asked of each passage)")

    def samples(self, tokenizer, limit, seed):
        records = squad_records()
        passages = sorted({(r["title"], r["context"]) for r in records})
        rng = random.Random(seed)
        if self.questions == 1:
            chosen = [[record] for record in take(records, limit or 50, seed)]
        else:  # a passage's questions, in SQuAD's order, share one packed context
            by_passage: dict[str, list[dict]] = {}
            for record in records:
                by_passage.setdefault(record["context"], []).append(record)
            chosen = [group[: self.questions] for group in take(list(by_passage.values()), limit or 10, seed)]
        samples = []
        for group in chosen:
            others = [p for t, p in rng.sample(passages, min(len(passages), 60)) if t != group[0]["title"]]
            context, position = pack_passages(tokenizer, group[0]["context"], others, self.length - 60, rng)
            for turn, record in enumerate(group):
                question = f"\n\nQuestion: {record['question']}\nAnswer:"
                prompt, special_tokens = chat_prompt(tokenizer, f"{INSTRUCTION}{context}{question}") if self.chat \
                    else (f"{INSTRUCTION}{context}{question}", True)
                meta = {"position": position} if self.questions == 1 else {"position": position, "turn": turn}
                samples.append(Sample(f"squad-{record['id']}-{self.length}", prompt, record["answers"],
                                      max_new_tokens=24, stop=("\n",), special_tokens=special_tokens,
                                      question=asked(prompt, question), meta=meta))
        return samples

    def score(self, prediction, sample):
        return qa_scores(prediction, sample.gold)
