"""Many questions on one compressed context hold its keys and values once (``engine.shared``): the
rows read them in place, evict from them for themselves, and copy a slot before a merge changes it."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, tiny_model

import d2o
from d2o.engine.cache import CompressedCache
from d2o.engine.ragged import RaggedLayer
from d2o.engine.shared import SharedPrefixLayer, SharedRunsLayer
from d2o.engine.storage import CompressedLayer
from d2o.runtime.context import compress
from d2o.runtime.decoding import Sequence
from d2o.runtime.memory import (own_peaks, padded_bytes, peak_slots, prefix_widths, shareable, shared_plan,
                               shared_prefix, slot_bytes, slot_widths)

CONTEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 5
QUESTIONS = ["What jumps?", "Who is lazy? Tell me now, please.", "Where?", "Why is the fox so quick today?"]
BUDGET = d2o.Budget(ratio=0.3, min_tokens=0)


def asked(context, shared: bool, steps: int = 8):
    """The questions answered as one batch; the batch (its rows finished) and each row's tokens."""
    ids = [context.question_ids(question) for question in QUESTIONS]
    sequences = [Sequence(context.tokenizer, steps) for _ in ids]
    batch = context.answer_batch(ids, sequences, shared_prefix=shared)
    return batch, ids, sequences


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["d2o-novelty", "kvzip", "d2o", "h2o", "snapkv"])
def test_rows_on_a_shared_prefix_answer_as_rows_on_copies_and_hold_it_once(arch, method):
    model = tiny_model(arch)
    context = compress(model, byte_tokenizer(), CONTEXT, method, BUDGET, evict_every=1)
    before = [(layer.keys.clone(), layer.values.clone(), layer.token_index.clone()) for layer in context.cache.layers]
    copied, ids, copied_rows = asked(context, shared=False)
    shared, _, shared_rows = asked(context, shared=True)
    # A method that evicts nothing while decoding has its rows read the context with no bookkeeping of
    # it (``SharedRunsLayer``), but in a sliding window's layers, which evict as the window moves.
    compressed_once = not d2o.get_method(method).evicts_during_decode
    assert [type(layer) for layer in shared.cache.layers] == [
        SharedRunsLayer if compressed_once and layer.window is None else SharedPrefixLayer
        for layer in shared.cache.layers]
    for mine, theirs in zip(shared.cache.layers, context.cache.layers):
        assert mine.prefix["keys"] is theirs.keys and mine.prefix["values"] is theirs.values
    torch.testing.assert_close(shared.logits, copied.logits, rtol=1e-4, atol=1e-4)

    # The prefix once, each row's own part beside it: at most the widest question's tokens per row and
    # layer, and as many prefix slots copied before a merge changed them (one per evicted token).
    token_bytes = sum(layer.prefix["keys"][0, :, 0].nbytes + layer.prefix["values"][0, :, 0].nbytes
                      for layer in shared.cache.layers)
    widest = max(map(len, ids)) * (2 if d2o.get_method(method).merge is not None else 1)
    assert shared.cache.report().kv_bytes <= context.report.kv_bytes + len(ids) * widest * token_bytes
    assert copied.cache.report().kv_bytes >= len(ids) * context.report.kv_bytes
    assert shared.cache.report().kv_bytes < copied.cache.report().kv_bytes

    shared.run()
    copied.run()
    assert [s.tokens for s in shared_rows] == [s.tokens for s in copied_rows]
    # Whatever the rows evicted or merged, the context is as it was.
    for layer, (keys, values, index) in zip(context.cache.layers, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert torch.equal(layer.token_index, index)


def test_a_row_evicts_prefix_slots_for_itself_and_copies_a_slot_before_a_merge_changes_it():
    """D2O merges evicted tokens into kept ones: a prefix slot a row merges into moves to that row's
    own part (its token index there, below the context's length), emptied in the prefix for that
    row only; the prefix's vectors never change."""
    model = tiny_model("llama")
    context = compress(model, byte_tokenizer(), CONTEXT, "d2o", BUDGET, evict_every=1)
    keys = [layer.keys.clone() for layer in context.cache.layers]
    batch, _, _ = asked(context, shared=True, steps=12)
    for _ in range(10):
        batch.step()
    moved = emptied_for_some = 0
    for layer, original in zip(batch.cache.layers, keys):
        width, index = layer.prefix_width, layer.token_index
        own = index[:, :, width:]
        moved += int(((own >= 0) & (own < len(context.ids))).sum())
        prefix = index[:, :, :width] >= 0
        emptied_for_some += int((prefix.any(0) & ~prefix.all(0)).sum())
        assert torch.equal(layer.prefix["keys"], original)
    assert moved > 0 and emptied_for_some > 0


@pytest.mark.parametrize("method", ["d2o", "d2o-novelty"])
def test_a_decode_step_reads_the_prefix_in_place_also_where_it_merges(method, monkeypatch):
    """A decode step's attention, evictions and merges read the prefix where it is: the gathered view
    (the prefix repeated for every row) is never made; ``vectors_at`` and ``vector_parts`` give what
    the gathered view holds."""
    model = tiny_model("llama")
    context = compress(model, byte_tokenizer(), CONTEXT, method, BUDGET, evict_every=1)
    batch, _, _ = asked(context, shared=True, steps=12)
    layer = batch.cache.layers[0]
    keys, values = (tensor.clone() for tensor in layer.attended())
    layer.settle()
    slots = torch.randint(0, keys.shape[2], (*keys.shape[:2], 5))
    for name, whole in (("keys", keys), ("values", values)):
        assert torch.equal(layer.vectors_at(name, slots),
                           whole.gather(2, slots[..., None].expand(*slots.shape, whole.shape[-1])))
        prefix, own = layer.vector_parts(name)
        assert torch.equal(torch.cat([prefix.expand(keys.shape[0], -1, -1, -1), own], 2), whole)

    gathered = []
    monkeypatch.setattr(SharedPrefixLayer, "attended", lambda layer: gathered.append(layer) or (_ for _ in ()).throw(
        AssertionError("a decode step gathered the prefix")))
    merged = sum(int(layer.merged.sum()) for layer in batch.cache.layers)
    for _ in range(10):
        batch.step()
    assert not gathered
    assert sum(int(layer.merged.sum()) for layer in batch.cache.layers) > merged  # it merged meanwhile


def test_rows_of_another_prefix_do_not_join_and_a_shared_cache_saves_whole():
    model = tiny_model("llama")
    tokenizer = byte_tokenizer()
    first = compress(model, tokenizer, CONTEXT, "h2o", BUDGET)
    second = compress(model, tokenizer, CONTEXT[::-1], "h2o", BUDGET)
    one, _, _ = asked(first, shared=True)
    other, _, _ = asked(second, shared=True)
    plain, _, _ = asked(first, shared=False)
    assert "prefix" in one.cache.why_not_joined(other.cache)
    assert "prefix" in one.cache.why_not_joined(plain.cache)
    with pytest.raises(d2o.D2OError, match="prefix"):
        one.join(other)

    tensors, meta = one.cache.state_dict()
    loaded = CompressedCache(model, d2o.get_method("h2o"), BUDGET)
    loaded.load_state_dict(tensors, meta, torch.float32)
    assert not any(isinstance(layer, SharedPrefixLayer) for layer in loaded.layers)
    for mine, theirs in zip(loaded.layers, one.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.token_index, theirs.token_index)


@pytest.mark.parametrize("method, copies", [("d2o-novelty", False), ("d2o", True)])
def test_only_a_merge_that_writes_vectors_copies_prefix_slots_into_a_rows_own_part(method, copies):
    """``d2o``'s merge blends an evicted token's value into the kept slot: a row copies that prefix
    slot into its own part first. ``d2o-novelty``'s moves only weight (``changes_vectors`` False): its
    rows' own parts hold their own tokens alone, and their plans count one slot per token."""
    model = tiny_model("llama")
    context = compress(model, byte_tokenizer(), CONTEXT, method, BUDGET, evict_every=1)
    batch, _, _ = asked(context, shared=True, steps=12)
    for _ in range(11):
        batch.step()
    document = len(context.ids)
    copied = sum(int(((layer.token_index[:, :, layer.prefix_width:] >= 0)
                      & (layer.token_index[:, :, layer.prefix_width:] < document)).sum())
                 for layer in batch.cache.layers)
    assert d2o.get_method(method).merge.changes_vectors is copies
    assert (copied > 0) is copies


@pytest.mark.real_model
def test_eight_questions_on_a_document_hold_it_once(real_model):
    """``d2o bench ask``, small: SmolLM2, an 800-token document, 8 needle questions at 20%."""
    from d2o.bench.ask import bench_ask

    model, tokenizer = real_model
    row, = bench_ask(model, tokenizer, ["d2o-novelty"], d2o.Budget.parse("0.2"), 800, 8, 4)
    assert row["same answers"]
    assert row["shared peak / (document + own tokens)"] <= 1.5
    assert row["copied peak / (document + own tokens)"] >= 3


@pytest.mark.parametrize("method, evict_every", [("d2o", 1), ("d2o", 4), ("h2o", 1), ("kvzip", 1), ("d2o-novelty", 4)])
def test_rows_on_a_shared_prefix_stay_within_their_padded_bound_which_counts_it_once(method, evict_every):
    """The server's admission bound (``padded_bytes`` with the prefix) holds at every step of an
    answer, through merges, evictions and a row leaving, and is below the bound of copied rows."""
    model = tiny_model("llama")
    context = compress(model, byte_tokenizer(), CONTEXT, method, BUDGET, evict_every=evict_every)
    steps = 12
    batch, _, _ = asked(context, shared=True, steps=steps)
    chosen = d2o.get_method(method)
    per_slot, per_vector = slot_bytes(model.config, 4, chosen), slot_bytes(model.config, 4, chosen, stock=True)
    peaks = peak_slots(batch.cache, steps)
    own = own_peaks(batch.cache, steps, peaks)

    def bound(rows):  # the rows' own parts and bookkeeping, and the context's keys and values once
        return padded_bytes(slot_widths(batch.cache), peaks[rows], per_slot, 0, prefix_widths(batch.cache),
                            per_vector, own[rows]) + shared_prefix(batch.cache)[1]

    limit = bound(list(range(len(QUESTIONS))))  # what the server reserves as the rows join
    # What it reserves for a request before it runs (its question and answer beside the context) covers
    # its row alone, which it runs as when joining the others would not fit.
    for question in QUESTIONS:
        alone = context.answer_batch([context.question_ids(question)], [Sequence(context.tokenizer, steps)])
        planned = shared_plan(context.cache, len(context.question_ids(question)), steps, per_slot, per_vector)
        its_peaks = peak_slots(alone.cache, steps)
        assert padded_bytes(slot_widths(alone.cache), its_peaks, per_slot, 0, prefix_widths(alone.cache), per_vector,
                            own_peaks(alone.cache, steps, its_peaks)) <= planned.held_bytes
    copied, _, _ = asked(context, shared=False, steps=steps)
    assert limit < padded_bytes(slot_widths(copied.cache), peak_slots(copied.cache, steps), per_slot)
    for step in range(steps - 1):
        if step == 5:  # a row leaves
            batch.keep_rows([0, 2, 3])
            limit = bound([0, 2, 3])
        batch.step()
        assert batch.cache.nbytes <= limit, (step, batch.cache.nbytes, limit)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["kvzip", "snapkv"])
