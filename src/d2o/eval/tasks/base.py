"""What a task is: samples (prompt, gold answer) and a scorer; plus the task registry."""

from __future__ import annotations

import os
import random
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from d2o.errors import D2OError
from d2o.options import parse_value
from d2o.runtime.prompts import chat_text


@dataclass
class Sample:
    """One prompt to answer. ``stop``: generation ends before the first of these strings.
    ``question``: the end of ``prompt`` that asks (under ``--protocol context`` it is fed only
    after the rest was compressed); empty when the task has none."""

    id: str
    prompt: str
    gold: Any
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    special_tokens: bool = True  # False when the prompt is already wrapped in a chat template
    question: str = ""
    meta: dict = field(default_factory=dict)


@dataclass
class Task:
    """Base of generation tasks. ``metrics`` names the scores ``score`` returns, main one first."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    metrics: ClassVar[tuple[str, ...]] = ("score",)
    higher_is_better: ClassVar[bool] = True
    asks: ClassVar[bool] = True  # its samples end in a question (that --protocol context can keep out)
    # The option that picks sub-tasks each drawing its samples alone (their ids name it), if any: runs
    # of different picks hold the same samples of the sub-tasks both ran (``d2o compare`` pairs them).
    subtasks_option: ClassVar[str | None] = None

    def samples(self, tokenizer, limit: int | None, seed: int) -> list[Sample]:
        raise NotImplementedError

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        raise NotImplementedError

    def answer(self, text: str) -> str:
        """The prediction made of the generated text, as kept and scored: without surrounding blanks."""
        return text.strip()

    def encode(self, sample: Sample, tokenizer, protocol: str = "prompt") -> tuple[list[int], list[int]]:
        """The token ids to prefill and those fed after compression. ``prompt``: the whole prompt is
        compressed (nothing after); ``context``: the question is kept out of compression."""
        self.check_protocol(protocol)
        if protocol == "prompt":
            return tokenizer(sample.prompt, add_special_tokens=sample.special_tokens).input_ids, []
        if not sample.question:
            raise D2OError(f"task {self.name!r}: sample {sample.id} has no question to keep out of compression: "
                           f"--protocol context does not apply")
        context = sample.prompt[: len(sample.prompt) - len(sample.question)]
        if not context.strip():
            raise D2OError(f"task {self.name!r}: sample {sample.id} has no context before its question to compress: "
                           f"--protocol context does not apply")
        return (tokenizer(context, add_special_tokens=sample.special_tokens).input_ids,
                tokenizer(sample.question, add_special_tokens=False).input_ids)

    def check_protocol(self, protocol: str) -> None:
        """A protocol this task can run: ``context`` needs samples that end in a question."""
        if protocol not in PROTOCOLS:
            raise D2OError(f"protocol {protocol!r} must be one of {', '.join(PROTOCOLS)}")
        if protocol == "context" and not self.asks:
            raise D2OError(f"{self.name} has no question to keep out of compression: --protocol context does not apply")

    def run(self, runner, samples: list[Sample], ids: list[int], questions: list[list[int]], todos: list[list]):
        """Every run of each sample's ``todos``, yielding (sample, outcome) as each is done (so a
        sweep keeps it at once): answered greedily, one prefill shared by the runs. ``samples``
        share ``ids``, the tokens compressed: one sample, or under ``--protocol context`` those
        whose questions follow one context (each sample's own in ``questions``)."""
        return runner.answer(self, samples, ids, questions, todos)

    def settings(self) -> dict:
        """The options that define the samples (recorded, and checked when a run resumes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def get_task(name: str, **options) -> Task:
    if name not in TASKS:
        raise D2OError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    cls = TASKS[name]
    known = {f.name for f in fields(cls)}
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - known)
    if unknown:
        options = ", ".join(sorted(known)) or "none"
        raise D2OError(f"task {name!r} takes no option {', '.join(unknown)}; its options: {options}")
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)
                if f.default is not MISSING or f.default_factory is not MISSING}
    typed = {key: _typed(name, key, value, defaults.get(key)) for key, value in given.items()}
    return cls(**{key: value for key, value in typed.items() if value is not None})  # None: the default


def _typed(task: str, key: str, value, default):
    """A task option's value in the type of its default (a list or a tuple where a list is
    expected; one value, a list of one); a value of another type is refused, naming the option. A
    text (``NAME=VALUE`` from the command line) is read by the default: as it is for a text or a
    path (default a text or None), so commas and colons are part of it; else by ``parse_value`` (a
    list splits on "," or ":"). "none" is the default (None) for any but a text option."""
    if isinstance(value, str) and not isinstance(default, str):
        if value.lower() == "none":
            return None
        if default is not None:
            value = parse_value(value)
    if default is None and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(default, tuple):
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return tuple(_typed(task, key, item, default[0]) if default else item for item in values)
    kind = str if default is None else type(default)  # None: a path
    fits = (isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
            or kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not fits:
        raise D2OError(f"task {task!r}: option {key}={value!r} must be {_KINDS.get(kind, kind.__name__)}")
    return value  # as given (a depth of 0 stays 0: it names the samples)


_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a text"}


PROTOCOLS = ("prompt", "context")


def asked(prompt: str, question: str) -> str:
    """The end of ``prompt`` from the last occurrence of ``question`` on (through a chat template's
    closing, when the prompt is wrapped in one)."""
    at = prompt.rfind(question)
    return prompt[at:] if at >= 0 else ""


def chat_prompt(tokenizer, prompt: str) -> tuple[str, bool]:
    """``prompt`` as a user turn of the model's chat template, if it has one; returns the text
    and whether the tokenizer should still add its special tokens (not when templated)."""
    templated = chat_text(tokenizer, prompt)
    return (prompt, True) if templated is None else (templated, False)


def take(items: list, limit: int | None, seed: int) -> list:
    """A seeded random subset of ``limit`` items (all of them, shuffled, if limit is None)."""
    items = list(items)
    random.Random(seed).shuffle(items)
    return items if limit is None else items[:limit]


def pack_passages(tokenizer, target: str, distractors: list[str], n_tokens: int, rng: random.Random,
                  separator: str = "\n\n") -> tuple[str, int]:
    """The target passage among distractors until about ``n_tokens`` tokens; returns the text and
    the target's position among the passages (a long context for short-context QA data)."""
    used = len(tokenizer(target, add_special_tokens=False).input_ids)
    chosen = []
    for passage in distractors:
        cost = len(tokenizer(passage, add_special_tokens=False).input_ids) + 2
        if used + cost > n_tokens:
            break
        chosen.append(passage)
        used += cost
    position = rng.randint(0, len(chosen))
    chosen.insert(position, target)
    return separator.join(chosen), position
