"""Many questions on one compressed document, answered as one batch (``CompressedContext.ask``): the
document's keys and values read in place by every row (a shared prefix) against copied into every
row, side by side in one run.

The document is NIAH's haystack of ``length`` tokens with ``questions`` needles (the server's
documents workload), each needle's question a row. Reported per method: the KV bytes (keys and
values) of the batch after the questions' pass and at its peak while decoding, against one
compressed document and against one document plus the rows' own tokens (questions and answers, at
the model's bytes per token); the bookkeeping bytes (token indices, method state), and all of it as
the server's gauge counts it: beyond the rows' own tokens, against the document; ms per decode
step; whether the greedy answers are the same both ways, and how many contain their needle.
"""

from __future__ import annotations

import time

from d2o.bench.decode import takes_adaptive_heads
from d2o.budget import Budget
from d2o.runtime.context import compress
from d2o.runtime.decoding import Sequence
from d2o.runtime.memory import slot_bytes


def document(tokenizer, length: int, questions: int) -> tuple[str, list[str], list[str]]:
    """The haystack of ``length`` tokens with ``questions`` needles, their questions and answers."""
    from d2o.eval.tasks import get_task
    from d2o.eval.tasks.niah import NEEDLES

    samples = get_task("niah", needles=questions, lengths=(length,)).samples(tokenizer, 1, 0)
    text = samples[0].prompt[: len(samples[0].prompt) - len(samples[0].question)]
    return text, [NEEDLES[s.meta["needle"]][1] for s in samples], [s.gold for s in samples]


def _kv_bytes(cache) -> tuple[int, int]:
    report = cache.report()
    return report.kv_bytes, report.state_bytes


def _answer(context, ids: list[list[int]], max_tokens: int, shared: bool) -> dict:
    sequences = [Sequence(context.tokenizer, max_tokens, stop_ids=context.stop_ids) for _ in ids]
    batch = context.answer_batch(ids, sequences, shared_prefix=shared)
    fed, fed_state = _kv_bytes(batch.cache)
    peak, peak_state, peak_all, steps, seconds = fed, fed_state, fed + fed_state, 0, 0.0
    while batch.sequences:
        start = time.perf_counter()
        batch.step()
        seconds += time.perf_counter() - start
        steps += 1
        if batch.sequences:
            kv, state = _kv_bytes(batch.cache)
            peak, peak_state, peak_all = max(peak, kv), max(peak_state, state), max(peak_all, kv + state)
    own = sum(len(question) + len(sequence.tokens) for question, sequence in zip(ids, sequences))
    return {"fed": fed, "peak": peak, "peak_state": peak_state, "peak_all": peak_all,
            "ms_per_step": 1000 * seconds / steps, "answers": [sequence.text for sequence in sequences],
            "own_tokens": own}


def _gauge(url: str) -> tuple[float, float]:
    """/metrics' KV bytes held now and requests running now (all methods)."""
    import httpx

    kv = running = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("d2o_kv_bytes "):
            kv = float(line.split()[1])
        elif line.startswith("d2o_requests_running{"):
            running += float(line.rsplit(" ", 1)[1])
    return kv, running


