"""A prompt prefilled in chunks: compressed after each chunk, never holding more than the whole
prompt's budget and one chunk, answering as one prefilled whole where nothing is evicted."""

from __future__ import annotations

import pytest
import torch
from conftest import CHOSEN, byte_tokenizer, random_ids, tiny_model

import d2o
from d2o.engine.api import QUESTION
from d2o.engine.probing import Prober
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import plan

CHUNKED = [name for name in CHOSEN if d2o.get_method(name).compress_after_forward == 1]


def run(model, method, budget, prompts, chunk, steps=8, tokenizer=None, **options):
    """Greedy tokens of ``prompts`` (a padded batch) prefilled ``chunk`` tokens at a time, and the cache."""
    tokenizer = tokenizer or byte_tokenizer()
    cache = d2o.CompressedCache(model, d2o.get_method(method), d2o.Budget.parse(budget, min_tokens=16),
                                tokenizer=tokenizer, prefill_chunk=chunk, **options)
    sequences = [Sequence(tokenizer, steps) for _ in prompts]
    Batch.prefill(model, cache, prompts, sequences).run()
    return [s.tokens for s in sequences], cache


def held(cache, row: int = 0) -> list[list[int]]:
    return [sorted(t for t in layer.token_index[row, 0].tolist() if t >= 0) for layer in cache.layers]


@pytest.mark.parametrize("name", CHUNKED)
def test_at_budget_one_chunks_answer_as_the_whole_prompt(name):
    """The same tokens and slots, the same keys to float64's rounding: a matrix product of a chunk's
    rows may sum in another order than one of the whole prompt's (the library picks its kernel by
    size), so bit for bit holds only where both pick the same."""
    model = tiny_model("llama", dtype=torch.float64)
    prompts = [random_ids(130, seed=2)[0].tolist()]
    whole_tokens, whole = run(model, name, "1.0", prompts, None)
    chunked_tokens, chunked = run(model, name, "1.0", prompts, 32)  # 5 chunks, the first of 2 tokens
    assert chunked_tokens == whole_tokens
    for mine, theirs in zip(chunked.layers, whole.layers):
        assert torch.equal(mine.token_index, theirs.token_index)
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", CHUNKED)
def test_every_method_compresses_each_chunk_and_holds_its_budget_after(name):
    """After each chunk a layer holds at most its budget then (allocated anew at every chunk, the
    budgets adding up to the whole prompt's total); so while a chunk is fed, that budget and a chunk."""
    model = tiny_model("qwen2")
    budget = d2o.Budget.parse("0.25", min_tokens=16)
    cache = d2o.CompressedCache(model, d2o.get_method(name), budget, tokenizer=byte_tokenizer(), prefill_chunk=48)
    before, after = [], []
    original = cache.schedule.compress

    def watched():
        before.append([layer.keys.shape[2] for layer in cache.layers])
        original()
        after.append([(int(layer.n_kept[0]), int(layer.budget[0])) for layer in cache.layers])

    cache.schedule.compress = watched
    Batch.prefill(model, cache, [random_ids(200, seed=4)[0].tolist()], [Sequence(None, 1)])
    assert len(before) == 5  # chunks of 8, 48, 48, 48 and 48 tokens
    if cache.policy.keeps_everything:
        return
    total = budget.total(4, 200)
    for held in after:
        assert all(kept <= layer_budget for kept, layer_budget in held)
        assert sum(layer_budget for _, layer_budget in held) == total or not cache.policy.conserves_budget
    for widths, held in zip(before[1:], after):
        assert all(width <= kept + 48 for width, (kept, _) in zip(widths, held))
    # A layer keeps all it may: its budget, or what it held and the chunk where that is less (a
    # budget that rises at a later chunk cannot bring back the tokens evicted at an earlier one).
    chunks = [8, 48, 48, 48, 48]
    previous = [0] * len(after[0])
    for chunk, held in zip(chunks, after):
        assert [kept for kept, _ in held] == [min(b, p + chunk) for p, (_, b) in zip(previous, held)]
        previous = [kept for kept, _ in held]


@pytest.mark.parametrize("chunk", [1, 25, 100, 400])
def test_a_padded_batch_in_chunks_answers_as_each_row_alone(chunk):
    """Rows of 100 and 60 tokens: chunks of one token, of 25 (60 tokens alone: 10, 25, 25; padded to
    100: 25 of padding, then 15 of padding and the same 10, 25, 25), as long as the prompt, longer."""
    model = tiny_model("llama", dtype=torch.float64)
    prompts = [random_ids(100, seed=5)[0].tolist(), random_ids(60, seed=6)[0].tolist()]
    together, batch = run(model, "d2o-plus", "0.3", prompts, chunk, evict_every=8)
    for row, prompt in enumerate(prompts):
        alone, cache = run(model, "d2o-plus", "0.3", [prompt], chunk, evict_every=8)
        assert together[row] == alone[0]
        assert held(batch, row) == held(cache)


def test_a_prompt_no_longer_than_a_chunk_is_prefilled_whole():
    model = tiny_model("llama")
    prompts = [random_ids(90, seed=7)[0].tolist()]
    tokens, cache = run(model, "d2o", "0.3", prompts, 90)
    assert (tokens, held(cache)) == (lambda t, c: (t, held(c)))(*run(model, "d2o", "0.3", prompts, None))


