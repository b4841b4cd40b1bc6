"""``d2o serve`` end to end: the official openai client against uvicorn on loopback, on the real model.

Each server runs in a thread of this process on a socket bound here (no port race); the openai
client never retries (max_retries=0), so every request is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from d2o.budget import Budget
from d2o.cli import main
from d2o.data import essay_tokens
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.models import load_model
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.generation import generate
from d2o.runtime.memory import plan
from d2o.serve.app import create_app
from d2o.serve.app import serving as in_thread
from d2o.options import parse_bytes
from d2o.serve.config import ServeConfig
from d2o.serve.engine import Engine, fit
from d2o.serve.jobs import Lane, stable_text
from d2o.serve.protocol import APIError, CompletionRequest

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"
STORY = "Write a long story about a lighthouse keeper."


@contextlib.contextmanager
def serving(model, tokenizer, **options):
    """An engine on the model and its app under uvicorn on 127.0.0.1; yields (base url, engine)."""
    engine = Engine(model, tokenizer, ServeConfig(**options))
    try:
        with in_thread(create_app(engine)) as url:
            yield url, engine
    finally:
        engine.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def wait_for(url: str, condition, seconds: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        values = scrape(url)
        if condition(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def essay(tokenizer, n_tokens: int, skip: int = 0) -> str:
    return tokenizer.decode(essay_tokens(tokenizer, n_tokens + skip)[skip:])


@pytest.fixture(scope="module")
def server(real_model):
    with serving(*real_model, kv_memory=parse_bytes("64MB")) as running:
        yield running


# -- answers ---------------------------------------------------------------------------------------
def test_greedy_chat_and_completion_answers_equal_d2o_generate(server, real_model):
    url, _ = server
    model, tokenizer = real_model
    chat = client(url).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=12, temperature=0)
    expected = generate(model, tokenizer, QUESTION, "d2o", 0.2, max_new_tokens=12, chat=True)
    assert chat.choices[0].message.content == expected.texts[0] and "Paris" in expected.texts[0]
    assert chat.choices[0].finish_reason == expected.finish_reasons[0]
    assert chat.usage.prompt_tokens == expected.prompt_tokens[0]
    assert chat.usage.completion_tokens == len(expected.new_tokens[0])
    assert chat.kv_method == "d2o" and chat.kv_budget == "0.2"

    prompt = essay(tokenizer, 300)  # past the floor of 128: the cache really is compressed
    completion = client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0,
                                                extra_body={"kv_method": "snapkv", "kv_budget": 0.2})
    expected = generate(model, tokenizer, prompt, "snapkv", 0.2, max_new_tokens=10)
    assert completion.choices[0].text == expected.texts[0]
    usage = completion.usage
    assert usage.prompt_tokens == expected.prompt_tokens[0] and usage.completion_tokens == 10
    assert usage.kv_tokens == expected.report.kv_tokens_kept < usage.kv_tokens_full / 2
    assert usage.kv_bytes == expected.report.kv_bytes < usage.kv_bytes_full / 2


def test_streams_carry_the_same_text_and_stop_at_a_stop_string(server, real_model):
    url, _ = server
    model, tokenizer = real_model
    whole = client(url).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=12, temperature=0, extra_body={"kv_method": "h2o"})
    chunks = list(client(url).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"kv_method": "h2o"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", url + "/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as raw:
        events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: {")]
    assert all("usage" in event and event["usage"] is None for event in events[:-1])  # as OpenAI's chunks say
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 4

    prompt = "The capital of France is"
    expected = generate(model, tokenizer, prompt, "d2o", 0.2, max_new_tokens=16, stop=("answer",))
    assert expected.finish_reasons[0] == "stop"
    pieces = [c.choices[0].text for c in client(url).completions.create(
        model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stop="answer", stream=True)]
    assert "".join(pieces) == expected.texts[0]
    assert not any("answer" in piece for piece in pieces)  # the stop string is never sent, not even in part


def test_streamed_text_never_takes_back_a_character(real_model):
    """Every prefix of the answer streams a prefix of its final text: no half of a UTF-8
    character, no start of a stop string."""
    _, tokenizer = real_model
    ids = tokenizer("Voilà: 日本語 and the world.").input_ids
    sequence = Sequence(tokenizer, 100, stop_strings=("the world",))
    shown = []
    for token in ids:
        sequence.push(token)
        shown.append(stable_text(sequence))
    assert sequence.finished and sequence.text == "Voilà: 日本語 and "
    assert any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))  # split characters
    assert all(later.startswith(earlier) and "\ufffd" not in earlier for earlier, later in zip(shown, shown[1:]))
    assert shown[-1] == sequence.text and not any("the" in text for text in shown)  # "the" was held back


def test_seeded_sampling_repeats(server):
    url, _ = server
    ask = dict(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    first, again = (client(url).completions.create(**ask).choices[0].text for _ in range(2))
    assert first == again


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in client(url).models.list()] == ["smollm2"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


# -- bad requests ----------------------------------------------------------------------------------
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [
    ("malformed JSON", b'{"model": "smollm2", "messages": [', 400, None, None),
    ("unknown method", {**CHAT, "kv_method": "nope"}, 400, "kv_method", None),
    ("budget out of range", {**CHAT, "kv_budget": 1.5}, 400, "kv_budget", None),
    ("a boolean budget", {**CHAT, "kv_budget": True}, 400, "kv_budget", None),
    ("a seed beyond 64 bits", {**CHAT, "seed": 2**70, "temperature": 1.0}, 400, "seed", None),
    ("budget below the method's minimum", {**CHAT, "kv_budget": "2t"}, 400, "kv_budget", None),
    ("negative max_tokens", {**CHAT, "max_tokens": -1}, 400, "max_tokens", None),
    ("n > 1", {**CHAT, "n": 2}, 400, "n", None),
    ("no messages", {**CHAT, "messages": []}, 400, "messages", None),
    ("a prompt longer than the model allows", {**CHAT, "messages": [{"role": "user", "content": "word " * 9000}]},
     400, "messages", "context_length_exceeded"),
    ("more than the whole KV memory", {**CHAT, "messages": [{"role": "user", "content": "word " * 2000}],
                                       "kv_method": "full"}, 400, None, "kv_memory_exceeded"),
    ("a max_tokens beyond the model's positions", {**CHAT, "max_tokens": 100_000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("an unknown model", {**CHAT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("a budget of a Unicode digit", {**CHAT, "kv_budget": "\u00b2t"}, 400, "kv_budget", None),
    ("a budget beyond any model", {**CHAT, "kv_budget": "99999999999999999999t"}, 400, "kv_budget", None),
    ("logprobs", {**CHAT, "logprobs": True}, 400, "logprobs", None),
    ("echo", {**CHAT, "echo": True}, 400, "echo", None),
    ("logit_bias", {**CHAT, "logit_bias": {"1": 100}}, 400, "logit_bias", None),
    ("a presence penalty", {**CHAT, "presence_penalty": 1.5}, 400, "presence_penalty", None),
    ("a JSON response format", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("tools", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
    ("usage asked of an answer not streamed", {**CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
]


@pytest.mark.parametrize("what, body, status, param, code", BAD, ids=[case[0] for case in BAD])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, what, body, status, param, code):
    url, _ = server
    sent = dict(content=body) if isinstance(body, bytes) else dict(json=body)
    reply = httpx.post(url + "/v1/chat/completions", headers={"Content-Type": "application/json"}, **sent)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    if isinstance(body, dict):  # the official client reads the same error
        known = {k: v for k, v in body.items() if k in ("model", "messages", "max_tokens", "n")}
        with pytest.raises(openai.APIStatusError) as raised:
            client(url).chat.completions.create(**known, extra_body={k: body[k] for k in set(body) - set(known)})
        assert raised.value.status_code == status and raised.value.body == error
    assert client(url).chat.completions.create(**CHAT, temperature=0).choices[0].finish_reason


def test_null_sampling_fields_are_their_defaults(server):
    url, _ = server
    body = {**CHAT, "temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "seed": None,
            "stream_options": {"include_usage": None}, "presence_penalty": 0, "logit_bias": {}, "tool_choice": None,
            "response_format": {"type": "text"}}  # and the "off" values of what is not supported
    reply = httpx.post(url + "/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_a_prompt_whose_prefill_exceeds_the_memory_is_told_to_be_shorter(server):
    """The prefill holds every prompt token: a smaller budget would not help, and the error says so."""
    url, _ = server
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 2000}], "kv_method": "h2o", "kv_budget": "16t"}
    reply = httpx.post(url + "/v1/chat/completions", json=long)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "kv_memory_exceeded"
    assert "use a shorter prompt, or a server prefilling in chunks (d2o serve --prefill-chunk" in \
        reply.json()["error"]["message"]


def test_a_server_prefilling_in_chunks_admits_a_prompt_whose_whole_prefill_exceeds_the_memory(real_model):
    """The request refused above: in chunks of 256 its cache holds 16 tokens and a chunk per layer,
    and the answer is the library's, prefilled the same way."""
    model, tokenizer = real_model
    prompt = essay(tokenizer, 2000)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 6, "temperature": 0, "kv_method": "snapkv",
            "kv_budget": "0.05"}
    whole = plan(model.config, get_method("snapkv"), Budget.parse("0.05"), 2000, 6)
    with serving(model, tokenizer, kv_memory=whole.prefill_bytes // 3) as (url, _):
        assert httpx.post(url + "/v1/completions", json=body).json()["error"]["code"] == "kv_memory_exceeded"
    with serving(model, tokenizer, kv_memory=whole.prefill_bytes // 3, prefill_chunk=256) as (url, _):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    expected = generate(model, tokenizer, prompt, "snapkv", 0.05, max_new_tokens=6, prefill_chunk=256)
    assert reply.json()["choices"][0]["text"] == expected.texts[0]


def stream_beside_a_long_prompt(url: str, prompt: str):
    """A 48-token story streamed under ``h2o`` while ``prompt`` (4 tokens under ``d2o-novelty``) is sent
    once the stream has begun: the stream's parts, and the long prompt's answer."""
    stream = client(url).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": STORY}],
                                                 max_tokens=48, temperature=0, stream=True,
                                                 extra_body={"kv_method": "h2o"})
    parts = [next(stream).choices[0].delta.content or ""]
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client(url).completions.create, model="smollm2", prompt=prompt, max_tokens=4,
                           temperature=0, extra_body={"kv_method": "d2o-novelty"})
        parts += [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        return parts, long.result()


def test_a_prompt_prefilled_in_chunks_lets_the_running_requests_step_between_its_chunks(real_model, monkeypatch):
    """A stream runs while a 1,500-token prompt arrives: the server feeds that prompt 64 tokens a
    round, and steps the stream in each round between (prefilled whole, it would step in none);
    both answer as the library does."""
    model, tokenizer = real_model
    between = []
    original = Engine._step

    def step(engine, lane):  # a lane steps while another request is part-way through its prefill
        between.append(any(job.prefilling is not None for job in engine._admitted))
        original(engine, lane)

    monkeypatch.setattr(Engine, "_step", step)
    prompt = essay(tokenizer, 1500)
    with serving(model, tokenizer, kv_memory=parse_bytes("1GB"), prefill_chunk=64) as (url, _):
        parts, answer = stream_beside_a_long_prompt(url, prompt)
    assert sum(between) >= 5
    assert answer.choices[0].text == generate(model, tokenizer, prompt, "d2o-novelty", 0.2, max_new_tokens=4,
                                              prefill_chunk=64).texts[0]
    assert "".join(parts) == generate(model, tokenizer, STORY, "h2o", 0.2, max_new_tokens=48, chat=True).texts[0]


def test_a_request_cancelled_part_way_through_its_prefill_in_chunks_is_dropped_there(real_model, monkeypatch):
    """Its client gives up while its prompt is fed 16 tokens a round: the next round drops it, its
    cache unfinished, and nothing stays reserved."""
    model, tokenizer = real_model
    fed = []
    original = Engine._prefill

    def prefill(engine, job):
        original(engine, job)
        fed.append(job.prefilling is not None)  # part-way through after this round

    monkeypatch.setattr(Engine, "_prefill", prefill)
    gone = 'd2o_requests_total{budget="0.2",method="d2o",outcome="cancelled"}'
    with serving(model, tokenizer, kv_memory=parse_bytes("1GB"), prefill_chunk=16) as (url, _):
        request = {"model": "smollm2", "prompt": essay(tokenizer, 4000), "max_tokens": 4, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=request, timeout=1.0)
        after = wait_for(url, lambda m: m.get(gone, 0) == 1)
    assert after[gone] == 1 and after["d2o_kv_bytes"] == 0 and after["d2o_kv_bytes_reserved"] == 0
    assert fed[0] and not fed[-1] and len(fed) < 4000 // 16  # cut short: fewer rounds than its chunks


def test_a_server_prefilling_on_a_thread_of_its_own_steps_the_running_requests_during_a_whole_prefill(
        real_model, monkeypatch):
    """With --prefill-thread a 1,500-token prompt is prefilled whole beside a stream: the stream
    steps while the prefill runs (in the rounds it would wait for all of it), on half the cores
    then, and both answer as the library does."""
    model, tokenizer = real_model
    during, threads = [], []
    original = Engine._step

    def step(engine, lane):
        during.append(engine._prefilling is not None)
        threads.append(torch.get_num_threads())
        original(engine, lane)

    monkeypatch.setattr(Engine, "_step", step)
    prompt = essay(tokenizer, 1500)
    with serving(model, tokenizer, kv_memory=parse_bytes("1GB"), prefill_thread=True) as (url, engine):
        parts, answer = stream_beside_a_long_prompt(url, prompt)
        cores = engine._cores
    assert sum(during) >= 5
    if cores > 1:
        assert {n for n, prefilling in zip(threads, during) if prefilling} == {cores // 2}
    assert answer.choices[0].text == generate(model, tokenizer, prompt, "d2o-novelty", 0.2, max_new_tokens=4).texts[0]
    assert "".join(parts) == generate(model, tokenizer, STORY, "h2o", 0.2, max_new_tokens=48, chat=True).texts[0]


def test_a_request_cancelled_during_its_prefill_on_the_prefill_thread_is_dropped_there(real_model, monkeypatch):
    """Its client gives up while the prefill thread feeds its prompt 16 tokens at a time: the KV gauge
    counts its cache between chunks, the thread stops at the next chunk, and nothing stays held or
    reserved."""
    model, tokenizer = real_model
    chunks = []
    original = Engine._prefill_next

    def prefill_next(engine, job):
        chunks.append(1)
        return original(engine, job)

    monkeypatch.setattr(Engine, "_prefill_next", prefill_next)
    gone = 'd2o_requests_total{budget="0.2",method="d2o",outcome="cancelled"}'
    with serving(model, tokenizer, kv_memory=parse_bytes("1GB"), prefill_chunk=16, prefill_thread=True) as (url, _):
        request = {"model": "smollm2", "prompt": essay(tokenizer, 4000), "max_tokens": 4, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, url + "/v1/completions", json=request, timeout=1.5)
            during = wait_for(url, lambda m: m["d2o_kv_bytes"] > 0)  # its cache so far, between chunks
            with pytest.raises(httpx.ReadTimeout):
                sent.result()
        after = wait_for(url, lambda m: m.get(gone, 0) == 1)
    assert during["d2o_kv_bytes"] > 0
    assert after[gone] == 1 and after["d2o_kv_bytes"] == 0 and after["d2o_kv_bytes_reserved"] == 0
    assert 1 < len(chunks) < 4000 // 16  # cut short


def test_the_prefill_thread_feeds_a_short_prompt_between_the_chunks_of_a_long_one(real_model, monkeypatch):
    """A 20-token prompt arriving while a 1,500-token one is fed 64 tokens at a time waits for one of
    its chunks, not all: the thread takes the prompts in turns, chunk by chunk (both in flight at once
    only because their prefills fit the cap together); both answer as the library does."""
    model, tokenizer = real_model
    fed = []
    original = Engine._prefill_next

    def prefill_next(engine, job):
        fed.append(len(job.ids))
        return original(engine, job)

    monkeypatch.setattr(Engine, "_prefill_next", prefill_next)
    long_prompt, short_prompt = essay(tokenizer, 1500), essay(tokenizer, 20, skip=3000)
    with serving(model, tokenizer, kv_memory=parse_bytes("1GB"), prefill_chunk=64, prefill_thread=True) as (url, _):
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(client(url).completions.create, model="smollm2", prompt=long_prompt, max_tokens=4,
                               temperature=0, extra_body={"kv_method": "d2o-novelty"})
            deadline = time.monotonic() + 60
            while len(fed) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            short = client(url).completions.create(model="smollm2", prompt=short_prompt, max_tokens=4,
                                                   temperature=0, extra_body={"kv_method": "h2o"})
            answer = long.result()
    long_tokens = max(fed)
    assert fed.count(long_tokens) >= 1500 // 64 and min(fed) < long_tokens
    assert max(i for i, n in enumerate(fed) if n != long_tokens) < max(i for i, n in enumerate(fed) if n == long_tokens)
    assert short.choices[0].text == generate(model, tokenizer, short_prompt, "h2o", 0.2, max_new_tokens=4).texts[0]
    assert answer.choices[0].text == generate(model, tokenizer, long_prompt, "d2o-novelty", 0.2, max_new_tokens=4,
                                              prefill_chunk=64).texts[0]


def test_concurrent_requests_prefilled_on_the_prefill_thread_each_get_their_own_answer(real_model):
    """12 requests of three methods and mixed lengths at once under a cap of 4 full caches: prefilled
    on the prefill thread, joined to lanes by the rounds, each answers as the library does, the KV
    bytes stay under the cap, and the memory is back to nothing at the end."""
    model, tokenizer = real_model
    prompts = [essay(tokenizer, n, skip=40 * i) for i, n in enumerate([300, 20, 60, 200])]
    methods = [("h2o", "0.5"), ("d2o-novelty", "0.3"), ("kvzip", "0.5")]
    expected = {(p, m): generate(model, tokenizer, p, m, b, max_new_tokens=6, min_tokens=16).texts[0]
                for p in prompts for m, b in methods}
    cap = 4 * plan(model.config, get_method("full"), Budget.parse(1.0), 300, 6).peak_bytes

    async def ask(api, prompt, method, budget):
        reply = await api.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0,
                                             extra_body={"kv_method": method, "kv_budget": budget})
        return prompt, method, reply.choices[0].text

    async def load(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as api:
            return await asyncio.gather(*[ask(api, p, m, b) for p in prompts for m, b in methods])

    with serving(model, tokenizer, kv_memory=cap, min_tokens=16, prefill_thread=True) as (url, _):
        replies = asyncio.run(load(url))
        metrics = wait_for(url, lambda m: m["d2o_kv_bytes"] == 0)
    assert {(p, m): text for p, m, text in replies} == expected
    assert metrics["d2o_kv_bytes"] == 0 and metrics["d2o_kv_bytes_reserved"] == 0
    assert 0 < metrics["d2o_kv_bytes_peak"] <= cap


def test_a_cap_that_holds_not_one_request_is_refused_at_start(real_model):
    with pytest.raises(D2OError, match="--kv-memory of 1,000 bytes holds not one request"):
        Engine(*real_model, ServeConfig(kv_memory=1000))


def test_a_default_max_tokens_takes_what_the_model_positions_leave(real_model):
    model, tokenizer = real_model
    limit = model.config.max_position_embeddings
    engine = Engine(model, tokenizer, ServeConfig(max_tokens=256, kv_memory=parse_bytes("4GB")))
    try:
        prompt = essay(tokenizer, limit - 100)
        job = engine.prepare(CompletionRequest(prompt=prompt), prompt, False, None, None)
        assert job.sequence.max_new_tokens == limit - len(job.ids) < 256
        short = engine.prepare(CompletionRequest(prompt="Hello"), "Hello", False, None, None)
        assert short.sequence.max_new_tokens == 256
        with pytest.raises(APIError, match="prompt too long for the model"):  # asked for: refused, as before
            engine.prepare(CompletionRequest(prompt=prompt, max_tokens=256), prompt, False, 256, None)
    finally:
        engine.close()


def test_a_client_that_disconnects_mid_stream_frees_its_rows_and_memory(server):
    url, _ = server
    before = scrape(url)
    gone = 'd2o_requests_total{budget="0.2",method="d2o",outcome="cancelled"}'
    request = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=request) as reply:
        events = [line for line, _ in zip((x for x in reply.iter_lines() if x.startswith("data:")), range(2))]
    assert len(events) == 2
    after = wait_for(url, lambda m: m.get(gone, 0) > before.get(gone, 0) and m["d2o_kv_bytes"] == 0)
    assert after[gone] == before.get(gone, 0) + 1
    assert after["d2o_kv_bytes"] == 0 and after["d2o_kv_bytes_reserved"] == 0
    assert not any(name.startswith("d2o_requests_running{") and value for name, value in after.items())

    with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up is cancelled too
        httpx.post(url + "/v1/completions", json={**request, "stream": False}, timeout=1.0)
    after = wait_for(url, lambda m: m[gone] == before.get(gone, 0) + 2 and m["d2o_kv_bytes"] == 0)
    assert after[gone] == before.get(gone, 0) + 2 and after["d2o_kv_bytes"] == 0


def test_a_stream_whose_task_is_cancelled_cancels_its_job(real_model):
    """Ray Serve cancels a request's task when its client goes; the stream's job was cancelled only
    by a background task that then never ran: it decoded on to max_tokens, holding its memory."""
    engine = Engine(*real_model, ServeConfig(kv_memory=parse_bytes("64MB")))
    app = create_app(engine)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def cancelled_mid_stream():
        chunks, asked, forever = [], [], asyncio.get_running_loop().create_future()

        async def receive():  # the body, then a client that never says it has gone
            if not asked:
                asked.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            return await forever

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])

        task = asyncio.create_task(app(scope, receive, send))
        while len(chunks) < 3:
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):  # the engine's next round drops the row
            if not engine.metrics()["requests_running"]:
                break
            await asyncio.sleep(0.05)
        return engine.metrics()

    try:
        metrics = asyncio.run(cancelled_mid_stream())
    finally:
        engine.close()
    assert metrics["requests_running"] == {} and metrics["kv_bytes"] == 0
    assert metrics["requests_total"] == {(("budget", "0.2"), ("method", "d2o"), ("outcome", "cancelled")): 1}
    assert metrics["generated_tokens_total"] < 1000


