"""Running one sample under several (method, budget) runs: one prefill shared where it can be.

Each sample's prompt is prefilled once under a cache that records what every method observes
(``SharedPrefill``); each method and budget then compresses its own fork of that prefill and
decodes greedily through the library's one decoding path. Under ``--protocol context`` the
samples that share a context (several questions on one document) share its prefill and each
run's compression too: the questions are asked of one ``CompressedContext``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.engine.report import CacheReport
from d2o.methods.base import Method
from d2o.runtime.context import CompressedContext
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.prompts import stop_token_ids
from d2o.runtime.sharing import SharedPrefill


@dataclass(frozen=True)
class Run:
    """One method at one budget (the full cache runs once, at budget 1)."""

    method: str
    budget: Budget


@dataclass
class Outcome:
    """What one run made of one sample."""

    run: Run
    prediction: str | None
    scores: dict[str, float]
    report: CacheReport
    seconds: float  # prefill, compression, question and answer, as if run alone (a shared prefill or context included)
    prefill_seconds: float | None
    extra: dict = field(default_factory=dict)  # task-specific fields of the result line


class Runner:
    """A model, its tokenizer and the methods of a sweep; answers samples run by run."""

    def __init__(self, model, tokenizer, methods: dict[str, Method], shared_prefill: bool = True,
                 evict_every: int = 1, kv_bits=None, prefill_chunk: int | None = None, question_aware: bool = True):
        """``prefill_chunk``: each run prefills its own prompt in chunks of that many tokens (a prefill
        compressed as it goes cannot be shared), showing a method that scores with the question the
        prompt's last tokens after each chunk unless not ``question_aware``."""
        self.model = model
        self.tokenizer = tokenizer
        self.methods = methods
        self.shared_prefill = shared_prefill and prefill_chunk is None
        self.evict_every = evict_every
        self.kv_bits = kv_bits
        self.prefill_chunk = prefill_chunk
        self.question = "tail" if question_aware else None
        self.stop_ids = stop_token_ids(model, tokenizer)

    @classmethod
    def of(cls, model, tokenizer, methods: dict[str, Method], config) -> Runner:
        """The runner of a sweep's ``EvalConfig``."""
        return cls(model, tokenizer, methods, config.shared_prefill, config.evict_every, config.kv_bits,
                   config.prefill_chunk, config.question_aware)

    def cache(self, method: str, budget: Budget) -> CompressedCache:
        return CompressedCache(self.model, self.methods[method], budget, tokenizer=self.tokenizer,
                               evict_every=self.evict_every, kv_bits=self.kv_bits, prefill_chunk=self.prefill_chunk)

    def answer(self, task, samples: list, ids: list[int], questions: list[list[int]],
               todos: list[list[Run]]) -> Iterator[tuple[object, Outcome]]:
        """Every run of each sample's ``todos`` answers it (greedy), yielded as each finishes: one
        prefill of ``ids`` shared where methods allow; for each run, its compressed cache is one
        ``CompressedContext`` that each sample's question (if any) is asked of, in turn (several
        samples share one context under ``--protocol context``)."""
        runs = list(dict.fromkeys(run for todo in todos for run in todo))
        shareable = [name for name in dict.fromkeys(run.method for run in runs)
                     if not self.methods[name].repeats_kv_heads]
        prefill = None
        if self.shared_prefill and shareable:
            prefill = SharedPrefill(self.model, [self.methods[name] for name in shareable], self.tokenizer)
            shared = self._prefill(prefill.cache, ids, samples[0])
        for run in runs:
            start = time.perf_counter()
            if prefill is not None and run.method in shareable:
                cache = prefill.fork(shareable.index(run.method), run.budget, self.evict_every, self.kv_bits)
                batch = Batch(self.model, cache, [self._sequence(samples[0])], shared.logits, shared.positions)
                prefill_seconds = shared.sequences[0].prefill_seconds
                start -= prefill_seconds  # done once for all: counted in each row, as a run alone has it
            else:
                batch = self._prefill(self.cache(run.method, run.budget), ids, samples[0])
                prefill_seconds = batch.sequences[0].prefill_seconds
            waiting = [(sample, question) for sample, question, todo in zip(samples, questions, todos) if run in todo]
            if not waiting[0][1]:  # nothing kept out of compression: the prompt is answered as it is
                sequence = batch.run()[0]
                yield samples[0], self._outcome(task, samples[0], run, sequence, time.perf_counter() - start,
                                                prefill_seconds)
                continue
            context = CompressedContext(self.model, self.tokenizer, self.methods[run.method], run.method, {}, ids,
                                        False, batch.cache, batch.logits, batch.positions, stop_ids=self.stop_ids)
            compressed = time.perf_counter() - start  # the prefill and the compression, paid once per context
            for sample, question in waiting:
                asked = time.perf_counter()
                sequence = self._sequence(sample)
                context.answer_batch([question], [sequence]).run()
                yield sample, self._outcome(task, sample, run, sequence, compressed + time.perf_counter() - asked,
                                            prefill_seconds)

    def _outcome(self, task, sample, run: Run, sequence: Sequence, seconds: float,
                 prefill_seconds: float | None) -> Outcome:
        text = task.answer(sequence.text)
        return Outcome(run, text, task.score(text, sample), sequence.report, seconds, prefill_seconds)

    def _sequence(self, sample) -> Sequence:
        return Sequence(self.tokenizer, sample.max_new_tokens, stop_ids=self.stop_ids, stop_strings=sample.stop)

    def _prefill(self, cache, ids: list[int], sample) -> Batch:
        return Batch.prefill(self.model, cache, [ids], [self._sequence(sample)], question=self.question)
