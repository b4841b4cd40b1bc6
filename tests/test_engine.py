"""The engine on tiny random-weight models of every supported architecture."""

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaModel

import d2o
from d2o import Budget
from d2o.budget import UNLIMITED

from conftest import (DENSE, SHAPE, assert_fed_at_once_as_one_by_one, greedy, kept_tokens, left_pad, make_cache,
                      random_ids, tiny_model)

ARCHS = DENSE


def forward(model, ids, cache, **kwargs):
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits


def decode(model, cache, first_logits, steps):
    """A hand-written greedy loop (no position ids: the model counts them from the cache)."""
    tokens, logits = [], first_logits
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        logits = forward(model, token, cache)
    return torch.cat(tokens, dim=1), logits


def lengths(cache):
    return [layer.keys.shape[2] for layer in cache.layers]


def kv_bytes(cache):
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [0.1, 0.35, "24t"])
def test_layers_hold_exactly_their_budgets_after_prefill_and_50_steps(arch, budget):
    model = tiny_model(arch)
    prompt = 160
    cache = make_cache(model, "d2o", budget)
    logits = forward(model, random_ids(prompt), cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert sum(budgets) == Budget.parse(budget, min_tokens=0).total(model.config.num_hidden_layers, prompt)
    assert lengths(cache) == budgets  # the tensors themselves shrank
    config = model.config
    per_token = config.num_key_value_heads * config.head_dim * 2 * 4
    assert kv_bytes(cache) == sum(budgets) * per_token
    decode(model, cache, logits, 50)
    # Each step writes its token into the slot the previous step freed: one slot beyond the budget.
    assert lengths(cache) == [b + 1 for b in budgets]
    assert kv_bytes(cache) == (sum(budgets) + len(budgets)) * per_token
    assert [int(layer.n_kept) for layer in cache.layers] == budgets
    assert cache.get_seq_length() == prompt + 50  # tokens seen, not kept
    for layer in cache.layers:
        assert layer.keys.shape[1] == config.num_key_value_heads  # KV heads never repeated


def test_sinks_and_recent_window_are_always_kept():
    model = tiny_model("llama")
    cache = make_cache(model, "d2o", 0.2)
    logits = forward(model, random_ids(200), cache)
    for step in range(30):
        for layer in cache.layers:
            budget = int(layer.budget)
            recent = budget // 4  # 3:1 split
            seen = int(layer.real_seen)
            for head in range(layer.token_index.shape[1]):
                kept = set(layer.token_index[0, head].tolist())
                assert set(range(4)) <= kept
                assert set(range(seen - recent, seen)) <= kept
        _, logits = decode(model, cache, logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_budget_one_gives_the_logits_of_the_stock_model(arch, attention):
    model = tiny_model(arch, attention=attention)
    ids = random_ids(90)
    follow = random_ids(20, seed=2)
    cache = make_cache(model, "d2o", 1.0)
    ours = [forward(model, ids, cache)] + [forward(model, follow[:, i:i + 1], cache) for i in range(20)]
    model.set_attn_implementation(attention)  # stock transformers, plain cache
    reference = DynamicCache(config=model.config)
    stock = [forward(model, ids, reference)] + [forward(model, follow[:, i:i + 1], reference) for i in range(20)]
    for a, b in zip(ours, stock):
        assert torch.equal(a, b)  # bitwise: the same kernels on the same tensors
    assert lengths(cache) == [110] * model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stays_finite(dtype):
    model = tiny_model("qwen2", dtype=dtype)
    cache = make_cache(model, "d2o", 0.2)
    logits = forward(model, random_ids(180), cache)
    _, logits = decode(model, cache, logits, 30)
    assert torch.isfinite(logits).all()
    for layer in cache.layers:
        assert layer.keys.dtype == dtype
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
        assert layer.slot_state["mass"].dtype == torch.float32  # scores accumulate in float32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_padded_batch_gives_the_tokens_of_its_prompts_one_by_one(arch):
    model = tiny_model(arch, dtype=torch.float64)
    prompts = [random_ids(n, seed=n)[0] for n in (120, 75, 96)]
    ids, mask = left_pad(prompts)
    batch_cache = make_cache(model, "d2o", 0.3)
    batched = greedy(model, ids, batch_cache, steps=30, mask=mask)
    for row, prompt in enumerate(prompts):
        cache = make_cache(model, "d2o", 0.3)
        alone = greedy(model, prompt[None], cache, steps=30)
        assert batched[row].tolist() == alone[0].tolist()
        # Same budgets, same kept tokens in every layer and head; padding never kept.
        for mine, theirs in zip(batch_cache.layers, cache.layers):
            assert int(mine.budget[row]) == int(theirs.budget[0])
            assert kept_tokens(mine, row) == kept_tokens(theirs, 0)


def test_hand_written_loop_equals_generate():
    model = tiny_model("mistral")
    ids = random_ids(150)
    generated = greedy(model, ids, make_cache(model, "d2o", 0.25), steps=25)
    cache = make_cache(model, "d2o", 0.25)
    tokens, _ = decode(model, cache, forward(model, ids, cache), 25)
    assert tokens.tolist() == generated.tolist()


def test_a_multi_token_input_after_compression_sees_the_right_tokens():
    """A question appended to a compressed context: one forward equals token-by-token feeding."""
    model = tiny_model("llama", dtype=torch.float64)
    cache = make_cache(model, "d2o", 0.2)
    forward(model, random_ids(200), cache)
    assert len(set(lengths(cache))) > 1  # layers of different lengths
    question = random_ids(9, seed=5)
    assert_fed_at_once_as_one_by_one(model, cache, question)
    # Without holding, the cache is brought back to its budgets after the multi-token input.
    forward(model, question, cache)
    assert lengths(cache) == [int(layer.budget) for layer in cache.layers]


@pytest.mark.parametrize("method", ["h2o", "snapkv", "pyramidkv", "roco", "d2o-plus"])
def test_a_chunked_prefill_under_hold_compresses_like_one_prefill(method):
    """Chunks of 60, 60, 50, 9 and 1 tokens: the last ones shorter than the methods' observation
    window (32 queries), whose rows then come from several chunks."""
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = random_ids(180)
    whole = make_cache(model, method, 0.3)
    forward(model, ids, whole)
    chunked = make_cache(model, method, 0.3)
    with chunked.hold():
        for start, end in [(0, 60), (60, 120), (120, 170), (170, 179), (179, 180)]:
            forward(model, ids[:, start:end], chunked)
        assert lengths(chunked) == [180] * 4  # nothing evicted while held
    for a, b in zip(whole.layers, chunked.layers):
        assert (a.token_index.sort(-1).values == b.token_index.sort(-1).values).all()


def test_the_official_preset_compresses_a_chunked_prefill_at_the_first_decode_step():
    """A prefill in chunks under hold() is one prefill: d2o-official compresses at the first decode
    step (that step's query included) with F_l from the whole prompt, as after a prefill in one pass.
    Before, every chunk counted as a pass: it compressed when the block ended, F_l from chunk one."""
    model = tiny_model("llama", dtype=torch.float64)
    ids, step = random_ids(180), random_ids(1, seed=5)
    whole = make_cache(model, "d2o-official", 0.3)
    forward(model, ids, whole)
    forward(model, step, whole)
    chunked = make_cache(model, "d2o-official", 0.3)
    with chunked.hold():
        for start, end in [(0, 60), (60, 120), (120, 180)]:
            forward(model, ids[:, start:end], chunked)
    assert lengths(chunked) == [180] * 4  # not compressed before its first decode step
    forward(model, step, chunked)
    assert lengths(chunked) == lengths(whole) and lengths(whole)[2] < 100
    for a, b in zip(whole.layers, chunked.layers):
        assert (a.token_index.sort(-1).values == b.token_index.sort(-1).values).all()


@pytest.mark.parametrize("method", ["snapkv", "d2o-official", "d2o-plus", "h2o"])
def test_a_reset_cache_compresses_the_next_sequence_as_a_new_cache(method):
    """The first sequence's allocation stops the layers that never evict again from observing
    (all of them for SnapKV); reset() must start them again (a reused cache raised KeyError)."""
    model = tiny_model("llama")
    first, second, step = random_ids(150, seed=1), random_ids(140, seed=2), random_ids(1, seed=3)
    fresh = make_cache(model, method, 0.3)
    reused = make_cache(model, method, 0.3)
    forward(model, first, reused)
    forward(model, step, reused)
    reused.reset()
    for cache in (fresh, reused):
        forward(model, second, cache)
        forward(model, step, cache)
    assert lengths(reused) == lengths(fresh)
    for a, b in zip(fresh.layers, reused.layers):
        assert (a.token_index.sort(-1).values == b.token_index.sort(-1).values).all()


def test_a_short_prompt_under_a_token_budget_gives_every_layer_what_the_method_needs():
    """3 tokens under 6t with PyramidKV's falling shares: the layers got 10, 7, 4 and 3 (the
    prompt's length as the only lower bound), below d2o's 5 (4 sinks + 1), so the last layers
    dropped every new token, then a sink."""
    model = tiny_model("llama")
    cache = make_cache(model, "d2o-pyramid", "6t")
    logits = forward(model, random_ids(3), cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert sum(budgets) == 24 and min(budgets) >= 5
    decode(model, cache, logits, 12)
    for layer in cache.layers:
        assert [t for t in range(4) if t in kept_tokens(layer, 0)[0]] == [0, 1, 2, 3]  # the sinks
        assert 14 in kept_tokens(layer, 0)[0]  # the newest token


def test_exempting_every_compressed_layer_is_refused():
    model = tiny_model("llama")
    for method, budget in (("d2o", 0.3), ("h2o", "100t")):
        cache = make_cache(model, method, budget, exempt_layers=(0, 1, 2, 3))
        with pytest.raises(d2o.D2OError, match=r"exempt_layers=\(0, 1, 2, 3\) exempts every layer a budget "
                                               r"compresses \(0, 1, 2, 3\): nothing would be compressed"):
            forward(model, random_ids(150), cache)


def test_prompts_within_an_absolute_budget_are_not_compressed_until_they_outgrow_it():
    model = tiny_model("llama")
    cache = make_cache(model, "h2o", "64t")
    logits = forward(model, random_ids(40), cache)
    assert lengths(cache) == [40] * 4
    decode(model, cache, logits, 30)
    assert [int(layer.n_kept) for layer in cache.layers] == [64] * 4
    assert lengths(cache) == [65] * 4  # and the slot the next token is written into


def test_sliding_window_layers_are_masked_by_true_token_distance():
    model = tiny_model("mistral", sliding_window=16)
    ids = random_ids(60)
    follow = random_ids(5, seed=3)
    cache = make_cache(model, "full", 1.0)
    ours = [forward(model, ids, cache)] + [forward(model, follow[:, i:i + 1], cache) for i in range(5)]
    model.set_attn_implementation("sdpa")
    reference = DynamicCache(config=model.config)
    stock = [forward(model, ids, reference)] + [forward(model, follow[:, i:i + 1], reference) for i in range(5)]
    for a, b in zip(ours, stock):  # the stock cache drops what leaves the window: other tensors, same logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_exempt_layers_hold_everything_and_count_against_the_total():
    model = tiny_model("llama")
    cache = make_cache(model, "d2o", 0.7, exempt_layers=(0, -1))
    forward(model, random_ids(100), cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert budgets[0] == budgets[-1] == UNLIMITED
    assert lengths(cache)[0] == lengths(cache)[-1] == 100
    assert sum(lengths(cache)) == Budget(ratio=0.7, min_tokens=0).total(4, 100)


def test_report_totals_match_the_layers():
    model = tiny_model("llama")
    cache = make_cache(model, "d2o", 0.25)
    logits = forward(model, random_ids(120), cache)
    decode(model, cache, logits, 5)
    report = cache.report()
    assert report.kv_tokens_kept == Budget(ratio=0.25, min_tokens=0).total(4, 120)
    assert sum(lengths(cache)) == report.kv_tokens_kept + 4  # one free slot per layer
    assert report.kv_tokens_full == 4 * 125
    assert report.kv_bytes == kv_bytes(cache)
    # Beside each slot's K and V in each KV head (2 of 4 query heads): its int32 token index, d2o's
    # float32 mass per query head and int32 merge count.
    assert report.state_bytes == sum(lengths(cache)) * 2 * (4 + 2 * 4 + 4)
    assert cache.nbytes == report.kv_bytes + report.state_bytes
    assert report.kv_bytes_full == 4 * 125 * 2 * 16 * 2 * 4
    assert report.layer_budgets == [int(layer.budget) for layer in cache.layers]
    assert all(len(layer.method["tau"][0]) == 6 for layer in report.layers)  # prefill + 5 decode evictions


def test_sampling_through_generate():
    model = tiny_model("llama")
    ids = random_ids(80)

    def sample(cache):
        torch.manual_seed(7)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=True,
                                 top_k=20, temperature=0.8, max_new_tokens=25, min_new_tokens=25, pad_token_id=0)
        return out[0, 80:].tolist()

    ours = sample(make_cache(model, "d2o", 1.0))
    model.set_attn_implementation("sdpa")
    assert ours == sample(DynamicCache(config=model.config))
    d2o.install(model)
    compressed = make_cache(model, "d2o", 0.3)
    assert len(sample(compressed)) == 25
    assert [int(layer.n_kept) for layer in compressed.layers] == [int(layer.budget) for layer in compressed.layers]


def test_caches_join_a_batch_whatever_slot_state_each_has_made_yet():
    """A row that has merged (D2O made its merge counts) and one that has not join one batch and
    decode as they do alone."""
    from d2o.runtime.decoding import Batch, Sequence

    model = tiny_model("llama", dtype=torch.float64)
    prompts = [random_ids(150, seed=1)[0].tolist(), random_ids(30, seed=2)[0].tolist()]

    def alone(ids):
        batch = Batch.prefill(model, make_cache(model, "d2o", 0.3, min_tokens=40), [ids], [Sequence(None, 12)])
        return batch.run()[0].tokens, batch

    expected = [alone(ids)[0] for ids in prompts]
    first, second = (Batch.prefill(model, make_cache(model, "d2o", 0.3, min_tokens=40), [ids], [Sequence(None, 12)])
                     for ids in prompts)
    assert "merges" in first.cache.layers[0].slot_state and "merges" not in second.cache.layers[0].slot_state
    first.join(second)
    assert [sequence.tokens for sequence in first.run()] == expected


def test_decode_steps_take_surprisal_from_the_logits_the_model_computed(monkeypatch):
    """A step's surprisal, -log p(token), comes from the logits the model computed at the step
    before (the output embeddings run once per step), equals the reference, and stays right when
    rows are reordered between steps (the logits are computed again then)."""
    model = tiny_model("llama")
    ids, continuation = random_ids(40, batch=2), random_ids(6, seed=2, batch=2)
    text = torch.cat([ids, continuation], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=text).logits.double()  # no d2o cache: every position
    reference = torch.logsumexp(logits[:, :-1], -1) - logits[:, :-1].gather(-1, text[:, 1:, None])[..., 0]
    cache = make_cache(model, "sirllm", 1.0)
    seen = []
    monkeypatch.setattr(type(cache.policy), "observe_tokens",
                        lambda self, cache, surprisal, input_ids: seen.append(surprisal))
    calls = []
    counter = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    forward(model, ids, cache)
    order = torch.tensor([0, 1])
    per_step = []
    for step in range(continuation.shape[1]):
        if step == 3:
            order = order.flip(0)
            cache.select_rows(torch.tensor([1, 0]))
        calls.clear()
        forward(model, continuation[order, step : step + 1], cache)
        per_step.append(len(calls))
        assert torch.allclose(seen[-1][:, 0].double(), reference[order, ids.shape[1] + step - 1], atol=1e-5)
    counter.remove()
    assert per_step == [1, 1, 1, 2, 1, 1]
    assert torch.allclose(seen[0][:, 1:].double(), reference[:, : ids.shape[1] - 1], atol=1e-5)


def test_two_threads_passes_each_hand_their_own_cache_its_logits(monkeypatch):
    """A server prefills on one thread while another decodes: a pass of the second thread that runs
    whole between the first's decoder and its output head leaves the first pass its own logits (each
    cache is handed its pass's logits once, on its own thread)."""
    model = tiny_model("llama")
    first, second = make_cache(model, "sirllm", 1.0), make_cache(model, "sirllm", 1.0)
    handed = []
    monkeypatch.setattr(type(first), "observe_logits",
                        lambda cache, hidden, logits: handed.append((cache, threading.current_thread().name)))
    inside, done = threading.Event(), threading.Event()

    calls = []

    def hold_first(module, args):
        # The first thread's model's output head (its second call: the surprisal of the prompt's tokens
        # calls it first) waits for the second thread's whole pass.
        if threading.current_thread().name == "first":
            calls.append(1)
            if len(calls) == 2:
                inside.set()
                assert done.wait(60)

    hook = model.lm_head.register_forward_pre_hook(hold_first)

    def second_pass():
        assert inside.wait(60)
        forward(model, random_ids(12, seed=3), second)
        done.set()

    threads = [threading.Thread(target=lambda: forward(model, random_ids(20), first), name="first"),
               threading.Thread(target=second_pass, name="second")]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        hook.remove()
    assert [(cache is first, name) for cache, name in handed] == [(False, "second"), (True, "first")]


def test_a_bare_decoder_compresses_and_refuses_surprisal_in_one_line():
    """A model without its output head (LlamaModel) takes d2o's hook; a method that scores by
    surprisal, which needs that head, says so."""
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(**SHAPE)).eval()
    d2o.install(model)
    cache = make_cache(model, "h2o", 0.5)
    with torch.inference_mode():
        model(input_ids=random_ids(40), cache=cache)
    assert lengths(cache) == [20] * 4
    with pytest.raises(d2o.D2OError, match="sirllm scores tokens by surprisal: it needs a model with its output"):
        with torch.inference_mode():
            model(input_ids=random_ids(40), cache=make_cache(model, "sirllm", 0.5))
    d2o.uninstall(model)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.5), (1, 1.0)])