def test_a_row_that_has_not_merged_yet_runs_beside_rows_that_have(server, real_model):
    """D2O's merge counts appear at a cache's first merge: a short prompt (under the floor, nothing
    evicted) arriving while a long one decodes cannot join its batch, and runs beside it."""
    url, _ = server
    model, tokenizer = real_model
    long, short = essay(tokenizer, 300), "The capital of France is"

    def ask(prompt, tokens):
        return client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=tokens, temperature=0)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask, long, 40)
        wait_for(url, lambda m: m.get('d2o_requests_running{budget="0.2",method="d2o"}', 0) == 1)
        second = ask(short, 6)
    assert first.result().choices[0].text == generate(model, tokenizer, long, max_new_tokens=40).texts[0]
    assert second.choices[0].text == generate(model, tokenizer, short, max_new_tokens=6).texts[0]


@pytest.mark.parametrize("method, first_budget, second_budget, lengths", [
    ("d2o", 0.2, 0.2000001, (300, 200)),  # two budgets printed alike ("0.2"): other caches, never one batch
    ("d2o-official", 0.2, 0.2, (60, 20)),  # it allocates at its first decode step: a row just prefilled
])                                          # cannot join a lane that has stepped
def test_a_request_that_cannot_join_a_running_batch_runs_beside_it(server, real_model, method, first_budget,
                                                                   second_budget, lengths):
    """Either pair made the join fail, and the engine failed every request in flight with a 500."""
    url, _ = server
    model, tokenizer = real_model
    long, short = essay(tokenizer, lengths[0]), essay(tokenizer, lengths[1], skip=lengths[0])

    def ask(prompt, tokens, budget):
        return client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=tokens, temperature=0,
                                              extra_body={"kv_method": method, "kv_budget": budget})

    running = f'd2o_requests_running{{budget="0.2",method="{method}"}}'
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ask, long, 40, first_budget)
        wait_for(url, lambda m: m.get(running, 0) == 1)
        second = ask(short, 6, second_budget)
    assert first.result().choices[0].text == generate(model, tokenizer, long, method, first_budget,
                                                      max_new_tokens=40).texts[0]
    assert second.choices[0].text == generate(model, tokenizer, short, method, second_budget,
                                              max_new_tokens=6).texts[0]


