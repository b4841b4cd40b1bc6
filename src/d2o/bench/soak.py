"""A soak test of the server: many mixed requests against a live server, then its invariants.

A server (the engine and app of ``d2o serve``, in this process, with a prefix cache and a prefill
in chunks) and ``clients`` concurrent clients that send ``requests`` requests drawn by ``seed``:

- ``chat``: a short question, answered whole, under one of a few methods and budgets;
- ``stream``: a stretch of the essays completed as a stream, under the same methods;
- ``document``: a question on one of a few documents (a system message), compressed by
  ``d2o-novelty``: the first request on a document compresses and keeps it, the next reuse it;
- ``cancel``: a stream its client leaves after two events, or a plain request whose client gives up
  before the answer;
- ``bad``: a request the server must refuse with a 4xx (a bad budget, an unknown method, a prompt
  longer than the model, malformed JSON, ...).

Then it checks what a soak must show: no 5xx and no hang (every request answered within
``timeout`` seconds), the KV bytes never above the cap, memory back to its idle level at the end
(nothing running or waiting or reserved; the KV bytes those of the kept prefixes), and every greedy
answer equal to the library's for the same request (``generate``; a document's question:
``compress(...).ask``).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import random
import resource
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from d2o.data import essay_tokens
from d2o.runtime.context import compress
from d2o.runtime.generation import generate
from d2o.serve.app import create_app, serving
from d2o.serve.config import ServeConfig
from d2o.serve.engine import Engine

KINDS = {"chat": 0.3, "stream": 0.25, "document": 0.25, "cancel": 0.1, "bad": 0.1}  # each request's kind, drawn
METHODS = [("d2o", "0.2"), ("d2o-novelty", "0.2"), ("h2o", "0.5"), ("snapkv", "0.2"), ("full", "1")]
DOCUMENT_METHOD = ("d2o-novelty", "0.2")
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 12 times 12?",
             "Who wrote Hamlet?", "Say hello in Spanish.", "What is water made of?"]
DOCUMENT_QUESTIONS = ["What is the document about?", "Who wrote it?", "Summarise it in one sentence.",
                      "What is its first word?"]
STREAM_LENGTHS = (40, 150, 400)  # tokens of a stream's prompt
DOCUMENT_TOKENS = 500
CHAT = {"model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [  # (body, status): what the server must refuse
    (b'{"messages": [', 400),
    ({**CHAT, "kv_method": "nope"}, 400),
    ({**CHAT, "kv_budget": 1.5}, 400),
    ({**CHAT, "max_tokens": -1}, 400),
    ({**CHAT, "messages": []}, 400),
    ({**CHAT, "messages": [{"role": "user", "content": "word " * 9000}]}, 400),
    ({**CHAT, "model": "gpt-9"}, 404),
]


@dataclass
class Request:
    kind: str
    path: str
    body: dict | bytes
    expected: tuple | None = None  # the key of the library's answer to compare with
    status: int = 200
    outcome: dict = field(default_factory=dict)


def requests_of(tokenizer, name: str, count: int, seed: int, max_tokens: int) -> list[Request]:
    """``count`` requests drawn by ``seed`` (see the module), for the model served as ``name``."""
    draw = random.Random(seed)
    tokens = essay_tokens(tokenizer, 3 * DOCUMENT_TOKENS + 20 * max(STREAM_LENGTHS))
    documents = [tokenizer.decode(tokens[i * DOCUMENT_TOKENS:(i + 1) * DOCUMENT_TOKENS]) for i in range(3)]
    streams = [tokenizer.decode(tokens[3 * DOCUMENT_TOKENS + 500 * i:][:n]) for i, n in enumerate(STREAM_LENGTHS)]
    common = {"model": name, "max_tokens": max_tokens, "temperature": 0}
    made = []
    for kind in draw.choices(list(KINDS), weights=list(KINDS.values()), k=count):
        method, budget = draw.choice(METHODS)
        extra = {"kv_method": method, "kv_budget": budget}
        if kind == "chat":
            question = draw.choice(QUESTIONS)
            body = {**common, **extra, "messages": [{"role": "user", "content": question}]}
            made.append(Request(kind, "/v1/chat/completions", body, ("chat", question, method, budget)))
        elif kind == "stream":
            prompt = draw.choice(streams)
            body = {**common, **extra, "prompt": prompt, "stream": True}
            made.append(Request(kind, "/v1/completions", body, ("text", prompt, method, budget)))
        elif kind == "document":
            document, question = draw.randrange(len(documents)), draw.choice(DOCUMENT_QUESTIONS)
            messages = [{"role": "system", "content": documents[document]}, {"role": "user", "content": question}]
            body = {**common, "kv_method": DOCUMENT_METHOD[0], "kv_budget": DOCUMENT_METHOD[1], "messages": messages}
            made.append(Request(kind, "/v1/chat/completions", body, ("document", documents[document], question)))
        elif kind == "cancel":
            body = {**common, **extra, "prompt": draw.choice(streams), "max_tokens": 200, "stream": draw.random() < 0.5}
            made.append(Request(kind, "/v1/completions", body))
        else:
            bad, status = draw.choice(BAD)
            if isinstance(bad, dict) and bad["model"] is None:
                bad = {**bad, "model": name}
            made.append(Request(kind, "/v1/chat/completions", bad, status=status))
    return made


def library_answers(model, tokenizer, made: list[Request], config: ServeConfig, max_tokens: int) -> dict:
    """The library's greedy answer to every distinct request that expects one, by its key."""
    options = dict(min_tokens=config.min_tokens, evict_every=config.evict_every, prefill_chunk=config.prefill_chunk)
    answers, contexts = {}, {}
    for key in dict.fromkeys(request.expected for request in made if request.expected is not None):
        if key[0] == "document":
            _, document, question = key
            if document not in contexts:
                contexts[document] = compress(model, tokenizer, [{"role": "system", "content": document}],
                                              *DOCUMENT_METHOD, chat=True, **options)
            answers[key] = contexts[document].ask(question, max_tokens).text
        else:
            kind, prompt, method, budget = key
            asked = [{"role": "user", "content": prompt}] if kind == "chat" else prompt
            answers[key] = generate(model, tokenizer, asked, method, budget, max_new_tokens=max_tokens,
                                    chat=kind == "chat", **options).texts[0]
    return answers


