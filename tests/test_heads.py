"""Budgets per KV head (``heads=adaptive``): AdaKV's counts, a layer of one run of slots per KV head
(``engine.ragged``) that holds the kept (token, KV head) pairs and no more, and attention over it
equal to attention over the same pairs padded per head."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, greedy, left_pad, make_cache, random_ids, tiny_model

import d2o
from d2o.engine.ragged import QuantizedRaggedLayer, RaggedLayer
from d2o.engine.slots import SlotTable
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError
from d2o.methods.allocation import head_counts
from d2o.runtime.context import compress, load_context
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import plan

ONCE = ["snapkv", "pyramidkv", "kvzip", "expected-attention"]  # the methods that compress once and merge nothing
EVICTING = ["d2o-novelty", "h2o"]  # methods that evict at every decode step (d2o-novelty merges too)
EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8)
PROMPT = 200  # tokens: snapkv's window of 32 leaves a layer's heads room to differ at 0.3


def reference_counts(scores, protected, valid, target, floor):
    """AdaKV's rule by hand: every head's ``floor x target`` best, then the best pairs left."""
    counts = []
    for row in range(scores.shape[0]):
        ranked = scores[row].masked_fill(protected[row], float("inf")).masked_fill(~valid[row], float("-inf"))
        minimum = [min(int(target[row] * floor), int(valid[row, g].sum())) for g in range(scores.shape[1])]
        pool = [(float(value), g) for g in range(scores.shape[1])
                for value in sorted(ranked[g].tolist(), reverse=True)[minimum[g]:] if value > float("-inf")]
        pool.sort(reverse=True)
        row_counts = list(minimum)
        for _, g in pool[:int(target[row]) * scores.shape[1] - sum(minimum)]:
            row_counts[g] += 1
        counts.append(row_counts)
    return torch.tensor(counts)


@pytest.mark.parametrize("floor", [0.0, 0.2, 1.0])
def test_head_counts_are_adakv_rule(floor):
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand((3, 4, 50), generator=generator)
    protected = torch.rand((3, 4, 50), generator=generator) < 0.1
    valid = torch.rand((3, 4, 50), generator=generator) < 0.9
    target = torch.tensor([10, 25, 40])
    counts = head_counts(scores, protected, valid, target, floor)
    assert torch.equal(counts, reference_counts(scores, protected, valid, target, floor))
    assert torch.equal(counts.sum(-1), torch.minimum(target * 4, valid.sum((1, 2))))
    assert bool((counts <= valid.sum(-1)).all())


def padded_copy(cache):
    """A copy of ``cache`` whose ragged layers hold the same pairs in a (B, G, N) table, each KV head
    padded with empty slots: the engine's attention over per-head validity, the reference."""
    padded = cache.copy()
    for layer in list(padded.layers):
        if not isinstance(layer, RaggedLayer):
            continue
        runs = [layer.slots.slots_between(start, stop) for start, stop in layer.runs]
        width = max(run.width for run in runs)
        wide = [run.map(lambda tensor, fill, run=run: torch.cat(
            [tensor, tensor.new_full((*tensor.shape[:2], width - run.width, *tensor.shape[3:]), fill)], dim=2))
            for run in runs]
        plain = CompressedLayer.__new__(CompressedLayer)
        plain.__dict__.update({name: value for name, value in layer.__dict__.items() if name != "bounds"})
        plain._set(SlotTable({name: torch.cat([run.vectors[name] for run in wide], dim=1) for name in wide[0].vectors},
                             torch.cat([run.token_index for run in wide], dim=1), None,
                             {name: torch.cat([run.state[name] for run in wide], dim=1) for name in wide[0].state}))
        padded._replace_layer(plain)
    return padded


