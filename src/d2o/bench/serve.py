"""Serving under one KV memory cap: N concurrent clients on loopback, the full cache against a method.

For each method (and prefix cache size), a server (the engine and app of ``d2o serve``, in this
process) and ``clients`` concurrent streaming clients that take a workload's conversations in turn:
``prompts``, different stretches of the essays completed once each; ``documents``, several
questions on each of a few documents (NIAH haystacks with several needles); ``chat``, one
conversation per document, its questions asked in turns; ``mixed``, short prompts streaming while
long ones arrive (every fourth request). Reports requests/s, tokens/s, latency and time to first
token (p50/p95; of the follow-up requests apart), the inter-token latency of the short requests
(p50/p99: the gaps between a stream's tokens, which a long prefill stretches), the prompt tokens found cached,
how many requests ran at once, the KV bytes held at most, and the answers' score (the needles'
facts recalled).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time

from dataclasses import dataclass, replace

import httpx

from d2o.bench.decode import takes_adaptive_heads
from d2o.bench.models import row_prompts
from d2o.eval.tasks.niah import NEEDLES, fact_recall
from d2o.runtime.generation import generate
from d2o.serve.app import create_app, serving
from d2o.serve.config import ServeConfig
from d2o.serve.engine import Engine

SHORT_PROMPT = 64  # tokens of a mixed workload's short prompts


@dataclass
class Conversation:
    """What one client sends in turn: ``document`` (messages, or a text prompt for ``/v1/completions``)
    then each question after the answers so far (a chat's turns), each scored against its gold."""

    document: list[dict] | str
    questions: list[str]
    golds: list[str]
    follow_up: bool = False  # its first request reuses a document another request asked first
    chat: bool = False  # turns accumulate (the next turn holds the earlier questions and answers)
    long: bool = False  # mixed: a long prompt among short ones (its token gaps are not counted)
    method: str = ""
    budget: str = ""


async def _client(http: httpx.AsyncClient, url: str, queue: list[Conversation], max_tokens: int,
                  records: list[dict]) -> None:
    """Take the next conversation, send its requests one after the other, streaming; record each
    one's timings, text and the prompt tokens it found cached."""
    while queue:
        conversation = queue.pop()
        messages = list(conversation.document) if isinstance(conversation.document, list) else None
        for turn, (question, gold) in enumerate(zip(conversation.questions, conversation.golds)):
            if messages is None:
                path, body = "/v1/completions", {"prompt": conversation.document}
            else:
                asked = [*messages, {"role": "user", "content": question}]
                path, body = "/v1/chat/completions", {"messages": asked}
            body |= {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True},
                     "kv_method": conversation.method, "kv_budget": conversation.budget}
            start, arrivals, text, usage = time.perf_counter(), [], "", {}
            async with http.stream("POST", url + path, json=body) as reply:
                if reply.status_code != 200:
                    records.append({"status": reply.status_code})
                    break
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    choice = event["choices"][0] if event.get("choices") else {}
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        arrivals.append(time.perf_counter())
                    text += piece
                    usage = event.get("usage") or usage
            end = time.perf_counter()
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            gaps = [] if conversation.long else [b - a for a, b in zip(arrivals, arrivals[1:])]
            records.append({"status": 200, "latency": end - start, "ttft": (arrivals[0] if arrivals else end) - start,
                            "gaps": gaps,
                            "tokens": usage.get("completion_tokens", 0), "cached": cached,
                            "follow_up": conversation.follow_up or turn > 0,
                            "score": None if gold is None else fact_recall(text, gold)})
            if conversation.chat and messages is not None:
                messages = [*asked, {"role": "assistant", "content": text}]


async def _load(url: str, queue: list[Conversation], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    records: list[dict] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(_client(http, url, queue, max_tokens, records) for _ in range(clients)))
    return records, time.perf_counter() - start


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return max(values, default=0.0)


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values``; NaN when no request was answered (every one refused)."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def serve_prompts(tokenizer, requests: int, prompt_tokens: int) -> list[str]:
    """``requests`` different texts of ``prompt_tokens`` tokens each, from the essays."""
    prompt_of = row_prompts(tokenizer, None, prompt_tokens)
    return [tokenizer.decode(prompt_of(i)) for i in range(requests)]


def workload(tokenizer, kind: str, requests: int, prompt_tokens: int, documents: int,
             questions: int) -> list[Conversation]:
    """The conversations of a workload, in the order they are taken (the last first).

    ``prompts``: ``requests`` different essay stretches, each completed once. ``documents``:
    ``documents`` haystacks of ``prompt_tokens`` with ``questions`` needles each (NIAH's), every
    needle asked in a request of its own (a system message holds the document): all first
    questions are sent before any follow-up. ``chat``: one conversation per document, its needles
    asked in turns, each turn after the answers so far. ``mixed``: ``requests`` essay stretches,
    every fourth of ``prompt_tokens``, the others of ``SHORT_PROMPT`` tokens."""
    if kind == "prompts":
        return [Conversation(p, [""], [None]) for p in reversed(serve_prompts(tokenizer, requests, prompt_tokens))]
    if kind == "mixed":
        long = serve_prompts(tokenizer, requests, prompt_tokens)
        short = serve_prompts(tokenizer, requests, SHORT_PROMPT)
        return list(reversed([Conversation(long[i], [""], [None], long=True) if i % 4 == 3 else
                              Conversation(short[i], [""], [None]) for i in range(requests)]))
    from d2o.eval.tasks import get_task

    samples = get_task("niah", needles=questions, lengths=(prompt_tokens,)).samples(tokenizer, documents, 0)
    docs = []
    for first in range(0, len(samples), questions):
        group = samples[first:first + questions]
        text = group[0].prompt[: len(group[0].prompt) - len(group[0].question)]
        system = [{"role": "system", "content": "Answer the question from this document.\n\n" + text}]
        docs.append((system, [NEEDLES[s.meta["needle"]][1] for s in group], [s.gold for s in group]))
    if kind == "chat":
        return [Conversation(system, asked, golds, chat=True) for system, asked, golds in reversed(docs)]
    order = [Conversation(system, [asked[i]], [golds[i]], follow_up=i > 0)
             for i in range(questions) for system, asked, golds in docs]
    return list(reversed(order))


