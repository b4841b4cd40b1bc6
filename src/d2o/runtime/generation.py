"""Generate text under a KV budget: prompts in, answers and the cache's report out."""

from __future__ import annotations

from dataclasses import dataclass

from d2o.budget import EVICT_EVERY, Budget
from d2o.engine.cache import CompressedCache
from d2o.engine.quantization import KVQuantization
from d2o.engine.report import CacheReport
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.methods.base import Method
from d2o.runtime.decoding import Batch, Sampling, Sequence
from d2o.runtime.memory import KVPlan, over_cap, plan
from d2o.runtime.prompts import as_list, check_length, encode, stop_token_ids


@dataclass
class Generation:
    """The answers to a batch of prompts and what their cache held."""

    texts: list[str]
    new_tokens: list[list[int]]
    prompt_tokens: list[int]
    finish_reasons: list[str]
    report: CacheReport
    seconds: float  # prefill and decoding, wall clock
    prefill_seconds: float

    @classmethod
    def of(cls, sequences: list[Sequence], seconds: float, prefill_seconds: float) -> Generation:
        """What finished ``sequences`` produced, and their caches' report."""
        return cls(texts=[s.text for s in sequences], new_tokens=[s.tokens for s in sequences],
                   prompt_tokens=[s.prompt_tokens for s in sequences],
                   finish_reasons=[s.finish_reason for s in sequences],
                   report=CacheReport.concat([s.report for s in sequences]), seconds=seconds,
                   prefill_seconds=prefill_seconds)

    @property
    def text(self) -> str:
        """The answer, when there was one prompt (or question)."""
        if len(self.texts) != 1:
            raise D2OError(f"{len(self.texts)} answers: read .texts")
        return self.texts[0]


def resolve(method: str | Method, budget: Budget | str | float, min_tokens: int | None = None,
            **options) -> tuple[Method, Budget]:
    """A method object and a parsed budget (``min_tokens``: its floor, None for the default),
    checked against each other before any model runs."""
    if isinstance(method, str):
        method = get_method(method, **options)
    elif options:
        raise D2OError("method options go with a method name, not with a method object")
    budget = Budget.parse(budget, min_tokens)
    method.check_budget(budget)
    return method, budget


def check_memory(model, method: Method, budget: Budget, rows: list[list[int]], new_tokens: int, cap: int,
                 evict_every: int, kv_bits, prefill_chunk: int | None, question_aware: bool) -> None:
    """Refuse, saying what would fit, a batch whose planned KV bytes at their peak exceed ``cap``."""
    longest = max(len(row) for row in rows)
    kv_plan = plan(model.config, method, budget, longest, new_tokens, next(model.parameters()).element_size(),
                   evict_every=evict_every, kv_bits=kv_bits, prefill_chunk=prefill_chunk,
                   question=question_aware and bool(method.question_tokens), rows=len(rows))
    whole = KVPlan(len(rows) * kv_plan.prefill_bytes, len(rows) * kv_plan.held_bytes)
    over = over_cap(whole, cap, bool(prefill_chunk) and prefill_chunk < longest)
    if over is not None:
        remedy = dict(prefill="a prefill in chunks (prefill_chunk=, --prefill-chunk: the cache holds its budget and "
                              "a chunk; a prefill whole holds every prompt token before it is compressed)",
                      held="a smaller budget, prefill chunk, prompt or answer")[over]
        rows_said = f"{len(rows)} rows of " if len(rows) > 1 else ""
        raise D2OError(f"{rows_said}{longest} prompt tokens + {new_tokens} new need {whole.peak_bytes:,} bytes of KV "
                       f"cache at their peak under {method.name} (prefill {whole.prefill_bytes:,}, held after it "
                       f"{whole.held_bytes:,}): more than the cap of {cap:,}; use {remedy}")


def generate(
    model,
    tokenizer,
    prompts: str | list[dict] | list[str | list[dict]],
    method: str | Method = "d2o",
    budget: Budget | str | float = 0.2,
    *,
    max_new_tokens: int = 32,
    chat: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    min_tokens: int | None = None,
    evict_every: int = EVICT_EVERY,
    kv_bits: int | KVQuantization | None = None,
    prefill_chunk: int | None = None,
    question_aware: bool = True,
    kv_memory: int | None = None,
    **method_options,
) -> Generation:
    """Answer ``prompts`` (one string or a batch) with ``method`` holding the cache to ``budget``.

    ``prompts``: a text, a conversation (a list of messages; ``chat=True``) or a list of either.
    Greedy by default; ``temperature`` > 0 samples (among the ``top_k`` likeliest, within ``top_p``,
    from ``seed``). An answer ends at the model's end-of-sequence token, at a ``stop`` string, or
    after ``max_new_tokens``.
    ``min_tokens``: the floor under a ratio budget (``d2o.budget.MIN_TOKENS`` by default).
    ``evict_every``: evict in batches of that many decode steps (``CompressedCache``; 1: at every step).
    ``kv_bits``: store keys and values at 8, 4 or 2 bits (``CompressedCache``; None: the model's dtype).
    ``prefill_chunk``: prefill the prompt that many tokens at a time, compressed after each chunk (it
    never holds more than its budget and a chunk); a method that scores with the question (the
    prompt's last tokens) is shown them after every chunk, unless ``question_aware`` is False.
    ``kv_memory``: bytes of KV cache the batch may hold at its peak (``runtime.memory.plan``): a
    prompt that needs more is refused before the model runs.
    """
    method, budget = resolve(method, budget, min_tokens, **method_options)
    sampling = Sampling(temperature, top_p, seed, top_k)
    rows = encode(tokenizer, as_list(prompts), chat)
    check_length(model, max(len(row) for row in rows), max_new_tokens)
    if kv_memory is not None:
        check_memory(model, method, budget, rows, max_new_tokens, kv_memory, evict_every, kv_bits, prefill_chunk,
                     question_aware)
    stops = stop_token_ids(model, tokenizer)
    sequences = [Sequence(tokenizer, max_new_tokens, sampling, stops, stop) for _ in rows]
    cache = CompressedCache(model, method, budget, tokenizer=tokenizer, evict_every=evict_every, kv_bits=kv_bits,
                            prefill_chunk=prefill_chunk)
    Batch.prefill(model, cache, rows, sequences, question="tail" if question_aware else None).run()
    return Generation.of(sequences, sequences[0].prefill_seconds + max(s.decode_seconds for s in sequences),
                         sequences[0].prefill_seconds)
