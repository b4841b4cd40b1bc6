"""The floor under ratio budgets: short prompts are never compressed, long ones keep a minimum."""

import pytest
import torch

from d2o import Budget, D2OError, get_method
from d2o.budget import MIN_TOKENS
from conftest import CHOSEN as METHODS, greedy, make_cache, random_ids, tiny_model


@pytest.mark.parametrize("name", METHODS)
def test_a_short_prompt_at_the_default_budget_answers_as_the_full_cache(name):
    model = tiny_model("llama")
    prompt = random_ids(40)
    steps = 24  # 40 + 23 tokens fed: below the floor, never compressed
    full = greedy(model, prompt, make_cache(model, "full", 1.0), steps=steps)
    cache = make_cache(model, name, 0.2, min_tokens=MIN_TOKENS)
    assert greedy(model, prompt, cache, steps=steps).tolist() == full.tolist()
    report = cache.report()
    assert report.kv_tokens_kept == report.kv_tokens_full  # nothing was evicted
    if not cache.policy.keeps_everything:  # the floor set every layer's budget but those exempt
        assert report.min_tokens == MIN_TOKENS and report.floor_layers == 4 - len(cache.policy.exempt_of(4))


def test_a_row_below_the_floor_grows_to_it_then_holds_it():
    model = tiny_model("qwen2")
    cache = make_cache(model, "h2o", 0.2, min_tokens=48)
    greedy(model, random_ids(30), cache, steps=40)  # 30 + 39 tokens fed
    assert [int(layer.n_kept) for layer in cache.layers] == [48] * 4
    assert cache.report().layer_budgets == [48] * 4


def test_the_floor_raises_the_total_and_the_smallest_layers_of_a_long_prompt():
    model = tiny_model("llama", num_hidden_layers=6)
    cache = make_cache(model, "d2o", 0.1, min_tokens=40)
    with torch.inference_mode():
        model(input_ids=random_ids(300), cache=cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert sum(budgets) == Budget(ratio=0.1, min_tokens=40).total(6, 300) == 6 * 40  # 0.1 * 300 = 30 < 40
    assert budgets == [40] * 6
    cache = make_cache(model, "d2o", 0.3, min_tokens=40)
    with torch.inference_mode():
        model(input_ids=random_ids(300), cache=cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert sum(budgets) == round(6 * 0.3 * 300) and min(budgets) >= 40
    assert cache.report().floor_layers == budgets.count(40)


def test_token_budgets_have_no_floor():
    budget = Budget.parse("10t", min_tokens=64)
    assert budget.floor(1000) == 0 and budget.total(4, 1000) == 40
    model = tiny_model("llama")
    cache = make_cache(model, "h2o", "10t", min_tokens=64)
    with torch.inference_mode():
        model(input_ids=random_ids(100), cache=cache)
    assert [layer.keys.shape[2] for layer in cache.layers] == [10] * 4
    assert cache.report().min_tokens is None


@pytest.mark.parametrize("name, floor, message", [
    ("snapkv", 20, "min_tokens=20 is too low a floor: snapkv needs at least 33 (window 32 + 0 sinks + 1)"),
    ("d2o", 3, "min_tokens=3 is too low a floor: d2o needs at least 5 (4 sinks + 1)"),
])
def test_a_floor_below_the_methods_own_minimum_is_refused(name, floor, message):
    with pytest.raises(D2OError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        get_method(name).check_budget(Budget.parse("0.2", min_tokens=floor))
    with pytest.raises(D2OError, match="min_tokens must be a whole number from 0 to 2"):
        Budget.parse("0.2", min_tokens=-1)


def test_the_full_cache_is_reported_without_a_budget():
    model = tiny_model("llama")
    cache = make_cache(model, "full", 0.2)
    with torch.inference_mode():
        model(input_ids=random_ids(100), cache=cache)
    report = cache.report()
    assert report.budget is None and report.min_tokens is None
    assert report.summary().startswith("full: 400 of 400 KV tokens")
