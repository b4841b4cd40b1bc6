"""Serving under one KV memory cap: N concurrent clients on loopback, the full cache against a method.

For each method, a server (the engine and app of ``d2o serve``, in this process) and ``clients``
concurrent streaming clients that send ``requests`` long prompts in all, back to back; each
prompt is a different stretch of the essays (``row_prompts``: as many requests as wanted). Reports
requests/s, tokens/s, latency and time to first token (p50/p95), how many requests ran at once,
and the KV bytes held at most.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time

import httpx

from d2o.bench.models import row_prompts
from d2o.runtime.generation import generate
from d2o.serve.app import create_app, serving
from d2o.serve.config import ServeConfig
from d2o.serve.engine import Engine


async def _client(http: httpx.AsyncClient, url: str, bodies: list[dict], records: list[dict]) -> None:
    """Send the bodies left, one at a time, streaming; record each one's timings."""
    while bodies:
        body = bodies.pop()
        start, first, tokens = time.perf_counter(), None, 0
        async with http.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                records.append({"status": reply.status_code})
                continue
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0]["text"] and first is None:
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        end = time.perf_counter()
        records.append({"status": 200, "latency": end - start, "ttft": (first or end) - start, "tokens": tokens})


async def _load(url: str, bodies: list[dict], clients: int) -> tuple[list[dict], float]:
    records: list[dict] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(_client(http, url, bodies, records) for _ in range(clients)))
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


def bench_serve(model, tokenizer, methods: list[tuple[str, str]], kv_memory: int, clients: int = 8,
                requests: int = 16, prompt_tokens: int = 1000, max_tokens: int = 64,
                min_tokens: int | None = None) -> list[dict]:
    """One row per (method, budget): throughput, latency and memory under ``kv_memory``."""
    prompts = serve_prompts(tokenizer, requests, prompt_tokens)
    generate(model, tokenizer, "Hello", "full", 1.0, max_new_tokens=2)  # warm up, outside the timings
    rows = []
    for method, budget in methods:
        config = ServeConfig(method=method, budget=budget, min_tokens=min_tokens, kv_memory=kv_memory,
                             max_queue=requests)
        engine = Engine(model, tokenizer, config)
        try:
            with serving(create_app(engine)) as url:
                bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}} for p in reversed(prompts)]
                records, seconds = asyncio.run(_load(url, bodies, clients))
                metrics = httpx.get(url + "/metrics").text
        finally:
            engine.close()
        done = [r for r in records if r["status"] == 200]
        latency, ttft = [r["latency"] for r in done], [r["ttft"] for r in done]
        tokens = sum(r["tokens"] for r in done)
        rows.append({
            "method": method, "budget": budget if method != "full" else "1",
            "kv_memory_mb": round(kv_memory / 1e6), "clients": clients, "requests": len(records),
            "answered": len(done), "fit_at_once": int(_metric(metrics, "d2o_kv_fit_requests{")),
            "peak_running": int(_metric(metrics, "d2o_requests_running_peak")),
            "requests_per_s": round(len(done) / seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "latency_p50_s": round(_quantile(latency, 0.5), 2), "latency_p95_s": round(_quantile(latency, 0.95), 2),
            "ttft_p50_s": round(_quantile(ttft, 0.5), 2), "ttft_p95_s": round(_quantile(ttft, 0.95), 2),
            "kv_peak_mb": round(_metric(metrics, "d2o_kv_bytes_peak") / 1e6, 1),
            "completion_tokens": tokens, "seconds": round(seconds, 1),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
