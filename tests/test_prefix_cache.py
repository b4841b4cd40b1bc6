"""The server's compressed prefix cache, end to end through the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import client, essay, scrape, serving

import d2o
from d2o.errors import D2OError
from d2o.options import parse_bytes
from d2o.runtime.context import compress, conversation_ids
from d2o.runtime.generation import generate
from d2o.runtime.memory import shareable, shared_plan, slot_bytes
from d2o.runtime.prompts import encode
from d2o.serve.config import ServeConfig

pytestmark = pytest.mark.real_model


def ask(url: str, messages: list[dict], method: str = "d2o-novelty"):
    return client(url).chat.completions.create(model="smollm2", messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"kv_method": method, "kv_budget": 0.2})


def test_a_chat_reuses_its_compressed_turns_and_answers_as_the_library_does(real_model):
    model, tokenizer = real_model
    document = [{"role": "system", "content": "Answer from this document.\n\n" + essay(tokenizer, 400)}]
    first_question = {"role": "user", "content": "What is the document about?"}
    second_question = {"role": "user", "content": "Who wrote it?"}
    context = compress(model, tokenizer, document, "d2o-novelty", 0.2, chat=True)
    with serving(model, tokenizer, kv_memory=parse_bytes("256MB"), prefix_cache_memory=parse_bytes("64MB")) as (url, _):
        first = ask(url, document + [first_question])  # nothing kept yet: the document is compressed, then kept
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert first.choices[0].message.content == context.ask(first_question["content"], 10).text
        values = scrape(url)
        assert values["d2o_prefix_cache_entries"] == 1 and values["d2o_prefix_cache_misses_total"] == 1
        assert values["d2o_prefix_cache_bytes"] == context.nbytes

        again = ask(url, document + [second_question])  # another question on the kept document
        assert again.usage.prompt_tokens_details.cached_tokens == len(context.ids) > 128
        assert again.choices[0].message.content == context.ask(second_question["content"], 10).text

        # The chat's next turn: the kept document, extended by the first exchange (kept too), then the question.
        answer = {"role": "assistant", "content": first.choices[0].message.content}
        turn = ask(url, document + [first_question, answer, second_question])
        assert turn.usage.prompt_tokens_details.cached_tokens == len(context.ids)
        extended = context.extend([first_question, answer])
        assert turn.choices[0].message.content == extended.ask(second_question["content"], 10).text
        values = scrape(url)
        assert values["d2o_prefix_cache_entries"] == 2 and values["d2o_prefix_cache_hits_total"] == 2
        assert values["d2o_prompt_tokens_cached_total"] == 2 * len(context.ids)
        assert values["d2o_prefix_cache_bytes"] == context.nbytes + extended.nbytes
        assert values["d2o_kv_bytes"] >= values["d2o_prefix_cache_bytes"]  # counted under the cap


def test_kept_prefixes_are_evicted_least_recently_used_within_their_memory(real_model):
    model, tokenizer = real_model
    documents = [[{"role": "system", "content": essay(tokenizer, 300, skip=1000 * i)}] for i in range(3)]
    one = compress(model, tokenizer, documents[0], "d2o-novelty", 0.2, chat=True).nbytes
    question = {"role": "user", "content": "Summarise."}
    with serving(model, tokenizer, kv_memory=parse_bytes("256MB"), prefix_cache_memory=int(one * 2.5)) as (url, _):
        for document in documents[:2]:
            ask(url, document + [question])
        ask(url, documents[0] + [question])  # used again: documents[1] is now the least recently used
        ask(url, documents[2] + [question])
        values = scrape(url)
        assert values["d2o_prefix_cache_entries"] == 2 and values["d2o_prefix_cache_evictions_total"] == 1
        assert ask(url, documents[0] + [question]).usage.prompt_tokens_details.cached_tokens > 0
        assert ask(url, documents[1] + [question]).usage.prompt_tokens_details.cached_tokens == 0


def test_a_request_that_fits_only_without_the_kept_prefixes_evicts_them_rather_than_waiting_forever(real_model):
    """Nothing running, nothing admitted: the kept documents are all that stands between the queue's
    head and the cap, and nothing else would ever free memory; they are evicted for it."""
    model, tokenizer = real_model
    document = [{"role": "system", "content": essay(tokenizer, 300)}, {"role": "user", "content": "Summarise."}]
    kept = compress(model, tokenizer, document[:1], "d2o-novelty", 0.2, chat=True).nbytes
    prompt = essay(tokenizer, 600, skip=2000)
    method, budget = d2o.get_method("d2o-novelty"), d2o.Budget.parse(0.2)
    with serving(model, tokenizer, kv_memory=parse_bytes("256MB")) as (_, engine):
        ids = encode(tokenizer, [prompt], False)[0]
        alone = engine._plan(method, budget, len(ids), 4).peak_bytes
    cap = alone + kept // 2  # the long prompt fits alone, not beside the kept document
    with serving(model, tokenizer, kv_memory=cap, prefix_cache_memory=2 * kept) as (url, _):
        ask(url, document)
        assert scrape(url)["d2o_prefix_cache_entries"] == 1
        reply = client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                               extra_body={"kv_method": "d2o-novelty", "kv_budget": 0.2})
        values = scrape(url)
    assert reply.usage.completion_tokens == 4
    assert values["d2o_prefix_cache_entries"] == 0 and values["d2o_prefix_cache_evictions_total"] == 1
    assert values["d2o_kv_bytes_peak"] <= cap


def test_without_a_prefix_cache_nothing_is_kept_and_short_turns_are_never_kept(real_model):
    model, tokenizer = real_model
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert len(conversation_ids(tokenizer, short[:1])) < 128
    with serving(model, tokenizer, kv_memory=parse_bytes("128MB")) as (url, _):
        long = [{"role": "system", "content": essay(tokenizer, 300)}, {"role": "user", "content": "Summarise."}]
        assert ask(url, long).usage.prompt_tokens_details.cached_tokens == 0
        assert ask(url, long).usage.prompt_tokens_details.cached_tokens == 0
        assert scrape(url)["d2o_prefix_cache_entries"] == 0
    with serving(model, tokenizer, kv_memory=parse_bytes("128MB"), prefix_cache_memory=parse_bytes("32MB")) as (url,
                                                                                                              _):
        ask(url, short)
        assert scrape(url)["d2o_prefix_cache_entries"] == 0


def test_the_prefix_memory_must_leave_room_for_requests():
    with pytest.raises(D2OError, match="--prefix-cache-memory .* is part of --kv-memory"):
        ServeConfig(kv_memory=1000, prefix_cache_memory=1000).check()


def test_a_server_evicting_in_batches_of_steps_answers_as_the_library_does(real_model):
    model, tokenizer = real_model
    prompt = essay(tokenizer, 400)
    with serving(model, tokenizer, kv_memory=parse_bytes("128MB"), evict_every=8) as (url, engine):
        reply = client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"kv_method": "d2o", "kv_budget": 0.2})
        expected = generate(model, tokenizer, prompt, "d2o", 0.2, max_new_tokens=12, evict_every=8)
        assert reply.choices[0].text == expected.texts[0]
        assert reply.usage.kv_tokens == expected.report.kv_tokens_kept
        assert engine.evict_every == 8
    with pytest.raises(D2OError, match="evict_every must be at least 1"):
        ServeConfig(evict_every=0).check()


def test_eight_concurrent_questions_on_a_kept_document_hold_it_once(real_model):
    """Requests on a kept document read its compressed keys and values in place: eight running at once
    hold them once (the gauge counts what the prefix cache and the lane share once), beside their own
    tokens, and each answers as the library does."""
    model, tokenizer = real_model
    document = [{"role": "system", "content": "Answer from this document.\n\n" + essay(tokenizer, 700)}]
    questions = [{"role": "user", "content": f"What does part {i + 1} of the document say{'?' * (i + 1)}"}
                 for i in range(8)]
    context = compress(model, tokenizer, document, "d2o-novelty", 0.2, chat=True)
    method = d2o.get_method("d2o-novelty")
    per_slot, per_vector = (slot_bytes(model.config, 4, method, stock=stock) for stock in (False, True))
    plans = [shared_plan(context.cache, len(context.question_ids(q["content"])), 10, per_slot, per_vector).held_bytes
             for q in questions]
    with serving(model, tokenizer, kv_memory=parse_bytes("256MB"), prefix_cache_memory=parse_bytes("32MB")) as (url, _):
        ask(url, document + [{"role": "user", "content": "Summarise."}])  # compressed, then kept
        kept = scrape(url)["d2o_kv_bytes"]
        assert kept == context.nbytes
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda question: ask(url, document + [question]), questions))
        values = scrape(url)
    assert [a.choices[0].message.content for a in answers] == [context.ask(q["content"], 10).text for q in questions]
    assert all(a.usage.prompt_tokens_details.cached_tokens == len(context.ids) for a in answers)
    assert max(v for k, v in values.items() if k.startswith("d2o_requests_running_peak")) == 8
    # The document once, beside each request's own tokens and its bookkeeping of the document's slots
    # (what admission reserves for it, and one more request's while it is fed): under half of 8 copies.
    assert values["d2o_kv_bytes_peak"] <= kept + sum(plans) + max(plans)
    assert values["d2o_kv_bytes_peak"] < 0.5 * 8 * kept


@pytest.mark.parametrize("method, share_prefixes, kv_bits, heads", [
    ("d2o-novelty", False, None, "even"), ("d2o-novelty", True, 4, "even"), ("d2o-novelty", True, 4, "adaptive"),
    ("kvzip", True, None, "adaptive")])
def test_a_server_on_kept_documents_answers_alike(real_model, method, share_prefixes, kv_bits, heads):
    """Each request copies the kept document when told to (``share_prefixes=False``, ``bench serve
    --prefix-sharing copied``) or when its layers cannot be read in place (keys stored quantized, a
    run of slots per KV head of a method that evicts while decoding), and reads it in place
    otherwise (runs of ``kvzip``, which evicts nothing once compressed); the answers are the
    library's."""
    model, tokenizer = real_model
    document = [{"role": "system", "content": "Answer from this document.\n\n" + essay(tokenizer, 300)}]
    questions = [{"role": "user", "content": "What is it about?"}, {"role": "user", "content": "Who wrote it?"}]
    context = compress(model, tokenizer, document, method, 0.2, chat=True, kv_bits=kv_bits, heads=heads)
    assert shareable(context.cache) == (kv_bits is None and (heads == "even" or method == "kvzip"))
    with serving(model, tokenizer, kv_memory=parse_bytes("256MB"), prefix_cache_memory=parse_bytes("32MB"),
                 share_prefixes=share_prefixes, kv_bits=kv_bits,
                 method_options={method: {"heads": heads}}) as (url, _):
        answers = [ask(url, document + [question], method) for question in questions]
    assert answers[1].usage.prompt_tokens_details.cached_tokens == len(context.ids)
    assert [a.choices[0].message.content for a in answers] == [context.ask(q["content"], 10).text for q in questions]