def test_sampling_distribution_is_transformers_temperature_top_k_then_top_p(top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from d2o.runtime.decoding import Sampling

    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    expected = torch.softmax(warpers(None, logits[None].clone())[0], -1)
    ours = Sampling(temperature=0.7, top_p=top_p, top_k=top_k).probabilities(logits)
    assert int((ours > 0).sum()) == int((expected > 0).sum()) < 500
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30])
def test_a_temperature_too_small_for_float32_samples_the_likeliest_token(temperature):
    """Dividing by a temperature that is 0 (or tiny) in float32 made inf - inf = NaN, and
    multinomial failed every row of a server's batch."""
    from d2o.runtime.decoding import Sampling

    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 3
    probs = Sampling(temperature=temperature).probabilities(logits)
    assert probs.isfinite().all() and probs[logits.argmax()] == 1.0 and probs.sum() == 1.0


@pytest.mark.parametrize("top_p", [5e-324, 1e-50])
def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token(top_p):
    """A top_p that is 0 in float32 dropped every token (the first too): NaN, a 500 (found by the
    API fuzzer, tests/test_fuzz.py)."""
    from d2o.runtime.decoding import Sampling

    logits = torch.randn(500, generator=torch.Generator().manual_seed(3)) * 3
    probs = Sampling(temperature=1.0, top_p=top_p).probabilities(logits)
    assert probs.isfinite().all() and probs[logits.argmax()] == 1.0 and probs.sum() == 1.0