def greedy_steps(model, cache, logits, steps: int) -> list[int]:
    """``steps`` greedy tokens fed one by one after a pass that gave ``logits``."""
    tokens = []
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(logits[0, -1].argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache).logits
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("method", ONCE)
def test_adaptive_heads_hold_their_pairs_and_attend_as_padded_heads(arch, method):
    model = tiny_model(arch, **(EIGHT_HEADS if arch == "llama" else {}))
    ids = random_ids(PROMPT)
    adaptive, even = make_cache(model, method, 0.3, heads="adaptive"), make_cache(model, method, 0.3)
    with torch.inference_mode():
        model(input_ids=ids, cache=adaptive)
        model(input_ids=ids, cache=even)
    kv_heads = model.config.num_key_value_heads
    ragged = [layer for layer in adaptive.layers if isinstance(layer, RaggedLayer)]
    assert ragged and all(layer.window is None for layer in ragged)
    differ = False
    for layer, other in zip(adaptive.layers, even.layers):
        if not isinstance(layer, RaggedLayer):
            assert torch.equal(layer.token_index, other.token_index)  # sliding-window layers: as ever
            continue
        counts = layer.head_counts()
        assert torch.equal(counts.sum(-1), layer.budget * kv_heads)  # the layer's budget, exactly, in pairs
        assert torch.equal(layer.budget, other.budget)
        differ |= bool((counts != counts[:, :1]).any())
        # Bytes: the kept pairs' keys and values, and their bookkeeping, and nothing else.
        pair_bytes = layer.keys[0, 0, 0].nbytes + layer.values[0, 0, 0].nbytes
        assert layer.nbytes == int(counts.sum()) * pair_bytes
        assert layer.nbytes == other.nbytes and layer.state_nbytes == other.state_nbytes
        # Each run holds its head's pairs, each token once, every row's prompt positions among them.
        for g, (start, stop) in enumerate(layer.runs):
            held = layer.token_index[0, 0, start:stop]
            assert len(set(held.tolist())) == stop - start and int(held.max()) < PROMPT
    assert differ == (kv_heads > 1)  # one KV head (Gemma 3's) keeps what the even layout keeps
    report = adaptive.report()
    assert report.kv_bytes == even.report().kv_bytes
    assert [layer.kept_per_head[0] for layer in report.layers] == [layer.head_counts()[0].tolist()
                                                                  for layer in adaptive.layers]
    assert ("heads " in report.table()) == differ

    # A question of several tokens, then decode steps: as the same pairs padded per KV head.
    padded = padded_copy(adaptive)
    question = random_ids(6, seed=5)
    with torch.inference_mode():
        logits = model(input_ids=question, cache=adaptive).logits
        reference = model(input_ids=question, cache=padded).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert greedy_steps(model, adaptive, logits, 6) == greedy_steps(model, padded, reference, 6)
    for layer in adaptive.layers:
        if isinstance(layer, RaggedLayer):
            assert torch.equal(layer.head_counts().sum(-1), (layer.budget + 6 + 6) * kv_heads)


@pytest.mark.parametrize("method", ONCE + EVICTING)
def test_one_count_per_head_is_the_even_layout(method):
    """head_floor=1 gives every KV head its even share: the same tokens as heads=even, in runs (for a
    method that evicts while decoding, the same evictions and merges at every step, per run)."""
    model = tiny_model("llama", **EIGHT_HEADS)
    ids = random_ids(PROMPT)
    runs, even = make_cache(model, method, 0.3, heads="adaptive", head_floor=1.0), make_cache(model, method, 0.3)
    assert greedy(model, ids, runs, steps=20).tolist() == greedy(model, ids, even, steps=20).tolist()
    for layer, other in zip(runs.layers, even.layers):
        assert isinstance(layer, RaggedLayer)
        assert torch.equal(layer.merged, other.merged)
        for g, (start, stop) in enumerate(layer.runs):
            held, reference = layer.token_index[0, 0, start:stop], other.token_index[0, g]
            assert sorted(held[held >= 0].tolist()) == sorted(reference[reference >= 0].tolist())


@pytest.mark.parametrize("kv_bits", [None, 4])
@pytest.mark.parametrize("method", ["snapkv", "kvzip"])
def test_one_count_per_head_in_chunks_is_the_even_layout(method, kv_bits):
    """In chunks of 64, the layers become runs at the first compression and take the next chunks and
    the probe passes after each (KVzip's reconstruction, snapkv's question), taken out again
    (``RaggedLayer.snapshot``/``restore``): with every head its even share, the even layout's tokens."""
    model = tiny_model("llama", **EIGHT_HEADS)
    ids = random_ids(PROMPT)
    budget = d2o.Budget(ratio=0.3, min_tokens=0)
    runs, even = (d2o.CompressedCache(model, d2o.get_method(method, **options), budget, tokenizer=byte_tokenizer(),
                                      prefill_chunk=64, kv_bits=kv_bits)
                  for options in (dict(heads="adaptive", head_floor=1.0), {}))
    assert greedy(model, ids, runs).tolist() == greedy(model, ids, even).tolist()
    for layer, other in zip(runs.layers, even.layers):
        assert isinstance(layer, RaggedLayer)
        for g, (start, stop) in enumerate(layer.runs):
            held, reference = layer.token_index[0, 0, start:stop], other.token_index[0, g]
            assert sorted(held[held >= 0].tolist()) == sorted(reference[reference >= 0].tolist())


