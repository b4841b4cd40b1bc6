"""CoQA (test): a conversation about one story, the story packed among other stories."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from d2o.errors import D2OError
from d2o.eval.downloads import BIGBENCH, archive_member
from d2o.eval.metrics import coqa_scores
from d2o.eval.tasks.base import Sample, Task, asked, chat_prompt, pack_passages, register_task, take

INSTRUCTION = "Read the stories below, then answer the questions about them briefly.\n\n"


@register_task
@dataclass
class Coqa(Task):
    """For each story, one turn of its conversation, asked after the earlier turns (questions
    with their gold answers); the story sits among other stories to about ``length`` tokens.
    Scored by CoQA's F1 and exact match against the turn's answer and its additional answers.
    ``turns`` > 1: the story's first turns in order, each after the conversation so far (up to
    ``history`` turns), on one context (``--protocol context`` compresses it once for them all)."""

    name = "coqa"
    summary = "CoQA conversational QA, stories packed to a long context; F1 / exact match"
    metrics = ("f1", "exact_match")

    length: int = 1500
    chat: bool = True  # through the model's chat template when it has one (the default model answers only so)
    history: int = 3  # earlier turns shown
    turns: int = 1  # > 1: a story's first turns in order, each a sample on one context (--limit counts stories)

    def __post_init__(self):
        if self.length < 1:  # the context is packed to about this many tokens
            raise D2OError(f"length={self.length} must be at least 1 token")
        if self.history < 0:
            raise D2OError(f"history={self.history} must be >= 0 (the earlier turns shown)")
        if self.turns < 1:
            raise D2OError(f"turns={self.turns} must be at least 1 (turns asked of each story)")

    def samples(self, tokenizer, limit, seed):
        path = archive_member(BIGBENCH, "coqa_conversational_question_answering/coqa.test.json")
        stories = json.loads(path.read_text(encoding="utf-8"))["data"]
        rng = random.Random(seed)
        samples = []
        for story in take(stories, limit or (50 if self.turns == 1 else 10), seed):
            questions, answers = story["questions"], story["answers"]
            n_turns = min(len(questions), len(answers))
            asked_turns = [rng.randrange(n_turns)] if self.turns == 1 else range(min(self.turns, n_turns))
            others = [s["story"] for s in rng.sample(stories, 40) if s["id"] != story["id"]]
            context, position = pack_passages(tokenizer, story["story"], others, self.length - 120, rng)
            for turn in asked_turns:
                # every annotator's answer, repeats too (CoQA's scorer counts them)
                golds = [answers[turn]["input_text"]]
                for extra in story.get("additional_answers", {}).values():
                    if turn < len(extra):
                        golds.append(extra[turn]["input_text"])
                dialogue = "".join(f"Q: {questions[t]['input_text']}\nA: {answers[t]['input_text']}\n"
                                   for t in range(max(0, turn - self.history), turn))
                question = f"\n\n{dialogue}Q: {questions[turn]['input_text']}\nA:"
                prompt, special_tokens = chat_prompt(tokenizer, f"{INSTRUCTION}{context}{question}") if self.chat \
                    else (f"{INSTRUCTION}{context}{question}", True)
                samples.append(Sample(f"coqa-{story['id']}-{turn}-{self.length}", prompt, golds,
                                      max_new_tokens=24, stop=("\n",), special_tokens=special_tokens,
                                      question=asked(prompt, question), meta={"turn": turn, "position": position}))
        return samples

    def score(self, prediction, sample):
        return coqa_scores(prediction, sample.gold)