def test_a_failure_inside_the_engine_is_a_500_and_the_server_keeps_serving(server, monkeypatch):
    url, _ = server
    step, broken = Batch.step, []

    def step_once_broken(self):
        if not broken:
            broken.append(True)
            raise RuntimeError("a bug")
        return step(self)

    monkeypatch.setattr(Batch, "step", step_once_broken)
    with pytest.raises(openai.InternalServerError) as failed:
        client(url).completions.create(model="smollm2", prompt="Hello", max_tokens=3)
    assert failed.value.status_code == 500 and "a bug" in failed.value.message
    assert client(url).completions.create(model="smollm2", prompt="Hello", max_tokens=3).usage.completion_tokens


def test_a_row_that_finished_in_a_step_whose_pass_then_failed_gets_its_answer(real_model, monkeypatch):
    """The short row finishes and leaves the batch; the forward pass for the others then fails:
    the short request still gets its whole answer, the others a 500, and each is counted once."""
    model, tokenizer = real_model
    engine = Engine(model, tokenizer, ServeConfig(kv_memory=parse_bytes("64MB"), method="full", budget="1.0"))
    armed, push, forward = {}, Sequence.push, model.forward

    def push_and_arm(self, token):
        done = push(self, token)
        armed["now"] = armed.get("now") or (done and self is armed["short"])
        return done

    def failing_forward(*args, **kwargs):
        if armed.pop("now", False):
            raise RuntimeError("out of memory")
        return forward(*args, **kwargs)

    monkeypatch.setattr(Sequence, "push", push_and_arm)
    monkeypatch.setattr(model, "forward", failing_forward)

    async def run():
        loop, jobs = asyncio.get_running_loop(), []
        for n in (3, 40):
            request = CompletionRequest(prompt=f"{n} words of a story:", max_tokens=n, temperature=0)
            jobs.append(engine.prepare(request, request.prompt, False, n, loop))
        armed["short"] = jobs[0].sequence
        for job in jobs:
            engine.submit(job)
        ends = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.events.get(), 60))[0] in ("started", "delta"):
                pass
            ends.append(event)
        return ends

    try:
        (short, short_result), (long, long_error) = asyncio.run(run())
        totals = engine.metrics()["requests_total"]
    finally:
        engine.close()
    assert (short, short_result.finish_reason, long, long_error.status) == ("done", "length", "error", 500)
    assert sorted((key[-1][1], count) for key, count in totals.items()) == [("failed", 1), ("finished", 1)]


