"""End to end on the embedded SmolLM2-135M-Instruct (a real pretrained GQA Llama)."""

import random

import pytest

from d2o.data import essays
from d2o.eval.tasks.passkey import make_passkey_prompt, passkey_score
from d2o.runtime.generation import generate


@pytest.fixture(scope="module")
def passkey(real_model):
    _, tokenizer = real_model
    return make_passkey_prompt(tokenizer, essays(), 1000, random.Random(2026))


@pytest.mark.parametrize("method, budget", [("full", 1.0), ("d2o", 0.5)])
def test_passkey_is_retrieved(real_model, passkey, method, budget):
    model, tokenizer = real_model
    assert 950 <= passkey.n_tokens <= 1050
    result = generate(model, tokenizer, passkey.text, method, budget, max_new_tokens=8)
    assert passkey_score(result.texts[0], passkey.key) == 1.0, result.texts[0]
    report = result.report
    assert report.kv_tokens_kept == sum(report.layer_budgets) if method != "full" else report.kv_tokens_full


def test_d2o_budgets_on_the_real_model(real_model, passkey):
    model, tokenizer = real_model
    result = generate(model, tokenizer, passkey.text, "d2o", 0.2, max_new_tokens=4)
    report = result.report
    prompt = result.prompt_tokens[0]
    assert sum(report.layer_budgets) == round(30 * 0.2 * prompt)
    assert len(set(report.layer_budgets)) > 3  # layers really differ
    assert report.kv_bytes == report.kv_tokens_kept * 3 * 64 * 2 * 4
    assert report.kv_bytes < 0.21 * report.kv_bytes_full