@pytest.mark.parametrize("evict_every", [1, 8])
@pytest.mark.parametrize("method", EVICTING)
def test_heads_keep_their_counts_while_decoding_evicts(method, evict_every):
    """A method that evicts while decoding evicts as many from every KV head of a row, so each head
    keeps the count the prefill's compression gave it (plus the tokens since the last eviction);
    the layer holds exactly those pairs, each token once per run, the newest in every run."""
    model = tiny_model("llama", **EIGHT_HEADS)
    cache = d2o.CompressedCache(model, d2o.get_method(method, heads="adaptive"), d2o.Budget(ratio=0.3, min_tokens=0),
                                evict_every=evict_every)
    counts, logits = None, None
    with torch.inference_mode():
        for step in range(20):
            logits = model(input_ids=random_ids(PROMPT) if step == 0 else logits[:, -1:].argmax(-1), cache=cache).logits
            now = [layer.head_counts() for layer in cache.layers]
            counts = counts or now
            for layer, first, held in zip(cache.layers, counts, now):
                assert isinstance(layer, RaggedLayer)
                extra = held - first
                assert bool((extra == extra[:, :1]).all()) and 0 <= int(extra[0, 0]) < evict_every
                assert layer.nbytes == int(held.sum()) * (layer.keys[0, 0, 0].nbytes + layer.values[0, 0, 0].nbytes)
                for start, stop in layer.runs:
                    tokens = layer.token_index[0, 0, start:stop].tolist()
                    assert len(set(tokens)) == len(tokens) and PROMPT + step - 1 in tokens
    assert any(bool((first != first[:, :1]).any()) for first in counts)  # the heads' counts differ
    if method == "d2o-novelty":
        assert all(int(layer.merged[0]) > 0 for layer in cache.layers)


def test_one_kv_head_keeps_what_the_even_layout_keeps():
    """Gemma 3 270M has one KV head: nothing to share among heads, so adaptive is the even layout."""
    model = tiny_model("gemma3", num_key_value_heads=1)
    ids = random_ids(PROMPT)
    runs, even = make_cache(model, "kvzip", 0.3, heads="adaptive"), make_cache(model, "kvzip", 0.3)
    assert greedy(model, ids, runs).tolist() == greedy(model, ids, even).tolist()
    for layer, other in zip(runs.layers, even.layers):
        assert sorted(layer.token_index.flatten().tolist()) == sorted(other.token_index.flatten().tolist())


@pytest.mark.parametrize("method", ["snapkv", "d2o-novelty"])
def test_a_padded_batch_is_each_row_alone(method):
    model = tiny_model("llama", **EIGHT_HEADS)
    rows = [random_ids(PROMPT, seed=1)[0], random_ids(PROMPT - 37, seed=2)[0]]
    ids, mask = left_pad(rows)
    batch = make_cache(model, method, 0.3, heads="adaptive")
    together = greedy(model, ids, batch, mask=mask)
    alone_caches = []
    for row, alone in enumerate(rows):
        cache = make_cache(model, method, 0.3, heads="adaptive")
        assert greedy(model, alone[None], cache).tolist() == together[row:row + 1].tolist()
        for mine, theirs in zip(cache.layers, batch.layers):
            assert torch.equal(mine.head_counts()[0], theirs.head_counts()[row])
        alone_caches.append(cache)
    # The first row leaves the batch (a finished request): the second goes on as it would alone.
    batch.select_rows(torch.tensor([1]))
    token, position = together[1:, -1:], alone_caches[1].layers[0].real_seen[:, None]  # its own positions
    with torch.inference_mode():
        left = model(input_ids=token, position_ids=position, cache=batch).logits
        alone = model(input_ids=token, position_ids=position, cache=alone_caches[1]).logits
    torch.testing.assert_close(left, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["kvzip", "d2o-novelty"])
def test_a_context_saved_loaded_and_asked(tmp_path, method):
    model = tiny_model("llama", **EIGHT_HEADS)
    tokenizer = byte_tokenizer()
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
    context = compress(model, tokenizer, text, method, d2o.Budget(ratio=0.3, min_tokens=0), heads="adaptive")
    assert all(isinstance(layer, RaggedLayer) for layer in context.cache.layers)
    questions = ["What jumps?", "Who is lazy today, and why?"]
    answers = context.ask(questions, max_new_tokens=6).texts
    loaded = load_context(context.save(tmp_path / "context.safetensors"), model, tokenizer)
    assert [layer.bounds for layer in loaded.cache.layers] == [layer.bounds for layer in context.cache.layers]
    assert loaded.ask(questions, max_new_tokens=6).texts == answers
    assert [context.ask(question, max_new_tokens=6).text for question in questions] == answers