def test_a_cancel_landing_between_two_reads_of_its_flag_keeps_lane_and_batch_alike(real_model):
    """A handler cancels while the engine drops the cancelled rows: the flag is read once, so the
    job leaves its lane and its row the batch together (at the next round), and no job is lost."""
    from d2o.engine.cache import CompressedCache
    from d2o.serve.jobs import Job, Lane

    class CancelledMidRound(Job):
        reads = 0

        @property
        def cancelled(self):  # False at the first read, True after: the handler's cancel lands between
            self.reads += 1
            return self.reads > 1

        @cancelled.setter
        def cancelled(self, value):
            pass

    model, tokenizer = real_model
    method, budget = get_method("full"), Budget.parse(1.0)
    ids = [tokenizer(text).input_ids for text in ("One story", "Another story")]
    sequences = [Sequence(None, 5), Sequence(None, 5)]
    batch = Batch.prefill(model, CompressedCache(model, method, budget), ids, sequences)
    gone, late = (cls(ids[i], sequences[i], method, budget, None, False, None) for i, cls in
                  enumerate((Job, CancelledMidRound)))
    gone.cancelled = True
    lane = Lane(batch, gone, [0])
    lane.jobs[id(late.sequence)] = late
    assert lane.drop_cancelled() == [gone]
    assert lane.rows() == [late] and batch.size == 1
    assert lane.drop_cancelled() == [late] and batch.size == 0 and not lane.jobs