def _through_server(model, tokenizer, text: str, asked: list[str], method: str, budget: Budget, max_tokens: int,
                    slot: int, options: dict) -> dict:
    """The questions sent to ``d2o serve`` at once (the document in a system message, each question
    as the user), after one request had the document compressed and kept: the most KV bytes its
    /metrics gauge showed while they ran (sampled), less their own tokens at ``slot`` bytes each,
    against the document as kept."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from d2o.serve.app import create_app, serving
    from d2o.serve.config import ServeConfig
    from d2o.serve.engine import Engine

    config = ServeConfig(method=method, budget=str(budget), min_tokens=budget.min_tokens, kv_memory=1024 * 10**6,
                         prefix_cache_memory=256 * 10**6, max_queue=len(asked) + 1,
                         method_options={method: options} if options else {})
    engine = Engine(model, tokenizer, config)

    def ask(url: str, question: str):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        return client.chat.completions.create(
            model=config.model, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": text}, {"role": "user", "content": question}])

    try:
        with serving(create_app(engine)) as url:
            ask(url, asked[0])  # the document compressed and kept
            kept, _ = _gauge(url)
            peak, most, done = 0.0, 0.0, threading.Event()

            def sample():
                nonlocal peak, most
                while not done.is_set():
                    kv, running = _gauge(url)
                    peak, most = max(peak, kv), max(most, running)
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample)
            sampler.start()
            with ThreadPoolExecutor(len(asked)) as pool:
                answers = list(pool.map(lambda question: ask(url, question), asked))
            done.set()
            sampler.join()
    finally:
        engine.close()
    own = sum(a.usage.prompt_tokens - a.usage.prompt_tokens_details.cached_tokens + a.usage.completion_tokens
              for a in answers)
    return {"server: document bytes kept": int(kept), "server: most running at once": int(most),
            "server: peak gauge bytes": int(peak),
            "server: (peak gauge - own tokens) / document": (peak - own * slot) / kept}


def bench_ask(model, tokenizer, methods: list[str], budget: Budget, length: int = 1500, questions: int = 8,
              max_tokens: int = 16, server: bool = False, heads: tuple[str, ...] = ("even",)) -> list[dict]:
    """One row per method and way of keeping KV heads (``heads``: even, adaptive, for the methods
    that take it)."""
    text, asked, golds = document(tokenizer, length, questions)
    dtype_bytes = next(model.parameters()).element_size()
    rows = []
    for method, way in [(method, way) for method in methods for way in heads
                        if way == "even" or takes_adaptive_heads(method)]:
        options = {} if way == "even" else {"heads": way}
        context = compress(model, tokenizer, text, method, budget, chat=True, **options)
        # Keys and values of one token in every layer (the model's dtype): what a row's own token holds.
        token_bytes = sum(slot_bytes(model.config, dtype_bytes, context.method, stock=True))
        ids = [context.question_ids(question) for question in asked]
        document_bytes = context.report.kv_bytes
        copied, shared = (_answer(context, ids, max_tokens, share) for share in (False, True))
        found = sum(gold.lower() in answer.lower() for gold, answer in zip(golds, shared["answers"]))
        own_bytes = shared["own_tokens"] * token_bytes
        # As the server's gauge counts: keys, values and bookkeeping (the document's once, each own
        # token's at its slot's bytes).
        slot = sum(slot_bytes(model.config, dtype_bytes, context.method, allocated=True))
        beyond_own = shared["peak_all"] - shared["own_tokens"] * slot
        rows.append({
            "method": method, "heads": way, "budget": str(budget), "document KV bytes": document_bytes,
            "questions": questions,
            "shared: KV bytes after the questions": shared["fed"], "shared: peak KV bytes": shared["peak"],
            "copied: peak KV bytes": copied["peak"],
            "shared peak / document": shared["peak"] / document_bytes,
            "shared peak / (document + own tokens)": shared["peak"] / (document_bytes + own_bytes),
            "copied peak / (document + own tokens)": copied["peak"] / (document_bytes + own_bytes),
            "shared / copied peak": shared["peak"] / copied["peak"],
            "shared: peak bookkeeping bytes": shared["peak_state"], "copied: peak bookkeeping bytes":
                copied["peak_state"],
            "document bytes with bookkeeping": context.nbytes,
            "shared: peak bytes with bookkeeping": shared["peak_all"],
            "with bookkeeping: (shared peak - own tokens) / document": beyond_own / context.nbytes,
            "ms per step, shared / copied": shared["ms_per_step"] / copied["ms_per_step"],
            "same answers": shared["answers"] == copied["answers"], "needles found": f"{found}/{questions}",
            **(_through_server(model, tokenizer, text, asked, method, budget, max_tokens, slot, options)
               if server else {})})
    return rows
