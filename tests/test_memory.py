"""What a server reserves: a row's peak slots per layer, and a padded batch's bytes, never exceeded."""

import pytest
import torch
from conftest import random_ids, tiny_model

import d2o
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import padded_bytes, peak_slots, plan, slot_bytes, slot_widths

CASES = [("full", "1.0", 0), ("d2o", "0.3", 5), ("h2o", "0.3", 0), ("snapkv", "0.3", 40), ("streamingllm", "12t", 0),
         ("pyramidkv", "0.5", 40), ("tova", "40t", 0), ("d2o", "0.2", 64)]


def prefilled(model, method, budget, min_tokens, lengths, new_tokens, seed=1):
    cache = d2o.CompressedCache(model, d2o.get_method(method), d2o.Budget.parse(budget, min_tokens))
    prompts = [random_ids(n, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]
    batch = Batch.prefill(model, cache, prompts, [Sequence(None, new_tokens) for _ in lengths])
    return batch, peak_slots(cache, new_tokens)


@pytest.mark.parametrize("method, budget, min_tokens", CASES)
def test_a_batch_never_holds_more_than_its_padded_peaks_through_joins_and_departures(method, budget, min_tokens):
    model = tiny_model()
    per_slot = slot_bytes(model.config, 4, d2o.get_method(method))
    batch, peaks = prefilled(model, method, budget, min_tokens, [30, 9], new_tokens=24)
    rows = {id(s): p for s, p in zip(batch.sequences, peaks)}
    newcomer, its_peaks = prefilled(model, method, budget, min_tokens, [50], new_tokens=12, seed=7)
    rows[id(newcomer.sequences[0])] = its_peaks[0]

    def bound():
        live = torch.stack([rows[id(s)] for s in batch.sequences])
        return padded_bytes(slot_widths(batch.cache), live, per_slot), live

    limit, _ = bound()
    most = 0
    for step in range(30):
        if step == 5:
            batch.join(newcomer)
            limit, _ = bound()
        if step == 8:  # a cancelled row leaves
            batch.keep_rows([0, 2])
            limit, _ = bound()
        if not batch.sequences:
            break
        finished = batch.step()
        if batch.sequences:
            assert batch.cache.nbytes <= limit, (step, batch.cache.nbytes, limit)
            most = max(most, batch.cache.nbytes)
        if finished and batch.sequences:
            limit, _ = bound()
    assert most > 0


@pytest.mark.parametrize("method, budget, min_tokens", CASES)
@pytest.mark.parametrize("length", [6, 40])
def test_a_row_alone_peaks_within_its_plan_and_reaches_its_peak(method, budget, min_tokens, length):
    model = tiny_model()
    chosen = d2o.get_method(method)
    new_tokens = 20
    batch, peaks = prefilled(model, method, budget, min_tokens, [length], new_tokens)
    parsed = d2o.Budget.parse(budget, min_tokens)
    expected = plan(model.config, chosen, parsed, length, new_tokens)
    bound = padded_bytes([0] * 4, peaks, slot_bytes(model.config, 4, chosen))  # one row: its peaks' bytes
    assert bound <= expected.held_bytes
    most = 0
    while batch.sequences:
        batch.step()
        most = max(most, batch.cache.nbytes)
    assert most <= bound
    if chosen.evicts_during_decode and bool((peaks[0] < length + new_tokens).all()):
        assert most == bound  # every layer reached its budget: the peak is exact, not only a bound


def test_the_exactness_check_above_is_not_vacuous():
    _, peaks = prefilled(tiny_model(), "h2o", "0.3", 0, [40], 20)
    assert bool((peaks[0] < 60).all())  # so h2o-0.3-0 at length 40 asserts most == bound


def test_a_prompt_under_the_floor_plans_what_the_full_cache_holds():
    """Nothing is evicted while a row stays under the floor: no slot for an eviction is needed."""
    config = tiny_model().config
    method = d2o.get_method("d2o")
    slot, = set(slot_bytes(config, 4, method))
    short = plan(config, method, d2o.Budget.parse(0.2), 37, 12)
    assert (short.prefill_bytes, short.held_bytes) == (37 * 4 * slot, (37 + 12) * 4 * slot)
    longer = plan(config, method, d2o.Budget.parse(0.2), 200, 12)
    assert longer.held_bytes == (128 + 1) * 4 * slot


def test_the_official_preset_is_planned_within_the_full_cache_and_stays_within_it():
    """d2o-official's budgets are set at its first decode step and need not add up to its total
    (its exempt layers' share is lost): its plan is the full cache's, and what it holds stays below."""
    model = tiny_model(num_hidden_layers=8)
    official = d2o.get_method("d2o-official")
    budget = d2o.Budget.parse("0.2", 0)
    expected = plan(model.config, official, budget, 100, 20)
    assert expected.held_bytes == 120 * sum(slot_bytes(model.config, 4, official))  # every layer, every token
    batch, _ = prefilled(model, "d2o-official", "0.2", 0, [100], 20)
    most = batch.cache.nbytes
    while batch.sequences:
        batch.step()
        most = max(most, batch.cache.nbytes)
    assert most <= expected.peak_bytes
