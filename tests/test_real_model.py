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
    if method == "full":
        assert report.kv_tokens_kept == report.kv_tokens_full
    else:  # 7 decode steps, evicting every 8 (the default): every layer is 7 tokens over its budget
        assert [layer.kept[0] for layer in report.layers] == [budget + 7 for budget in report.layer_budgets]


def test_d2o_budgets_on_the_real_model(real_model, passkey):
    model, tokenizer = real_model
    result = generate(model, tokenizer, passkey.text, "d2o", 0.2, max_new_tokens=4, evict_every=1)
    report = result.report
    prompt = result.prompt_tokens[0]
    assert sum(report.layer_budgets) == round(30 * 0.2 * prompt)
    assert len(set(report.layer_budgets)) > 3  # layers really differ
    assert report.kv_bytes == (report.kv_tokens_kept + 30) * 3 * 64 * 2 * 4  # + each layer's free slot
    assert report.kv_bytes < 0.21 * report.kv_bytes_full


def test_kvzip_with_a_count_per_kv_head_keeps_the_passkey_in_the_even_layouts_bytes(real_model, passkey):
    import d2o

    model, tokenizer = real_model
    even = generate(model, tokenizer, passkey.text, "kvzip", 0.2, max_new_tokens=8)
    adaptive = generate(model, tokenizer, passkey.text, d2o.get_method("kvzip", heads="adaptive"), 0.2,
                        max_new_tokens=8)
    assert passkey_score(adaptive.texts[0], passkey.key) == 1.0, adaptive.texts[0]
    assert adaptive.report.kv_bytes == even.report.kv_bytes
    assert adaptive.report.layer_budgets == even.report.layer_budgets


@pytest.mark.parametrize("method", ["d2o", "snapkv", "h2o"])
def test_a_short_chat_question_keeps_its_answer_at_the_default_budget(monkeypatch, capsys, real_model, method):
    """The chat template alone is 30-odd tokens: under the floor, nothing of it is evicted."""
    import json
    import sys

    from d2o.cli import main

    monkeypatch.setattr(sys, "argv", ["d2o", "generate", "--chat", "--prompt", "What is the capital of France?",
                                      "--method", method, "--max-new-tokens", "12", "--json"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["text"]
    assert result["budget"] == "0.2" and result["min_tokens"] == 128 and result["floor_layers"] == 30
    assert result["kv_tokens_kept"] == result["kv_tokens_full"]


def test_quantized_keys_and_values_keep_the_passkey_in_a_fraction_of_the_bytes(real_model, passkey):
    model, tokenizer = real_model
    plain = generate(model, tokenizer, passkey.text, "full", 1.0, max_new_tokens=8)
    eight = generate(model, tokenizer, passkey.text, "full", 1.0, max_new_tokens=8, kv_bits=8)
    assert eight.texts == plain.texts  # greedy answers equal at 8 bits
    four = generate(model, tokenizer, passkey.text, "d2o-plus", 0.2, max_new_tokens=8, kv_bits=4)
    assert passkey_score(four.texts[0], passkey.key) == 1.0, four.texts[0]
    report = four.report
    parts = report.kv_parts
    assert report.kv_bytes == sum(parts.values())
    # Per token and KV head 32 bytes of levels and 8 of steps and zero points, against 256 in float32.
    # After 7 decode steps each layer holds budget + 7 tokens in budget + 8 slots (evicting every 8).
    slots = sum(layer.kept[0] + 1 for layer in report.layers)
    assert parts["levels"] == slots * 3 * 2 * 32 and parts["scales"] == slots * 3 * 2 * 8
    assert report.kv_bytes < 0.07 * report.kv_bytes_full