def bench_serve(model, tokenizer, methods: list[tuple[str, str]], kv_memory: int, clients: int = 8,
                requests: int = 16, prompt_tokens: int = 1000, max_tokens: int = 64,
                min_tokens: int | None = None, kind: str = "prompts", documents: int = 4, questions: int = 8,
                prefix_cache: tuple[int, ...] = (0,), evict_every: int = 1,
                prefill_chunks: tuple[int | None, ...] = (None,), sharing: tuple[bool, ...] = (True,),
                heads: tuple[str, ...] = ("even",), prefill_threads: tuple[bool, ...] = (False,)) -> list[dict]:
    """One row per (method, budget, heads, prefix cache bytes, prefill chunk, prefill thread, prefix sharing):
    throughput, latency, memory and (documents, chat) the answers' score under ``kv_memory``; the
    servers evict in batches of ``evict_every`` steps, serve each method that takes it with each of
    ``heads`` (its ``heads`` option), prefill whole (None) or in chunks of each of
    ``prefill_chunks``, in the rounds or on a thread of their own (each of ``prefill_threads``), and
    with a prefix cache let requests read a kept document in place (True) or copy it (False), each
    of ``sharing``."""
    conversations = workload(tokenizer, kind, requests, prompt_tokens, documents, questions)
    generate(model, tokenizer, "Hello", "full", 1.0, max_new_tokens=2)  # warm up, outside the timings
    rows = []
    for method, budget in methods:
        ways = [way for way in heads if way == "even" or takes_adaptive_heads(method)]
        runs = [(way, size, chunk, apart, shared) for way in ways for size in prefix_cache for chunk in prefill_chunks
                for apart in prefill_threads for shared in (sharing if size else (True,))]
        for way, prefix_bytes, chunk, apart, shared in runs:
            options = {} if way == "even" else {method: {"heads": way}}  # (the full cache takes no options)
            config = ServeConfig(method=method, budget=budget, min_tokens=min_tokens, kv_memory=kv_memory,
                                 max_queue=max(requests, len(conversations) * questions),
                                 prefix_cache_memory=prefix_bytes, evict_every=evict_every, prefill_chunk=chunk,
                                 prefill_thread=apart, share_prefixes=shared, method_options=options)
            engine = Engine(model, tokenizer, config)
            queue = [replace(c, method=method, budget=budget) for c in conversations]
            try:
                with serving(create_app(engine)) as url:
                    records, seconds = asyncio.run(_load(url, queue, clients, max_tokens))
                    metrics = httpx.get(url + "/metrics").text
            finally:
                engine.close()
            rows.append(row(method, budget, prefix_bytes, chunk, kv_memory, clients, records, seconds, metrics,
                            shared, way if method != "full" else "-", apart))
    return rows


def row(method: str, budget: str, prefix_bytes: int, chunk: int | None, kv_memory: int, clients: int,
        records: list[dict], seconds: float, metrics: str, shared: bool = True, heads: str = "even",
        prefill_thread: bool = False) -> dict:
    done = [r for r in records if r["status"] == 200]
    latency, ttft = [r["latency"] for r in done], [r["ttft"] for r in done]
    follow_ups = [r["ttft"] for r in done if r["follow_up"]]
    scores = [r["score"] for r in done if r["score"] is not None]
    tokens = sum(r["tokens"] for r in done)
    gaps = [gap for r in done for gap in r["gaps"]]
    return {
        "method": method, "budget": budget if method != "full" else "1", "heads": heads,
        "prefix_cache_mb": round(prefix_bytes / 1e6),
        "prefix_sharing": ("in place" if shared else "copied") if prefix_bytes else "-",
        "prefill_chunk": chunk or "whole", "prefill_thread": "yes" if prefill_thread else "no",
        "kv_memory_mb": round(kv_memory / 1e6), "clients": clients,
        "requests": len(records), "answered": len(done), "fit_at_once": int(_metric(metrics, "d2o_kv_fit_requests{")),
        "peak_running": int(_metric(metrics, "d2o_requests_running_peak")),
        "requests_per_s": round(len(done) / seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
        "latency_p50_s": round(_quantile(latency, 0.5), 2), "latency_p95_s": round(_quantile(latency, 0.95), 2),
        "ttft_p50_s": round(_quantile(ttft, 0.5), 2), "ttft_p95_s": round(_quantile(ttft, 0.95), 2),
        "ttft_follow_up_p50_s": round(_quantile(follow_ups, 0.5), 2),
        "ttft_follow_up_p95_s": round(_quantile(follow_ups, 0.95), 2),
        "itl_p50_ms": round(1000 * _quantile(gaps, 0.5), 1), "itl_p99_ms": round(1000 * _quantile(gaps, 0.99), 1),
        "cached_tokens": sum(r["cached"] for r in done),
        "score": round(statistics.fmean(scores), 3) if scores else None,
        "kv_peak_mb": round(_metric(metrics, "d2o_kv_bytes_peak") / 1e6, 1),
        "completion_tokens": tokens, "seconds": round(seconds, 1),
    }


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
