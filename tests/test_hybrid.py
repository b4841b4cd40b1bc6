"""Hybrid attention (Gemma 3): sliding-window layers keep their window as the stock cache does;
methods compress the global layers, sharing the budget among them."""

import pytest
import torch
from transformers import DynamicCache

from d2o import Budget, get_method
from conftest import (CHOSEN, assert_fed_at_once_as_one_by_one, greedy, kept_tokens, left_pad, make_cache, random_ids,
                      tiny_model)

WINDOW, SLIDING, GLOBAL = 16, [0, 2], [1, 3]
# A method that exempts layers by default (d2o-official: 0, 1 and the last) would exempt both global ones.
METHODS = [name for name in CHOSEN if not get_method(name).exempt_layers]


def forward(model, ids, cache):
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache).logits


def stored(cache):
    return [layer.keys.shape[2] for layer in cache.layers]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_budget_one_equals_the_stock_model_and_its_cache_sizes(attention):
    model = tiny_model("gemma3", attention=attention)
    ids, follow = random_ids(60), random_ids(12, seed=4)
    cache = make_cache(model, "d2o", 1.0)
    ours = [forward(model, ids, cache)]
    assert stored(cache) == [15, 60, 15, 60]  # the window's newest 15 tokens, and every token
    ours += [forward(model, follow[:, i:i + 1], cache) for i in range(12)]
    ours.append(forward(model, random_ids(5, seed=6), cache))  # a multi-token input
    model.set_attn_implementation(attention)
    reference = DynamicCache(config=model.config)
    stock = [forward(model, ids, reference)] + [forward(model, follow[:, i:i + 1], reference) for i in range(12)]
    stock.append(forward(model, random_ids(5, seed=6), reference))
    for a, b in zip(ours, stock):  # sliding layers are masked as the stock's: the same logits, not the same bits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [layer.keys.shape[2] for layer in reference.layers] == [15, 77, 15, 77]
    assert [int(layer.n_kept) for layer in cache.layers] == [15, 77, 15, 77]


@pytest.mark.parametrize("name", METHODS)
def test_every_method_compresses_the_global_layers_and_a_batch_equals_its_rows(name):
    model = tiny_model("gemma3", dtype=torch.float64)
    prompts = [random_ids(n, seed=n)[0] for n in (140, 96, 120)]
    ids, mask = left_pad(prompts)
    batch_cache = make_cache(model, name, 0.5)
    batched = greedy(model, ids, batch_cache, steps=20, mask=mask)
    for row, prompt in enumerate(prompts):
        cache = make_cache(model, name, 0.5)
        alone = greedy(model, prompt[None], cache, steps=20)
        assert batched[row].tolist() == alone[0].tolist()
        for mine, theirs in zip(batch_cache.layers, cache.layers):
            assert kept_tokens(mine, row) == kept_tokens(theirs, 0)
        seen = len(prompt) + 19
        for index in SLIDING:  # the window, never a method's choice
            assert kept_tokens(cache.layers[index], 0) == [list(range(seen - WINDOW + 1, seen))] * 2
        budgets = [int(cache.layers[i].budget) for i in GLOBAL]
        if name != "full":
            assert sum(budgets) == Budget(ratio=0.5, min_tokens=0).total(len(GLOBAL), len(prompt))
        report = cache.report()
        assert report.global_layers == GLOBAL
        assert [layer.window for layer in report.layers] == [WINDOW, None, WINDOW, None]
        assert [layer.full[0] for layer in report.layers] == [WINDOW - 1, seen, WINDOW - 1, seen]


def test_a_question_after_compression_sees_the_right_tokens_in_both_kinds_of_layers():
    model = tiny_model("gemma3", dtype=torch.float64)
    cache = make_cache(model, "d2o", 0.2)
    forward(model, random_ids(120), cache)
    question = random_ids(9, seed=5)
    assert_fed_at_once_as_one_by_one(model, cache, question)
    forward(model, question, cache)
    assert stored(cache)[0] == stored(cache)[2] == WINDOW - 1
    assert [int(cache.layers[i].n_kept) for i in GLOBAL] == [int(cache.layers[i].budget) for i in GLOBAL]


def most_held(model, method, budget, prompt: int, new: int) -> int:
    """The most bytes the cache holds while a prompt is prefilled and ``new`` tokens generated."""
    from d2o.engine.cache import CompressedCache

    cache = CompressedCache(model, method, budget)
    most = 0
    with torch.inference_mode():
        logits = model(input_ids=random_ids(prompt), cache=cache).logits
        for _ in range(new - 1):  # the last token generated is never fed
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
            most = max(most, cache.nbytes)
    return most


@pytest.mark.parametrize("name", ["h2o", "full"])
def test_the_memory_plan_counts_sliding_layers_at_their_window(name):
    from d2o import get_method
    from d2o.runtime.memory import plan

    model = tiny_model("gemma3")
    method, budget = get_method(name), Budget(ratio=0.3, min_tokens=0)
    need = plan(model.config, method, budget, 100, 20)
    # Per KV head (2): K and V, the token index (int32) and, in a global layer, h2o's mass per query head.
    sliding, slot = 2 * (2 * 16 * 4 + 4), 2 * (2 * 16 * 4 + 4 + (8 if name == "h2o" else 0))
    assert need.prefill_bytes == 2 * 100 * sliding + 2 * 100 * slot
    most = most_held(model, method, budget, 100, 20)
    assert most == need.held_bytes - (slot * 2 if name == "full" else 0)  # full never feeds its last token


@pytest.mark.parametrize("exempt", [(0,), (1,), (0, 3)])
def test_the_memory_plan_reads_exempt_layers_as_the_allocation_does(exempt):
    """Model layer indices: a sliding layer (0) exempts nothing, a global one (1, 3) keeps its whole
    sequence. The plan read them as positions among the global layers (0 meant layer 1)."""
    from d2o import get_method
    from d2o.runtime.memory import plan

    model = tiny_model("gemma3")
    method, budget = get_method("h2o", exempt_layers=exempt), Budget(ratio=0.7, min_tokens=0)
    held = plan(model.config, method, budget, 100, 20).held_bytes
    exempt_global = len(set(exempt) & {1, 3})  # planned at the whole sequence, whose last token is never fed
    assert most_held(model, method, budget, 100, 20) == held - exempt_global * 2 * (2 * 16 * 4 + 4 + 8)


def test_a_model_sliding_in_every_layer_keeps_its_window_and_refuses_compression():
    # Mistral 7B v0.1's kind of config: a sliding_window and no layer_types, so every layer slides.
    from d2o import D2OError
    from d2o.methods import get_method
    from d2o.runtime.memory import plan

    model = tiny_model("mistral", sliding_window=WINDOW)
    ids, follow = random_ids(40), random_ids(6, seed=4)
    cache = make_cache(model, "full", 1.0)
    ours = [forward(model, ids, cache)] + [forward(model, follow[:, i:i + 1], cache) for i in range(6)]
    model.set_attn_implementation("sdpa")
    reference = DynamicCache(config=model.config)
    stock = [forward(model, ids, reference)] + [forward(model, follow[:, i:i + 1], reference) for i in range(6)]
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [int(layer.n_kept) for layer in cache.layers] == [layer.keys.shape[2] for layer in reference.layers] \
        == [WINDOW - 1] * len(cache.layers)
    with pytest.raises(D2OError, match="every layer of this model attends over a sliding window of 16 tokens"):
        make_cache(model, "d2o", 0.5)
    with pytest.raises(D2OError, match="every layer of this model attends over a sliding window"):
        plan(model.config, get_method("h2o"), Budget.parse(0.5), 40, 8)