@pytest.mark.parametrize("options, message", [
    (dict(method="cam", heads="adaptive"), "which cam's merge cannot fold in"),
    (dict(method="d2o-official", heads="adaptive"), "d2o-official stores every KV head once per query head"),
    (dict(method="snapkv", heads="uneven"), "heads='uneven' must be one of even, adaptive"),
    (dict(method="snapkv", heads="adaptive", head_floor=2), "head_floor=2 must be a share"),
])
def test_bad_head_options_are_refused(options, message):
    with pytest.raises(D2OError, match=message):
        d2o.get_method(options.pop("method"), **options)


@pytest.mark.parametrize("method", ["snapkv", "kvzip", "d2o-novelty"])
def test_in_chunks_every_compression_shares_the_layer_among_its_heads(method):
    """Each chunk's compression (after its probe passes: KVzip's reconstruction, snapkv's question)
    gives each KV head its count anew: from the first compression on, a layer over its budget becomes
    runs holding the whole prompt's budget exactly in pairs, and the counts differ between heads."""
    model = tiny_model("llama", **EIGHT_HEADS)
    policy = d2o.get_method(method, heads="adaptive")
    cache = d2o.CompressedCache(model, policy, d2o.Budget(ratio=0.3, min_tokens=0), tokenizer=byte_tokenizer(),
                                prefill_chunk=64)
    seen = []
    original = cache.schedule.compress

    def watched():
        original()
        if cache.schedule.chunks is not None:
            seen.append([(type(layer), layer.head_counts(), layer.budget) for layer in cache.layers])

    cache.schedule.compress = watched
    sequence = Sequence(byte_tokenizer(), 4)
    Batch.prefill(model, cache, [random_ids(PROMPT)[0].tolist()], [sequence]).run()
    assert len(seen) == 4  # chunks of 8, 64, 64, 64: the first holds less than the budget
    assert {kind for kind, _, _ in seen[0]} == {CompressedLayer}
    for chunk in seen[1:]:
        assert RaggedLayer in {kind for kind, _, _ in chunk}  # (D2O's allocation may leave a layer under its budget)
        for kind, counts, budget in chunk:
            if kind is RaggedLayer:
                assert torch.equal(counts.sum(-1), budget * 8)
        assert any(bool((counts != counts[:, :1]).any()) for _, counts, _ in chunk)
    decoded = 0 if policy.evicts_during_decode else 3  # the tokens fed since (evicted at every step, or kept)
    for layer in cache.layers:
        counts = layer.head_counts()
        assert torch.equal(counts.sum(-1), (layer.budget + decoded) * 8) and bool((counts != counts[:, :1]).any())
    assert len(sequence.tokens) == 4
    # A prompt no longer than a chunk: as prefilled whole.
    short = d2o.CompressedCache(model, policy, d2o.Budget(ratio=0.3, min_tokens=0), tokenizer=byte_tokenizer(),
                                prefill_chunk=PROMPT)
    whole = d2o.CompressedCache(model, policy, d2o.Budget(ratio=0.3, min_tokens=0), tokenizer=byte_tokenizer())
    ids = random_ids(PROMPT)
    assert greedy(model, ids, short).tolist() == greedy(model, ids, whole).tolist()


