"""Keys and values stored at 8, 4 or 2 bits: the codec, the layer that stores with it, and its bytes."""

import pytest
import torch
from conftest import CHOSEN, greedy, left_pad, random_ids, tiny_model

import d2o
from d2o import D2OError
from d2o.engine.api import Merged
from d2o.engine.quantization import KVQuantization
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import padded_bytes, peak_slots, plan, row_bytes, slot_bytes

TINY = dict(residual=4)  # (groups of 16 channels: the tiny models' heads have 16)


def cache_of(model, method, budget, bits, min_tokens=0, **options):
    quantization = None if bits is None else KVQuantization(bits=bits, **{**TINY, **options})
    return d2o.CompressedCache(model, d2o.get_method(method), d2o.Budget.parse(budget, min_tokens),
                               kv_bits=quantization)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_codec_rounds_to_the_nearest_level_and_decoding_then_encoding_gives_the_same_bytes(bits):
    quantization = KVQuantization(bits=bits, group_size=32)
    x = torch.randn(2, 3, 40, 64) * torch.linspace(0.1, 8, 64)  # channels of very different ranges
    parts = quantization.encode(x)
    assert parts["data"].dtype == torch.uint8 and parts["data"].shape == (2, 3, 40, 64 * bits // 8)
    assert parts["scale"].shape == parts["zero"].shape == (2, 3, 40, 2)
    per_token = sum(part[0, 0, 0].nbytes for part in parts.values())
    assert per_token == quantization.token_bytes(64)
    decoded = quantization.decode(parts)
    step = parts["scale"].float().repeat_interleave(32, -1)
    assert bool(((decoded - x).abs() <= step / 2 + 1e-3 * x.abs().amax(-1, keepdim=True)).all())
    again = quantization.encode(decoded)
    assert all(torch.equal(again[name], parts[name]) for name in parts)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(D2OError, match="8, 4 or 2 bits"):
        KVQuantization(bits=3)
    with pytest.raises(D2OError, match="kv_group_size=0"):
        KVQuantization(bits=4, group_size=0)
    with pytest.raises(D2OError, match="kv_group_size=32 does not divide this model's head dimension 16"):
        cache_of(tiny_model(), "d2o", 0.5, 4, group_size=32)
    with pytest.raises(D2OError, match="8, 4 or 2 bits"):
        d2o.CompressedCache(tiny_model(), d2o.get_method("d2o"), 0.5, kv_bits=5)


def test_the_residual_is_read_in_full_precision_and_the_rest_within_half_a_step():
    model = tiny_model()
    ids = random_ids(30)
    plain, quantized = cache_of(model, "full", 1.0, None), cache_of(model, "full", 1.0, 4)
    with torch.inference_mode():
        model(input_ids=ids, cache=plain)
        model(input_ids=ids, cache=quantized)
    for mine, theirs in zip(quantized.layers, plain.layers):
        keys, values = mine.attended()
        assert torch.equal(keys[:, :, -4:], theirs.keys[:, :, -4:])  # the newest 4: exact
        assert torch.equal(values[:, :, -4:], theirs.values[:, :, -4:])
        assert not torch.equal(keys[:, :, :-4], theirs.keys[:, :, :-4])
        # Half a step at most: a step is a 16th of the range (at most twice the largest magnitude).
        torch.testing.assert_close(keys, theirs.keys, atol=1.001 * float(theirs.keys.abs().max()) / 15, rtol=0)
        mine.settle()
        assert mine._open is None  # nothing in full precision is kept between passes but the residual


def test_a_merge_result_is_encoded_again_in_the_slots_it_changed_alone():
    model = tiny_model()
    cache = cache_of(model, "full", 1.0, 4)
    with torch.inference_mode():
        model(input_ids=random_ids(20), cache=cache)
    layer = cache.layers[1]
    before = {part: tensor.clone() for part, tensor in layer.slots.vectors.items()}
    values = layer.values.clone()
    slots = torch.tensor([3, 5]).view(1, 1, 2).expand(1, 2, 2)  # slots 3 and 5 of both KV heads
    new = values.gather(2, slots[..., None].expand(-1, -1, -1, 16)).clone()
    new[0, 1, 0, 0] += 1.0  # slot 3 of head 1 changes; the others are given as they were
    with torch.inference_mode():  # as the cache compresses: in the mode its tensors were made in
        layer.apply_merged(Merged(torch.zeros(1, dtype=torch.long), slots=slots, values=new))
    layer.settle()
    changed = sum((layer.slots.vectors[part] != tensor).any(-1).int() for part, tensor in before.items())
    expected = torch.zeros_like(changed)  # (B, G, N, 2)
    expected[0, 1, 3, 1] = 1  # the value of slot 3 in head 1; its key's bytes encode again as they were
    assert torch.equal(changed.clamp_max(1), expected)
    assert float(layer.attended()[1][0, 1, 3, 0] - values[0, 1, 3, 0] - 1.0).__abs__() < 0.1


@pytest.mark.parametrize("name", CHOSEN)
def test_every_method_runs_on_a_quantized_cache_batched_as_alone_with_exact_lengths(name):
    model = tiny_model(dtype=torch.float64)
    prompts = [random_ids(n, seed=n)[0] for n in (100, 80)]  # budgets above SnapKV's window
    ids, mask = left_pad(prompts)
    batch_cache = cache_of(model, name, 0.5, 4)
    batched = greedy(model, ids, batch_cache, steps=12, mask=mask)
    for row, prompt in enumerate(prompts):
        cache = cache_of(model, name, 0.5, 4)
        alone = greedy(model, prompt[None], cache, steps=12)
        assert batched[row].tolist() == alone[0].tolist()
        for mine, theirs in zip(batch_cache.layers, cache.layers):
            assert int(mine.n_kept[row]) == int(theirs.n_kept[0])
            assert theirs.slots.vectors["data"].shape[2] == theirs.token_index.shape[2]  # stored as held
    report = batch_cache.report()
    assert report.kv_bytes == sum(report.kv_parts.values()) == sum(layer.nbytes for layer in batch_cache.layers)


def test_eight_bits_change_the_full_cache_logits_little():
    model = tiny_model()
    ids = random_ids(60)
    with torch.inference_mode():
        plain = model(input_ids=ids, cache=cache_of(model, "full", 1.0, None)).logits
        cache = cache_of(model, "full", 1.0, 8)
        model(input_ids=ids[:, :40], cache=cache)
        quantized = model(input_ids=ids[:, 40:], cache=cache).logits
    torch.testing.assert_close(quantized, plain[:, 40:], atol=0.02 * float(plain.abs().max()), rtol=0)


@pytest.mark.parametrize("method, budget, min_tokens", [("d2o", "0.3", 5), ("h2o", "0.3", 0), ("full", "1.0", 0)])
@pytest.mark.parametrize("bits", [8, 2])
def test_a_quantized_row_peaks_within_its_plan_and_reaches_its_peak(method, budget, min_tokens, bits):
    model = tiny_model()
    chosen, quantization = d2o.get_method(method), KVQuantization(bits=bits, **TINY)
    cache = d2o.CompressedCache(model, chosen, d2o.Budget.parse(budget, min_tokens), kv_bits=quantization)
    batch = Batch.prefill(model, cache, [random_ids(40)[0].tolist()], [Sequence(None, 20)])
    peaks = peak_slots(cache, 20)
    bound = padded_bytes([0] * 4, peaks, slot_bytes(model.config, 4, chosen, kv_bits=quantization),
                         row_bytes(model.config, 4, chosen, quantization))
    assert bound <= plan(model.config, chosen, d2o.Budget.parse(budget, min_tokens), 40, 20,
                         kv_bits=quantization).held_bytes
    most = 0
    while batch.sequences:
        batch.step()
        most = max(most, batch.cache.nbytes)
    assert most <= bound
    if chosen.evicts_during_decode and bool((peaks[0] < 60).all()):
        assert most == bound, (most, bound)  # every layer reached its budget: the peak is exact


def test_a_saved_quantized_context_answers_alike(tmp_path):
    from conftest import byte_tokenizer

    model, tokenizer = tiny_model(), byte_tokenizer()
    context = d2o.compress(model, tokenizer, "a long context " * 8, "d2o-novelty", 0.5, min_tokens=0,
                           kv_bits=KVQuantization(bits=4, **TINY))
    answers = context.ask(["what?", "why?"], max_new_tokens=6).texts
    loaded = d2o.load_context(context.save(tmp_path / "c.safetensors"), model, tokenizer)
    assert loaded.cache.quantization == context.cache.quantization
    assert loaded.nbytes == context.nbytes
    assert loaded.ask(["what?", "why?"], max_new_tokens=6).texts == answers


def test_the_frontier_puts_every_run_at_its_measured_memory_and_marks_the_undominated(tmp_path):
    import json

    from d2o.eval.frontier import frontier, markdown
    from d2o.eval.results import SampleStore

    def folder(name, bits, runs):
        path = tmp_path / name
        path.mkdir()
        identity = {"task": "passkey", "protocol": "prompt", "model": "m", **({"kv_bits": bits} if bits else {})}
        (path / "config.json").write_text(json.dumps({"identity": identity}))
        store = SampleStore(path / "samples.jsonl")
        for method, budget, scores, held in runs:
            for i, score in enumerate(scores):
                store.append({"task": "passkey", "sample_id": f"s{i}", "method": method, "budget": budget,
                              "score": score, "kv_bytes": held[i], "kv_bytes_full": 1000})
        return path

    rows = frontier([folder("float", None, [("h2o", "0.05", [0, 0], [50, 50]), ("h2o", "0.2", [1, 0], [200, 200])]),
                     folder("four", 4, [("h2o", "0.2", [1, 1], [40, 60]), ("h2o", "0.3", [1, 1], [100, 100])])])
    assert [(r["kv_bits"], r["budget"], r["kv_memory"], r["score"], r["best"]) for r in rows] == [
        ("-", "0.05", 0.05, 0.0, False), (4, "0.2", 0.05, 1.0, True), (4, "0.3", 0.1, 1.0, False),
        ("-", "0.2", 0.2, 0.5, False)]  # as high a score with more memory is not on the frontier
    assert "| passkey | prompt | 5.0% | h2o | 4 | 0.2 | 2 | 1.000 | yes |" in markdown(rows)


def test_caches_that_store_keys_differently_do_not_share_a_batch():
    model = tiny_model()
    caches = [cache_of(model, "h2o", 0.5, bits) for bits in (None, 4)]
    for cache in caches:
        with torch.inference_mode():
            model(input_ids=random_ids(40), cache=cache)
    with pytest.raises(D2OError, match="store keys and values alike"):
        caches[0].join([caches[1]])


@pytest.mark.parametrize("residual", [0, 3])
def test_every_stored_token_is_the_encoding_of_its_exact_vectors_however_late_it_was_written(residual):
    model = tiny_model()
    cache = cache_of(model, "h2o", 0.5, 4, residual=residual)  # decode steps write into evicted tokens' slots
    fed = {layer.layer_idx: [] for layer in cache.layers}
    for layer in cache.layers:  # every vector the layer is given, in token order
        def update(keys, values, *args, _update=layer.update, _fed=fed[layer.layer_idx], **kwargs):
            _fed.append(torch.stack([keys, values], dim=3))
            return _update(keys, values, *args, **kwargs)
        layer.update = update
    greedy(model, random_ids(40), cache, steps=9)  # 8 decode steps: written in batches of 3 (2 left at the end)
    for layer in cache.layers:
        exact = torch.cat(fed[layer.layer_idx], dim=2)  # (1, G, tokens, 2, D)
        index = layer.token_index  # (1, G, N): which token each slot holds (-1: the empty one)
        held = index >= 0
        picked = exact.gather(2, index.clamp_min(0)[..., None, None].expand(*index.shape, 2, 16))
        expected = KVQuantization(bits=4).encode(picked)
        layer._write_out()  # the bytes it deferred
        stored = layer.slots.vectors
        assert int(held.sum()) == 2 * int(layer.budget[0]) == 2 * 20
        assert all(torch.equal(stored[part][held], expected[part][held]) for part in expected)
        assert layer.token_index.shape[2] == 21  # the budget + the slot the next token is written into