# -- load and memory -------------------------------------------------------------------------------
LOAD_METHODS = [("full", 1.0), ("d2o", 0.2), ("h2o", 0.5), ("streamingllm", 0.3)]


def test_32_concurrent_requests_of_mixed_lengths_and_methods_each_get_their_own_answer(real_model):
    model, tokenizer = real_model
    prompts = [essay(tokenizer, n, skip=40 * i) for i, n in enumerate([10, 50, 20, 80, 30, 14, 64, 40])]
    expected = {}
    for method, budget in LOAD_METHODS:
        result = generate(model, tokenizer, prompts, method, budget, max_new_tokens=4, min_tokens=16)
        expected.update({(p, method): tokens for p, tokens in zip(prompts, result.new_tokens)})
    cap = 3 * plan(model.config, get_method("full"), Budget.parse(1.0), 90, 4).peak_bytes  # ~3 long ones at once

    async def ask(api, prompt, method, budget):
        reply = await api.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                             extra_body={"kv_method": method, "kv_budget": budget})
        return prompt, method, reply

    async def load(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as api:
            asks = [ask(api, p, m, b) for i, p in enumerate(prompts)
                    for m, b in LOAD_METHODS[i % 4:] + LOAD_METHODS[:i % 4]]
            return await asyncio.gather(*asks)

    with serving(model, tokenizer, kv_memory=cap, min_tokens=16, max_queue=32) as (url, _):
        replies = asyncio.run(load(url))
        metrics = scrape(url)
    assert len(replies) == 32
    for prompt, method, reply in replies:
        want = expected[(prompt, method)]
        assert reply.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), (method, prompt[:30])
        assert reply.usage.completion_tokens == len(want)
    outcomes = [v for k, v in metrics.items() if k.startswith("d2o_requests_total")]
    assert sum(outcomes) == 32 and all('outcome="finished"' in k for k, v in metrics.items()
                                       if k.startswith("d2o_requests_total") and v)
    assert metrics["d2o_kv_bytes_cap"] == cap
    assert cap / 3 < metrics["d2o_kv_bytes_peak"] <= cap  # the cap was reached for, never passed
    assert metrics["d2o_requests_waiting_peak"] >= 1  # some requests had to wait for memory
    assert max(v for k, v in metrics.items() if k.startswith("d2o_requests_running_peak")) >= 2  # batched
    assert metrics["d2o_generated_tokens_total"] == sum(len(t) for t in expected.values())