def test_rows_on_a_context_of_runs_read_it_in_place(arch, method):
    """A context whose KV heads keep counts of their own (``heads=adaptive``) of a method that evicts
    nothing while decoding: its rows read its runs in place (``SharedRunsLayer``) and hold no
    bookkeeping of them, only their own tokens in every KV head; they answer as rows on copies, the
    context is unchanged, and saved they load as runs that go on alike."""
    model = tiny_model(arch, **(dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8) if arch == "llama"
                                else {}))
    context = compress(model, byte_tokenizer(), CONTEXT, d2o.get_method(method, heads="adaptive"), BUDGET)
    runs = [layer for layer in context.cache.layers if isinstance(layer, RaggedLayer)]
    assert runs and any(bool((layer.head_counts() != layer.head_counts()[:, :1]).any()) for layer in runs)
    before = [(layer.keys.clone(), layer.token_index.clone()) for layer in runs]
    copied, ids, copied_rows = asked(context, shared=False)
    shared, _, shared_rows = asked(context, shared=True)
    torch.testing.assert_close(shared.logits, copied.logits, rtol=1e-4, atol=1e-4)
    widest = max(map(len, ids))
    for mine, theirs in zip(shared.cache.layers, context.cache.layers):
        if not isinstance(theirs, RaggedLayer):
            assert isinstance(mine, SharedPrefixLayer)
            continue
        assert isinstance(mine, SharedRunsLayer) and mine.prefix["keys"] is theirs.keys
        # Its slot table is its own tokens alone: the questions', padded to the widest, in every KV head.
        assert mine.token_index.shape == (len(ids), theirs.kv_heads, widest)
        pair_bytes = theirs.keys[0, 0, 0].nbytes + theirs.values[0, 0, 0].nbytes
        assert mine.nbytes == theirs.nbytes + len(ids) * theirs.kv_heads * widest * pair_bytes
        assert torch.equal(mine.head_counts()[0], theirs.head_counts()[0] + len(ids[0]))

    tensors, meta = shared.cache.state_dict()
    loaded = CompressedCache(model, d2o.get_method(method, heads="adaptive"), BUDGET)
    loaded.load_state_dict({name: tensor.clone() for name, tensor in tensors.items()}, meta, torch.float32)  # as read
    for mine, theirs in zip(loaded.layers, shared.cache.layers):                                              # back
        assert isinstance(mine, RaggedLayer) == isinstance(theirs, SharedRunsLayer)
        assert torch.equal(mine.head_counts(), theirs.head_counts())
    token = shared.logits.argmax(-1, keepdim=True)
    with torch.inference_mode():
        again = model(input_ids=token, cache=loaded).logits[:, -1]
    shared.run()
    copied.run()
    assert [s.tokens for s in shared_rows] == [s.tokens for s in copied_rows]
    longest = max(range(len(ids)), key=lambda row: len(ids[row]))  # the row whose position the model's default is
    assert int(again[longest].argmax()) == shared_rows[longest].tokens[1]
    for layer, (keys, index) in zip(runs, before):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.token_index, index)