async def _send(http: httpx.AsyncClient, url: str, request: Request, timeout: float) -> None:
    """Send ``request``; record its status, its text, and whether it hung (no answer in ``timeout``)."""
    outcome, body = request.outcome, request.body
    sent = dict(content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes) \
        else dict(json=body)
    if request.kind == "cancel" and not body["stream"]:
        try:  # the client gives up before the answer
            reply = await http.post(url + request.path, timeout=0.2, **sent)
            outcome["status"] = reply.status_code  # answered within the 0.2 s after all
        except httpx.TimeoutException:
            outcome["status"] = 499
        return

    async def exchange():
        async with http.stream("POST", url + request.path, **sent) as reply:
            outcome["status"], text, events = reply.status_code, "", 0
            if reply.status_code != 200 or not body.get("stream"):
                outcome["text"] = _answer_text((await reply.aread()).decode(), reply.status_code)
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events += 1
                if request.kind == "cancel" and events == 2:
                    return  # the client leaves mid-stream
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                text += choice.get("text") or ""
            outcome["text"] = text

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        outcome["hung"] = True


def _answer_text(payload: str, status: int) -> str | None:
    if status != 200:
        return None
    choice = json.loads(payload)["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def _load(url: str, made: list[Request], clients: int, timeout: float) -> None:
    queue = list(reversed(made))

    async def client(http):
        while queue:
            await _send(http, url, queue.pop(), timeout)

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))


def _outcomes(metrics: dict, outcome: str) -> int:
    """Requests that ended with ``outcome``, over every method and budget."""
    return sum(n for labels, n in metrics["requests_total"].items() if ("outcome", outcome) in labels)