class _Letters:
    """A tokenizer whose token i is the i-th character of ``text``."""

    def __init__(self, text):
        self.text = text

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(self.text[t] for t in tokens)


@pytest.mark.parametrize("after_space, expected", [(True, "\nOnce"), (False, "")])
def test_a_stop_string_at_the_start_ends_the_answer_unless_told_to_wait_for_it(after_space, expected):
    from d2o.runtime.decoding import Sequence

    words = "\nOnce\nupon"
    sequence = Sequence(_Letters(words), 20, stop_strings=("\n",), stop_after_space=after_space)
    for token in range(len(words)):
        if sequence.push(token):
            break
    assert sequence.finish_reason == "stop" and sequence.text == expected


class _HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value on the host (``bool(t)``, ``int(t)``, ``t.item()``):
    on a GPU each one waits for every queued kernel."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in ("is_nonzero", "item", "_local_scalar_dense")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["h2o", "d2o"])
def test_a_decode_step_reads_the_device_a_fixed_number_of_times_whatever_the_layers(method):
    """The attention of each layer asked whether its slots were all full (or its queries all real):
    one wait per layer per step on a GPU. A padded batch, so that both questions arise."""
    counts = []
    for layers in (2, 6):
        model = tiny_model(num_hidden_layers=layers)
        ids, mask = left_pad([random_ids(40, seed=2)[0], random_ids(30, seed=3)[0]])
        cache = make_cache(model, method, "0.5")
        with torch.inference_mode():
            out = model(ids, attention_mask=mask, cache=cache)
            for _ in range(2):
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                with _HostReads() as reads:
                    out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, cache=cache)
        counts.append(reads.count)
    assert counts[0] == counts[1]


def test_an_attention_whose_cache_layer_took_no_keys_is_refused_in_that_pass():
    """The hook binds a layer by its module's index: one whose update did not run (the model kept its
    keys elsewhere) is an error at once, where attending without the cache would answer wrongly."""
    model = tiny_model("llama")
    cache = make_cache(model, "h2o", 0.5)
    cache.layers[1].update = lambda keys, values, *args, **kwargs: (keys, values)  # returned, never stored
    with pytest.raises(d2o.D2OError, match="layer 1 of a pass with a compressed cache, but that layer of the cache "
                                           "took no keys"):
        forward(model, random_ids(20), cache)
    assert int(cache.layers[0].seen) == 20 and cache.layers[1].token_index is None
