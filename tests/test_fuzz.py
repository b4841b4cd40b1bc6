"""The server's API under property-based fuzzing: schemathesis generates requests from its OpenAPI
schema (valid and invalid bodies of both endpoints) against a running server on a tiny model.

No response may be a 5xx, none may hang (each request has a deadline), and afterwards the server
still answers a greedy request exactly as the library does. ``make test`` runs a few seeded cases
per operation; ``D2O_FUZZ_EXAMPLES=300 pytest tests/test_fuzz.py`` the figures in
docs/benchmarks/fuzz.md.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from conftest import byte_tokenizer, tiny_model
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from d2o.runtime.generation import generate
from d2o.serve.app import create_app, serving
from d2o.serve.config import ServeConfig
from d2o.serve.engine import Engine

EXAMPLES = int(os.environ.get("D2O_FUZZ_EXAMPLES", "25"))
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
STATUSES: Counter = Counter()


def tiny_server():
    model, tokenizer = tiny_model("qwen3"), byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = ServeConfig(model="tiny", kv_memory=64 * 10**6, max_tokens=8, prefix_cache_memory=8 * 10**6)
    return model, tokenizer, Engine(model, tokenizer, config)


MODEL, TOKENIZER, ENGINE = tiny_server()
APP = create_app(ENGINE)
schema = schemathesis.openapi.from_dict(APP.openapi())


@pytest.fixture(scope="module")
def url():
    with serving(APP) as running:
        yield running
    ENGINE.close()


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error_or_hangs(case, url):
    response = case.call(base_url=url, timeout=60)
    STATUSES[(case.operation.label, response.status_code)] += 1
    case.validate_response(response, checks=(not_a_server_error,))


def test_the_server_still_answers_as_the_library_after_the_fuzzing(url):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                      "kv_method": "h2o", "kv_budget": 0.5}, timeout=60).json()
    expected = generate(MODEL, TOKENIZER, prompt, "h2o", 0.5, max_new_tokens=6)
    assert reply["choices"][0]["text"] == expected.texts[0]
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    print("\nstatus codes by operation:", dict(sorted(STATUSES.items())))