@pytest.mark.parametrize("options", [{"kv_bits": 4}, {"evict_every": 8}, {"evict_every": 1}])
def test_chunks_compose_with_quantized_keys_and_eviction_in_batches(options):
    model = tiny_model("mistral", dtype=torch.float64)
    prompts = [random_ids(150, seed=8)[0].tolist()]
    tokens, cache = run(model, "d2o", "0.3", prompts, 40, steps=12, **options)
    assert len(tokens[0]) == 12
    budgets = [int(layer.budget[0]) for layer in cache.layers]
    slack = options.get("evict_every", 1)
    assert all(layer.keys.shape[2] <= budget + slack for layer, budget in zip(cache.layers, budgets))


def test_a_method_that_scores_with_the_question_sees_it_after_every_chunk_but_the_last(monkeypatch):
    """The question is the prompt's last ``question_tokens`` tokens, at their own positions; it votes
    (its window's rows) and adds no attention mass; the last chunk holds it and shows it itself."""
    model = tiny_model("llama")
    prompt = random_ids(130, seed=9)[0].tolist()
    shown, unchanged = [], []
    original = Prober.run

    def spy(prober, cache, passes):
        for probe in passes:
            if probe.tag != QUESTION:
                original(prober, cache, [probe])
                continue
            before = [layer.slot_state["mass"].clone() for layer in cache.layers]
            original(prober, cache, [probe])
            shown.append((probe.ids[0], probe.positions[0]))
            unchanged.append(all(torch.equal(layer.slot_state["mass"], mass)
                                 for layer, mass in zip(cache.layers, before)))

    monkeypatch.setattr(Prober, "run", spy)
    run(model, "d2o-plus", "0.3", [prompt], 40, steps=2)  # Batch.prefill shows the prompt's tail by default
    assert shown == [(prompt[-32:], 98)] * 3 and all(unchanged)  # after chunks 1-3 of 4
    shown.clear()
    cache = d2o.CompressedCache(model, d2o.get_method("d2o-plus"), d2o.Budget.parse("0.3", 16),
                                tokenizer=byte_tokenizer(), prefill_chunk=40)
    Batch.prefill(model, cache, [prompt], [Sequence(None, 1)], question=None)  # blind
    assert shown == []


def test_kv_bytes_held_in_chunks_stay_within_the_plan_and_reach_it():
    model = tiny_model("llama")
    method, budget = d2o.get_method("h2o"), d2o.Budget.parse("0.2", min_tokens=16)
    expected = plan(model.config, method, budget, 240, 1, prefill_chunk=40)
    one_shot = plan(model.config, method, budget, 240, 1)
    assert expected.prefill_bytes < one_shot.prefill_bytes / 2
    cache = d2o.CompressedCache(model, method, budget, prefill_chunk=40)
    most = []
    original = cache.schedule.compress

    def watched():
        most.append(cache.nbytes)
        original()

    cache.schedule.compress = watched
    Batch.prefill(model, cache, [random_ids(240, seed=10)[0].tolist()], [Sequence(None, 1)])
    assert max(most) == expected.prefill_bytes  # each layer at its budget (48) and a chunk (40)


def test_a_compressed_context_prefilled_in_chunks_is_saved_and_loaded(tmp_path):
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    context = "The archive lists every shipment of the winter. " * 6
    ctx = d2o.compress(model, tokenizer, context, "d2o-novelty", d2o.Budget.parse("0.3", 16), prefill_chunk=50)
    assert len(ctx.ids) > 150
    loaded = d2o.load_context(ctx.save(tmp_path / "ctx.safetensors"), model, tokenizer)
    assert loaded.ask("Which season?", max_new_tokens=6).texts == ctx.ask("Which season?", max_new_tokens=6).texts
    assert [layer.keys.shape[2] for layer in loaded.cache.layers] == [layer.keys.shape[2] for layer in ctx.cache.layers]


def test_a_prefill_in_chunks_is_refused_by_name_where_it_cannot_run():
    model = tiny_model("llama")
    with pytest.raises(d2o.D2OError, match="prefill_chunk=0 must be a whole number of tokens >= 1"):
        d2o.CompressedCache(model, d2o.get_method("d2o"), 0.2, prefill_chunk=0)
    with pytest.raises(d2o.D2OError, match="d2o-official first compresses after the first decode step"):
        run(model, "d2o-official", "0.3", [random_ids(100)[0].tolist()], 30)


def test_a_memory_cap_the_whole_prefill_exceeds_refuses_it_and_admits_the_chunked_one():
    model, tokenizer = tiny_model("llama"), byte_tokenizer()
    prompt = "The ledger of the harbour lists every ship. " * 6
    method, budget = d2o.get_method("d2o-plus"), d2o.Budget.parse("0.2", min_tokens=16)
    length = len(tokenizer(prompt).input_ids)
    chunked = plan(model.config, method, budget, length, 4, prefill_chunk=40, question=True)
    assert chunked.peak_bytes < plan(model.config, method, budget, length, 4).prefill_bytes
    with pytest.raises(d2o.D2OError, match=r"more than the cap of .*; use a prefill in chunks \(prefill_chunk="):
        d2o.generate(model, tokenizer, prompt, method, budget, max_new_tokens=4, kv_memory=chunked.peak_bytes)
    with pytest.raises(d2o.D2OError, match="use a smaller budget, prefill chunk, prompt or answer"):
        d2o.generate(model, tokenizer, prompt, method, budget, max_new_tokens=4, prefill_chunk=40,
                     kv_memory=chunked.peak_bytes - 1)
    answer = d2o.generate(model, tokenizer, prompt, method, budget, max_new_tokens=4, prefill_chunk=40,
                          kv_memory=chunked.peak_bytes)
    assert answer.report.kv_bytes <= chunked.held_bytes