def test_a_cap_that_holds_two_full_caches_runs_eight_d2o_requests_at_once(real_model):
    model, tokenizer = real_model
    prompt, new = essay(tokenizer, 40, skip=500), 16
    full = plan(model.config, get_method("full"), Budget.parse(1.0), 40, new)
    d2o_key, full_key = '{budget="0.2",method="d2o"}', '{budget="1",method="full"}'
    request = dict(model="smollm2", prompt=prompt, max_tokens=new, temperature=0)

    async def burst(url, method, n):
        extra = {"kv_method": method, "kv_budget": 0.2}
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as api:
            return await asyncio.gather(*(api.completions.create(**request, extra_body=extra) for _ in range(n)))

    # No floor: at 40 tokens it would keep everything; at 20% a row holds 8 tokens per layer (+1, evicting at
    # every step: 8 slack slots would be as many again).
    with serving(model, tokenizer, kv_memory=2 * full.peak_bytes, min_tokens=0, max_queue=16,
                 evict_every=1) as (url, _):
        assert len(client(url).completions.create(**request).choices[0].text) > 0  # warm, and its shape
        d2o_replies = asyncio.run(burst(url, "d2o", 10))
        full_replies = asyncio.run(burst(url, "full", 3))
        metrics = scrape(url)
    assert all(r.usage.completion_tokens == new for r in d2o_replies + full_replies)  # nobody stopped early
    assert metrics["d2o_kv_fit_requests_full" + d2o_key] == 2
    assert metrics["d2o_kv_fit_requests" + d2o_key] >= 8
    assert metrics["d2o_requests_running_peak" + d2o_key] >= 8  # measured, not computed
    assert metrics["d2o_requests_running_peak" + full_key] == 2
    assert metrics["d2o_kv_bytes_peak"] <= 2 * full.peak_bytes


def test_a_server_storing_keys_at_4_bits_answers_as_generate_does_and_admits_by_the_packed_bytes(real_model):
    model, tokenizer = real_model
    prompt = essay(tokenizer, 400, skip=200)
    expected = generate(model, tokenizer, prompt, "d2o", 0.2, max_new_tokens=12, kv_bits=4).texts[0]
    with serving(model, tokenizer, kv_memory=parse_bytes("64MB"), kv_bits=4) as (url, _):
        reply = client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        metrics = scrape(url)
    assert reply.choices[0].text == expected
    tokens = reply.usage.prompt_tokens
    method, budget = get_method("d2o"), Budget.parse(0.2)
    quantized = plan(model.config, method, budget, tokens, 12, evict_every=8, kv_bits=4)
    unquantized = plan(model.config, method, budget, tokens, 12, evict_every=8)
    assert quantized.peak_bytes < unquantized.peak_bytes / 2
    assert metrics['d2o_kv_fit_requests{budget="0.2",method="d2o"}'] == fit(parse_bytes("64MB"), quantized)