def test_rows_on_runs_of_a_method_that_evicts_while_decoding_copy_them():
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    context = compress(model, byte_tokenizer(), CONTEXT, d2o.get_method("d2o-novelty", heads="adaptive"), BUDGET)
    shared, _, _ = asked(context, shared=True)
    assert not shareable(context.cache)
    assert all(isinstance(layer, RaggedLayer) for layer in shared.cache.layers)


def test_rows_reading_a_plain_context_with_no_bookkeeping_save_as_a_plain_layer():
    """``kvzip`` (even) evicts nothing while decoding: its rows read the context's plain layers with
    no bookkeeping of them; saved, they load as plain layers holding the context's slots then each
    row's own, which go on as the rows do."""
    model = tiny_model("llama")
    context = compress(model, byte_tokenizer(), CONTEXT, "kvzip", BUDGET)
    shared, ids, rows = asked(context, shared=True)
    assert all(isinstance(layer, SharedRunsLayer) and layer.slots.width == max(map(len, ids))
               for layer in shared.cache.layers)
    tensors, meta = shared.cache.state_dict()
    loaded = CompressedCache(model, d2o.get_method("kvzip"), BUDGET)
    loaded.load_state_dict({name: tensor.clone() for name, tensor in tensors.items()}, meta, torch.float32)
    for mine, theirs, source in zip(loaded.layers, shared.cache.layers, context.cache.layers):
        assert type(mine) is CompressedLayer and torch.equal(mine.head_counts(), theirs.head_counts())
        assert torch.equal(mine.keys[:, :, :source.slots.width], source.keys.expand(len(ids), -1, -1, -1))
    token = shared.logits.argmax(-1, keepdim=True)
    with torch.inference_mode():
        again = model(input_ids=token, cache=loaded).logits[:, -1]
    shared.run()
    longest = max(range(len(ids)), key=lambda row: len(ids[row]))
    assert int(again[longest].argmax()) == rows[longest].tokens[1]