def _resident_mb() -> float:
    """This process's resident memory now, MB (from /proc; the peak where there is none), after
    glibc returns the memory it freed but holds (without, its arenas keep what the threads freed)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 1e6
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def soak_config(name: str, requests: int = 500, kv_memory: int = 64_000_000, prefix_cache_memory: int = 16_000_000,
                prefill_chunk: int | None = 256, prefill_thread: bool = False) -> ServeConfig:
    """The soak's server (checked as ``d2o serve`` checks its options): room in its queue for every request."""
    return ServeConfig(model=name, kv_memory=kv_memory, prefix_cache_memory=prefix_cache_memory,
                       prefill_chunk=prefill_chunk, prefill_thread=prefill_thread, max_queue=max(requests, 64))


def soak(model, tokenizer, config: ServeConfig, requests: int = 500, clients: int = 16, max_tokens: int = 8,
         seed: int = 0, timeout: float = 300.0, settle: float = 30.0) -> dict:
    """Run the soak (see the module) against a server of ``config`` (``soak_config``); returns its
    report, ``ok`` True when every check holds."""
    kv_memory = config.kv_memory
    engine = Engine(model, tokenizer, config)
    try:
        made = requests_of(tokenizer, engine.name, requests, seed, max_tokens)
        expected = library_answers(model, tokenizer, made, config, max_tokens)
        with serving(create_app(engine)) as url:
            # In two halves: resident memory that grows from the first half's end to the second's is a leak
            # (the first half's growth is the allocators' pools filling).
            resident = [_resident_mb()]
            start = time.perf_counter()
            for half in (made[:len(made) // 2], made[len(made) // 2:]):
                asyncio.run(_load(url, half, clients, timeout))
                resident.append(_resident_mb())
            seconds = time.perf_counter() - start
            deadline = time.monotonic() + settle  # cancelled requests leave at the engine's next round
            while True:
                metrics = engine.metrics()
                kept = metrics["prefix_cache_bytes"]  # the kept prefixes stay, counted under the cap
                idle = not sum(metrics["requests_running"].values()) and not metrics["requests_waiting"] and \
                    metrics["kv_bytes_reserved"] == metrics["kv_bytes"] == kept
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    finally:
        engine.close()
    statuses = Counter(request.outcome.get("status") for request in made)
    wrong_status = [r for r in made if r.kind in ("chat", "stream", "document", "bad")
                    and r.outcome.get("status") != r.status]
    mismatched = [r for r in made if r.expected is not None and r.outcome.get("status") == 200
                  and r.outcome.get("text") != expected[r.expected]]
    report = {
        "requests": requests, "clients": clients, "seed": seed, "max_tokens": max_tokens,
        "kinds": dict(Counter(request.kind for request in made)),
        "statuses": {str(status): n for status, n in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "server_errors": sum(n for status, n in statuses.items() if status is not None and status >= 500),
        "hung": sum(bool(request.outcome.get("hung")) for request in made),
        "unexpected_status": len(wrong_status),
        "answers_compared": sum(1 for r in made if r.expected is not None and r.outcome.get("status") == 200),
        "answers_different": len(mismatched),
        "kv_memory": kv_memory, "kv_bytes_peak": metrics["kv_bytes_peak"],
        "kv_bytes_end": metrics["kv_bytes"], "kv_bytes_reserved_end": metrics["kv_bytes_reserved"],
        "prefix_cache_bytes_end": metrics["prefix_cache_bytes"],
        "idle_at_end": idle,
        "prefix_cache_hits": metrics["prefix_cache_hits_total"],
        "requests_finished": _outcomes(metrics, "finished"), "requests_cancelled": _outcomes(metrics, "cancelled"),
        "resident_mb": {"start": round(resident[0], 1), "half": round(resident[1], 1), "end": round(resident[2], 1)},
        "seconds": round(seconds, 1), "requests_per_s": round(requests / seconds, 2),
        "examples_different": [{"kind": r.kind, "got": r.outcome.get("text"), "library": expected[r.expected]}
                               for r in mismatched[:5]],
        "examples_unexpected_status": [{"kind": r.kind, "status": r.outcome.get("status"), "expected": r.status}
                                       for r in wrong_status[:5]],
    }
    report["ok"] = (not report["server_errors"] and not report["hung"] and not report["unexpected_status"]
                    and not report["answers_different"] and report["kv_bytes_peak"] <= kv_memory and idle)
    return report