@pytest.mark.parametrize("method, kv_bits", [("kvzip", None), ("d2o-novelty", None), ("kvzip", 4)])
def test_a_server_with_adaptive_heads_batches_rows_of_runs_within_their_bound(real_model, method, kv_bits, monkeypatch):
    """``--option METHOD.heads=adaptive``: every request of the method keeps counts per KV head. Rows
    of different lengths join one lane (each run padded to its widest row) only when the lane's bound
    (``joined_widths``), which the bytes it holds never pass, fits the cap; each answers as alone."""
    model, tokenizer = real_model
    prompts = [essay(tokenizer, n, skip=60 * i) for i, n in enumerate([90, 50, 140])]
    options = {method: {"heads": "adaptive"}}
    expected = [generate(model, tokenizer, prompt, method, 0.3, max_new_tokens=6, min_tokens=0, heads="adaptive",
                         evict_every=4, kv_bits=kv_bits).new_tokens[0] for prompt in prompts]
    held_and_bound = []
    bound = Lane.bound

    def checked(lane, newcomer=None, job=None):
        value = bound(lane, newcomer, job)
        if newcomer is None and lane.batch.sequences:
            held_and_bound.append((lane.batch.cache.nbytes, value, len(lane.jobs)))
        return value

    monkeypatch.setattr(Lane, "bound", checked)

    async def load(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as api:
            return await asyncio.gather(*(api.completions.create(
                model="smollm2", prompt=prompt, max_tokens=6, temperature=0, extra_body={"kv_method": method})
                for prompt in prompts))

    with serving(model, tokenizer, kv_memory=parse_bytes("64MB"), budget="0.3", min_tokens=0, evict_every=4,
                 kv_bits=kv_bits, method_options=options) as (url, engine):
        replies = asyncio.run(load(url))
        metrics = scrape(url)
    assert [reply.choices[0].text for reply in replies] == [tokenizer.decode(tokens, skip_special_tokens=True)
                                                             for tokens in expected]
    assert max(rows for _, _, rows in held_and_bound) >= 2  # rows of runs shared a lane
    assert all(held <= limit < 1.5 * held for held, limit, _ in held_and_bound)  # sound, and near what is held
    assert metrics[f'd2o_requests_running_peak{{budget="0.3",method="{method}"}}'] >= 2


def test_a_full_queue_answers_503_with_retry_after(real_model):
    model, tokenizer = real_model
    one = plan(model.config, get_method("full"), Budget.parse(1.0), 20, 200).peak_bytes
    request = {"model": "smollm2", "prompt": essay(tokenizer, 20), "max_tokens": 200, "temperature": 0}

    def gives_up(url):  # a client that waits 3 s, then leaves (the server notices and cancels it)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**request, "kv_method": "full"}, timeout=3)

    with serving(model, tokenizer, kv_memory=one, max_queue=1) as (url, _):
        clients = [threading.Thread(target=gives_up, args=(url,)) for _ in range(2)]  # one runs, one waits
        for thread in clients:
            thread.start()
        assert wait_for(url, lambda m: m["d2o_requests_waiting"] == 1)["d2o_requests_waiting"] == 1
        with pytest.raises(openai.InternalServerError) as refused:
            client(url).completions.create(**request, extra_body={"kv_method": "full"})
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"] == "1"
        assert refused.value.code == "overloaded" and "queue is full" in refused.value.message
        for thread in clients:
            thread.join()
        metrics = wait_for(url, lambda m: m["d2o_kv_bytes_reserved"] == 0 and m["d2o_requests_waiting"] == 0)
    assert metrics['d2o_requests_total{budget="1",method="full",outcome="rejected"}'] == 1
    assert metrics['d2o_requests_total{budget="1",method="full",outcome="cancelled"}'] == 2
    assert metrics["d2o_kv_bytes"] == 0


def test_a_client_that_gives_up_while_waiting_leaves_its_place_in_the_queue(real_model):
    """One request runs, one waits, a third waits behind it and gives up: its place is free at once
    (it was freed only when it reached the head of the queue: a fourth got 503 meanwhile)."""
    model, tokenizer = real_model
    one = plan(model.config, get_method("full"), Budget.parse(1.0), 20, 2000).peak_bytes
    request = {"model": "smollm2", "prompt": essay(tokenizer, 20), "max_tokens": 8, "temperature": 0,
               "kv_method": "full"}
    with serving(model, tokenizer, kv_memory=one, max_queue=2) as (url, _):
        with ThreadPoolExecutor(2) as pool:  # the first runs until its client leaves, 12 s on
            first = pool.submit(httpx.post, url + "/v1/completions", json={**request, "max_tokens": 2000}, timeout=12)
            wait_for(url, lambda m: m.get('d2o_requests_running{budget="1",method="full"}', 0) == 1)
            second = pool.submit(httpx.post, url + "/v1/completions", json=request, timeout=300)
            wait_for(url, lambda m: m["d2o_requests_waiting"] == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=request, timeout=1)
            metrics = wait_for(url, lambda m: m["d2o_requests_waiting"] == 1, seconds=5)
            assert metrics['d2o_requests_running{budget="1",method="full"}'] == 1  # the first still runs
            later = httpx.post(url + "/v1/completions", json=request, timeout=300)
            assert second.result().status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                first.result()
    assert later.status_code == 200, later.text  # before: 503, a place of the queue held by the client gone


# -- the command line ------------------------------------------------------------------------------
def test_a_device_map_loads_the_model_where_accelerate_puts_it(real_model):
    model, tokenizer = load_model("smollm2", device_map="cpu")
    assert generate(model, tokenizer, QUESTION, max_new_tokens=4).texts == generate(
        *real_model, QUESTION, max_new_tokens=4).texts
    with pytest.raises(D2OError, match="not both"):
        load_model("smollm2", device="cpu", device_map="auto")
    with pytest.raises(D2OError, match="device_map 'foo' must be one of auto, balanced, balanced_low_0, "
                                       "sequential or a device"):
        load_model("smollm2", device_map="foo")



def test_a_model_spread_over_devices_is_refused(monkeypatch, real_model):
    """The cache stacks its layers' budgets, statistics and merges: one device, or a clear error
    (not a device mismatch deep in torch at the end of the first prefill)."""
    from d2o import models

    def spread(*args, **kwargs):
        model = real_model[0]
        monkeypatch.setattr(model, "hf_device_map", {"model.layers.0": 0, "model.layers.29": "cpu"}, raising=False)
        return model

    monkeypatch.setattr(models, "_weights", spread)
    with pytest.raises(D2OError, match="device_map='auto' spread the model over 0, cpu; d2o's cache works on one"):
        load_model("smollm2", device_map="auto")


def test_memory_sizes():
    assert [parse_bytes(s) for s in ("512MB", "2GiB", "1.5GB", "4096", " 64 kib ")] == [
        512 * 10**6, 2 * 2**30, 1_500_000_000, 4096, 64 * 1024]
    for bad in ("12XB", "", "-1MB", "MB", "0"):
        with pytest.raises(D2OError):
            parse_bytes(bad)


@pytest.mark.parametrize("args, message", [  # (a bad --kv-memory or --budget: tests/test_errors.py)
    (["--method", "nope"], "unknown method 'nope'"),
    (["--budget", "2t"], "budget 2t leaves 2 tokens per layer"),
    (["--replicas", "-1"], "replicas must be >= 0"),
    (["--max-queue", "-1"], "max_queue must be >= 0"),
    (["--port", "99999"], "port 99999 must be in 1..65535"),
    (["--port", "0"], "port 0 must be in 1..65535"),
    (["--host", ""], "--host is empty"),
    (["--option", "kvzip.heads=uneven"], "heads='uneven' must be one of even, adaptive"),
    (["--option", "heads=adaptive"], "expected METHOD.NAME=VALUE"),
])
def test_bad_serve_options_are_one_line_and_exit_code_2(monkeypatch, capsys, args, message):
    monkeypatch.setattr("sys.argv", ["d2o", "serve", *args])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_port_already_taken_is_one_line_before_the_model_loads(monkeypatch, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        monkeypatch.setattr("sys.argv", ["d2o", "serve", "--port", str(port)])
        with pytest.raises(SystemExit) as done:
            main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_bench_serve_mixed_times_the_short_streams_gaps_prefilling_whole_in_chunks_and_on_a_thread(real_model):
    from d2o.bench.serve import bench_serve, workload

    model, tokenizer = real_model
    kinds = [conversation.long for conversation in workload(tokenizer, "mixed", 8, 300, 1, 1)]
    assert kinds == [True, False, False, False, True, False, False, False]  # taken from the end: every fourth
    rows = bench_serve(model, tokenizer, [("d2o-novelty", "0.2")], parse_bytes("256MB"), clients=3, requests=4,
                       prompt_tokens=300, max_tokens=6, kind="mixed", prefill_chunks=(None, 64),
                       prefill_threads=(False, True))
    assert [(row["prefill_chunk"], row["prefill_thread"], row["answered"]) for row in rows] == [
        ("whole", "no", 4), ("whole", "yes", 4), (64, "no", 4), (64, "yes", 4)]
    assert all(0 < row["itl_p50_ms"] <= row["itl_p99_ms"] for row in rows)


def test_bench_serve_runs_each_method_with_even_and_adaptive_heads(real_model):
    from d2o.bench.serve import bench_serve

    model, tokenizer = real_model
    rows = bench_serve(model, tokenizer, [("full", "1"), ("kvzip", "0.3")], parse_bytes("64MB"), clients=2,
                       requests=2, prompt_tokens=200, max_tokens=4, heads=("even", "adaptive"))
    assert [(row["method"], row["heads"], row["answered"]) for row in rows] == [
        ("full", "-", 2), ("kvzip", "even", 2), ("kvzip", "adaptive", 2)]


def test_metrics_parse_as_prometheus_text_with_a_histogram_per_request_timing(real_model):
    from prometheus_client.parser import text_string_to_metric_families

    model, tokenizer = real_model
    with serving(model, tokenizer, kv_memory=parse_bytes("64MB")) as (url, _):
        answers = [client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0,
                                                  extra_body={"kv_method": "h2o"}) for prompt in ("One", "Two")]
        text = httpx.get(url + "/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["d2o_requests"].type == "counter" and families["d2o_kv_bytes_cap"].type == "gauge"
    counts = {family: {sample.name: sample.value for sample in families[family].samples
                       if sample.name.endswith("_count") and sample.labels == {"budget": "0.2", "method": "h2o"}}
              for family in ("d2o_time_to_first_token_seconds", "d2o_inter_token_latency_seconds",
                             "d2o_request_latency_seconds")}
    tokens = sum(answer.usage.completion_tokens for answer in answers)
    assert counts == {"d2o_time_to_first_token_seconds": {"d2o_time_to_first_token_seconds_count": 2},
                      "d2o_inter_token_latency_seconds": {"d2o_inter_token_latency_seconds_count": tokens - 2},
                      "d2o_request_latency_seconds": {"d2o_request_latency_seconds_count": 2}}
