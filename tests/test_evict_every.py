"""Eviction in batches of decode steps (``CompressedCache(evict_every=k)``): a layer runs up to
k - 1 tokens over its budget, then one pass brings it back, in place."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, greedy, left_pad, make_cache, random_ids, tiny_model

import d2o
from d2o.runtime.memory import peak_slots, plan


def decode(model, cache, prompt: int, steps: int, seed: int = 1):
    """Greedy decode; yields the cache after every step."""
    with torch.inference_mode():
        logits = model(input_ids=random_ids(prompt, seed=seed), cache=cache).logits
        for _ in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
            yield cache


@pytest.mark.parametrize("method", ["h2o", "d2o", "d2o-plus", "d2o-novelty", "streamingllm"])
def test_a_layer_runs_over_its_budget_by_less_than_k_and_is_evicted_in_place(method):
    model, k = tiny_model("qwen2"), 4
    cache = make_cache(model, method, 0.25)
    cache.schedule.evict_every = k
    over, storage = [], []
    for state in decode(model, cache, 100, 3 * k + 2):
        layers = [layer for layer in state.layers if layer.budget is not None]
        over.append([int(layer.n_kept[0] - layer.budget[0]) for layer in layers])
        storage.append([layer.keys for layer in layers])
    # Every layer: 1, 2, 3 over, then back to its budget exactly at the k-th step, again and again.
    assert [set(row) for row in over] == [{(step + 1) % k} for step in range(len(over))]
    # Compressed after the prefill to budget + k slots, no step copies a layer's keys: the empty ones
    # and then the evicted ones are written into.
    for before, after in zip(storage, storage[1:]):
        assert all(a is b for a, b in zip(before, after))


def test_the_memory_plan_counts_the_k_slack_slots_and_is_tight():
    model, k = tiny_model("llama"), 8
    method, budget = d2o.get_method("d2o"), d2o.Budget(ratio=0.3, min_tokens=0)
    cache = d2o.CompressedCache(model, method, budget, evict_every=k)
    most, peaks = 0, None
    for state in decode(model, cache, 120, 30):
        if peaks is None:
            peaks = peak_slots(state, 30)
        most = max(most, state.nbytes)
    need = plan(model.config, method, budget, 120, 31, dtype_bytes=4, evict_every=k)
    assert most == need.held_bytes  # budget + k slots in every layer, the slack filled before each eviction
    assert plan(model.config, method, budget, 120, 31, dtype_bytes=4).held_bytes < most
    widths = torch.tensor([layer.keys.shape[2] for layer in cache.layers])
    assert torch.equal(peaks[0], widths)


def test_rows_of_a_batch_evict_on_their_own_steps_and_answer_as_alone():
    model, tokenizer = tiny_model("mistral"), byte_tokenizer()
    prompts = ["The quick brown fox jumps over the lazy dog. " * 4, "A short prompt, then more words. " * 7]
    together = d2o.generate(model, tokenizer, prompts, "d2o", d2o.Budget(ratio=0.3, min_tokens=0),
                            max_new_tokens=20, evict_every=4)
    alone = [d2o.generate(model, tokenizer, p, "d2o", d2o.Budget(ratio=0.3, min_tokens=0), max_new_tokens=20,
                          evict_every=4).new_tokens[0] for p in prompts]
    assert together.new_tokens == alone
    assert sum(layer.merged[0] for layer in together.report.layers) > 0  # D2O merged what it evicted in batches


def test_a_bad_evict_every_is_refused():
    with pytest.raises(d2o.D2OError, match="evict_every=0 must be a whole number of steps >= 1"):
        d2o.CompressedCache(tiny_model(), d2o.get_method("h2o"), 0.2, evict_every=0)


def test_fit_packs_rows_that_evict_in_batches_under_the_cap_with_their_slack():
    from d2o.bench.fit import bench_fit
    from d2o.bench.models import random_model

    tiny = random_model("tiny", positions=512)
    prompt, generate, budget = 96, 24, d2o.Budget(ratio=0.2, min_tokens=8)
    cap = 4 * plan(tiny.config, d2o.get_method("full"), d2o.Budget(ratio=1.0), prompt, generate).held_bytes
    rows = {k: bench_fit(tiny, None, cap, prompt, generate, ["h2o"], budget, 4, evict_every=k)[0] for k in (1, 8)}
    for row in rows.values():
        assert row["peak_kv_mib"] <= row["planned_kv_mib"] <= round(cap / 2**20, 1)
    assert rows[8]["batch"] < rows[1]["batch"]  # eight slack slots a layer take room a row would have


@pytest.mark.parametrize("method", ["d2o", "d2o-plus", "d2o-plus-words"])
def test_the_steps_that_skip_counting_and_votes_change_nothing(method):
    """Between evictions a step neither counts what the layers hold nor computes the votes of its
    query (only an eviction reads them): the same tokens, and at every eviction the same slots and
    state, as a cache made to count and vote at every step."""
    model, k = tiny_model("llama"), 4
    runs = []
    for skipping in (True, False):
        cache = make_cache(model, method, 0.25)
        cache.schedule.evict_every = k
        tokens, evictions, quiet = [], [], []
        for state in decode(model, cache, 90, 3 * k + 1):
            layer = state.layers[1]
            quiet.append(not state.schedule.may_evict_after(1))
            tokens.append(int(layer.token_index.max()))
            if int(layer.n_kept[0]) == int(layer.budget[0]):  # just evicted
                evictions.append((layer.token_index.sort(-1).values, layer.keys.sum(), {
                    name: value.sum() for name, value in layer.slot_state.items()}))
            if not skipping:
                state.schedule.quiet = -1  # count, and vote, at the next step
        runs.append((evictions, quiet))
    (evicted, quiet), (evicted_always, _) = runs
    assert sum(quiet) >= 2 * (k - 2)  # most steps skip
    assert len(evicted) == len(evicted_always) == 3
    for (index, keys, states), (index_always, keys_always, states_always) in zip(evicted, evicted_always):
        assert torch.equal(index, index_always)
        torch.testing.assert_close(keys, keys_always)
        assert states.keys() == states_always.keys()
        for name in states:
            torch.testing.assert_close(states[name], states_always[name])


@pytest.mark.parametrize("method,k", [("d2o", 1), ("d2o-plus", 3)])
def test_the_logit_bias_kept_in_place_is_the_one_made_afresh(method, k):
    """The bias the attention adds (log weights, the lowest value on empty slots), updated in place as
    vacancies fill, equals the one made from the slots at every step."""
    model = tiny_model("qwen3")
    cache = make_cache(model, method, 0.3)
    cache.schedule.evict_every = k
    checked = 0
    for state in decode(model, cache, 80, 10):
        for layer in state.layers:
            if layer._bias is None:
                continue
            fresh = (torch.zeros_like(layer.token_index, dtype=torch.float32) if layer.log_weight is None
                     else layer.log_weight.clone()).masked_fill(~layer.valid, torch.finfo(torch.float32).min)
            assert torch.equal(layer.logit_bias(torch.float32), fresh[:, :, None, :])
            checked += 1
    assert checked >= 10 * 2


def test_chunks_fed_after_compression_are_evicted_back_to_budget_plus_k_not_left_as_holes():
    """A multi-token input (a perplexity chunk, a question) is appended, then the layer is gathered
    back to its budget with k empty slots: its width stays budget + k however many chunks come."""
    model, k = tiny_model("llama"), 8
    cache = make_cache(model, "d2o", 0.25)
    cache.schedule.evict_every = k
    with torch.inference_mode():
        model(input_ids=random_ids(96, seed=3), cache=cache)
        for chunk in range(6):
            model(input_ids=random_ids(24, seed=10 + chunk), cache=cache)
            for layer in cache.layers:
                assert int(layer.n_kept[0]) == int(layer.budget[0])
                assert layer.keys.shape[2] == int(layer.budget[0]) + k


@pytest.mark.parametrize("method", ["h2o", "d2o-plus", "roco"])
def test_a_padded_rows_new_tokens_start_from_nothing_in_its_empty_tail(method):
    """A row keeping fewer slots than its batch's widest has empty ones after its kept ones, where
    its next tokens go: they start with no state of their own, as the row's alone do (the state each
    slot holds, token by token, equals the row's alone)."""
    model = tiny_model("llama", dtype=torch.float64)
    prompts = [random_ids(n, seed=n)[0] for n in (140, 96, 120)]
    ids, mask = left_pad(prompts)

    def cache_of():
        return d2o.CompressedCache(model, d2o.get_method(method), d2o.Budget(ratio=0.5, min_tokens=0), evict_every=8)

    batch = cache_of()
    greedy(model, ids, batch, steps=5, mask=mask)  # 4 tokens written into the empty tails, no eviction yet
    for row, prompt in enumerate(prompts):
        alone = cache_of()
        greedy(model, prompt[None], alone, steps=5)
        for mine, theirs in zip(batch.layers, alone.layers):
            for name, state in theirs.slot_state.items():
                for head in range(state.shape[1]):
                    held, theirs_held = mine.token_index[row, head], theirs.token_index[0, head]
                    order = held.argsort()[(held < 0).sum():]
                    theirs_order = theirs_held.argsort()[(theirs_held < 0).sum():]
                    assert torch.equal(held[order], theirs_held[theirs_order])
                    torch.testing.assert_close(mine.slot_state[name][row, head][order],
                                               state[0, head][theirs_order], rtol=0, atol=1e-12)