@pytest.mark.parametrize("residual", [32, 0])
@pytest.mark.parametrize("method", ["kvzip", "d2o-novelty"])
def test_quantized_runs_are_the_quantized_even_layout_with_one_count_per_head(method, residual):
    """kv_bits with runs: with every head its even share (head_floor=1), the quantized even layout's
    tokens, per-head token sets and merges after 20 decode steps, in the packed bytes of those pairs
    and the same residual (the newest tokens in full precision, named by their slots in each run)."""
    model = tiny_model("llama", **EIGHT_HEADS)
    ids = random_ids(PROMPT)
    bits = d2o.KVQuantization(bits=4, residual=residual)
    runs, even = (d2o.CompressedCache(model, d2o.get_method(method, **options), d2o.Budget(ratio=0.3, min_tokens=0),
                                      tokenizer=byte_tokenizer(), kv_bits=bits)
                  for options in (dict(heads="adaptive", head_floor=1.0), {}))
    assert greedy(model, ids, runs, steps=20).tolist() == greedy(model, ids, even, steps=20).tolist()
    for layer, other in zip(runs.layers, even.layers):
        assert isinstance(layer, QuantizedRaggedLayer)
        assert torch.equal(layer.merged, other.merged)
        held = layer.token_index[0, 0]
        for g, (start, stop) in enumerate(layer.runs):
            reference = other.token_index[0, g]
            assert sorted(held[start:stop][held[start:stop] >= 0].tolist()) == \
                sorted(reference[reference >= 0].tolist())
            if residual:  # the same tokens in full precision (the even layout's entry for a slot it emptied
                # stays until a token takes that slot; a run's is dropped at once)
                mine, theirs = layer.ring_slots[0, g], other.ring_slots[0, g]
                theirs = reference[theirs[theirs >= 0]]
                assert sorted(held[start:stop][mine[mine >= 0]].tolist()) == sorted(theirs[theirs >= 0].tolist())
        pairs = int((held >= 0).sum())
        stored = other.slots.vectors
        pair_bytes = sum(tensor[0, 0, 0].nbytes for tensor in stored.values())
        assert layer.nbytes_parts["levels"] + layer.nbytes_parts["scales"] == pairs * pair_bytes
        assert layer.nbytes_parts["residual"] == other.nbytes_parts["residual"]


@pytest.mark.parametrize("method", ["kvzip", "d2o-novelty"])
def test_quantized_runs_hold_their_counts_and_a_saved_context_answers_the_same(tmp_path, method):
    model = tiny_model("llama", **EIGHT_HEADS)
    tokenizer = byte_tokenizer()
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
    context = compress(model, tokenizer, text, method, d2o.Budget(ratio=0.3, min_tokens=0), heads="adaptive",
                       kv_bits=4, evict_every=1)
    layers = context.cache.layers
    assert all(isinstance(layer, QuantizedRaggedLayer) for layer in layers)
    assert any(bool((layer.head_counts() != layer.head_counts()[:, :1]).any()) for layer in layers)
    questions = ["What jumps?", "Who is lazy today, and why?"]
    answers = context.ask(questions, max_new_tokens=6).texts
    loaded = load_context(context.save(tmp_path / "context.safetensors"), model, tokenizer)
    assert all(isinstance(layer, QuantizedRaggedLayer) for layer in loaded.cache.layers)
    assert loaded.ask(questions, max_new_tokens=6).texts == answers
    assert [context.ask(question, max_new_tokens=6).text for question in questions] == answers


@pytest.mark.parametrize("method", ["snapkv", "d2o-novelty"])
def test_a_batch_of_adaptive_rows_is_planned_with_its_runs_padded_to_their_widest_rows(method):
    """Each KV head's run is as wide as its widest row: a row of a batch of B is planned at min(B, G)
    times its even share; the batch runs within that plan, and a cap below it refuses it first."""
    model, tokenizer = tiny_model("llama", **EIGHT_HEADS), byte_tokenizer()
    prompts = ["a" * 180, ("The quick brown fox jumps over the lazy dog. " * 4)[:180]]
    policy, budget = d2o.get_method(method, heads="adaptive", head_floor=0.0), d2o.Budget.parse("0.3", min_tokens=0)
    longest = max(len(tokenizer(prompt).input_ids) for prompt in prompts)
    one, two, heads, many = (plan(model.config, policy, budget, longest, 4, rows=rows,
                                  question=bool(policy.question_tokens)) for rows in (1, 2, 8, 100))
    assert one.held_bytes < two.held_bytes < heads.held_bytes == many.held_bytes  # min(B, G): G = 8
    even = d2o.get_method(method)
    assert plan(model.config, even, budget, longest, 4, rows=2) == plan(model.config, even, budget, longest, 4)
    cap = 2 * two.peak_bytes
    with pytest.raises(D2OError, match="2 rows of .* more than the cap of"):
        d2o.generate(model, tokenizer, prompts, policy, budget, max_new_tokens=4, kv_memory=cap - 1)
    answer = d2o.generate(model, tokenizer, prompts, policy, budget, max_new_tokens=4, kv_memory=cap)
    assert answer.report.kv_bytes <= 2 * two.held_bytes
    if method == "snapkv":  # these rows' runs pad past two rows' even shares: the plan of one row each would not hold
        assert answer.report.kv_bytes > 2 * one.held_bytes
