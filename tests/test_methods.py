"""Every registered method through the same checks, and reference computations for four of them."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import d2o
from transformers import DynamicCache

from d2o import Budget, D2OError, get_method
from d2o.engine.stats import AttentionStats
from d2o.methods import REGISTRY
from d2o.methods import scoring
from d2o.methods.base import HeavyRecent
from d2o.methods.snapkv import SnapKV

from conftest import ABLATIONS, CHOSEN, byte_tokenizer, greedy, left_pad, make_cache, random_ids, tiny_model

METHODS = CHOSEN
# Methods whose total after the prefill is not held to round(L * rho * S).
UNCONSERVED = {name for name in CHOSEN
               if REGISTRY[name].cls.keeps_everything or not REGISTRY[name].cls.conserves_budget}
STEPS = 40


def promised(method, layer, row, budget):
    """(sinks, newest) token counts the method promises to keep in a layer holding `budget`."""
    if isinstance(method, SnapKV):
        return method.n_sinks, min(budget, method.window)
    recent = getattr(layer.state, "recent", None)
    if isinstance(method, HeavyRecent) and recent is None:
        return method.n_sinks, int(method.n_recent(torch.tensor([budget]))[0])
    if recent is not None:  # the official preset's own recent part
        return method.n_sinks, min(int(recent[row]), budget - method.n_sinks)
    return method.n_sinks, 0


def check_promises(cache, row, seen_row):
    method = cache.policy
    for layer in cache.layers:
        kept = layer.token_index[row]
        budget = int(layer.budget[row]) if layer.budget is not None else -1
        if budget < 0:
            continue
        sinks, newest = promised(method, layer, row, budget)
        for head in kept:
            tokens = set(head[head >= 0].tolist())
            assert set(range(sinks)) <= tokens
            if method.evicts_during_decode:
                assert set(range(seen_row - newest, seen_row)) <= tokens


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_batch_equals_one_by_one_with_exact_lengths_and_promises(name, arch, attention):
    model = tiny_model(arch, dtype=torch.float64, attention=attention)
    prompts = [random_ids(n, seed=n)[0] for n in (140, 96, 120)]  # budgets above SnapKV's window
    ids, mask = left_pad(prompts)
    batch_cache = make_cache(model, name, 0.5)
    batched = greedy(model, ids, batch_cache, steps=STEPS, mask=mask)
    n_layers = model.config.num_hidden_layers
    for row, prompt in enumerate(prompts):
        cache = make_cache(model, name, 0.5)
        alone = greedy(model, prompt[None], cache, steps=STEPS)
        assert batched[row].tolist() == alone[0].tolist()
        seen = len(prompt) + STEPS - 1  # the last generated token is never fed back
        budgets = [int(layer.budget[0]) for layer in cache.layers]
        for mine, theirs, budget in zip(batch_cache.layers, cache.layers, budgets):
            assert int(mine.budget[row]) == budget
            assert int(mine.n_kept[row]) == int(theirs.n_kept[0])
            evicts = budget >= 0 and cache.policy.evicts_during_decode
            expected = seen if budget < 0 else budget + (0 if evicts else STEPS - 1)
            assert int(theirs.n_kept[0]) == expected
            # One sequence: no empty slot but the one an evicting layer frees for its next token.
            assert theirs.keys.shape[2] == expected + evicts
        if name not in UNCONSERVED:
            assert sum(budgets) == Budget(ratio=0.5, min_tokens=0).total(n_layers, len(prompt))
        check_promises(batch_cache, row, seen)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_after_prefill_every_method_holds_the_same_total(name, arch):
    model = tiny_model(arch)
    cache = make_cache(model, name, 0.3)
    with torch.inference_mode():
        model(input_ids=random_ids(150), cache=cache)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    if cache.policy.keeps_everything or cache.policy.compress_after_forward > 1:  # the latter at the first decode step
        assert lengths == [150] * 4
    else:
        assert sum(lengths) == round(4 * 0.3 * 150)
        assert lengths == [int(layer.budget) for layer in cache.layers]


@pytest.mark.parametrize("name", METHODS)
def test_each_slot_holds_the_state_the_memory_plan_counts(name):
    """``slot_state_bytes`` is what the plan counts beside K and V: no layer holds more per slot,
    and one holds that much (merge counts and weights appear with a layer's first merge); decoding,
    the figure once allocated (``d2o-novelty``'s mass summed over query heads), never above."""
    model = tiny_model("llama")
    cache = make_cache(model, name, 0.3)
    greedy(model, random_ids(150), cache, steps=STEPS)
    per_slot = []
    for layer in cache.layers:
        group = model.config.num_attention_heads // layer.token_index.shape[1]  # d2o-official: 1
        state_bytes = cache.policy.allocated_state_bytes(group)
        assert state_bytes <= cache.policy.slot_state_bytes(group)
        bound = layer.token_index.numel() * (4 + state_bytes)  # an int32 index each
        assert layer.state_nbytes <= bound
        per_slot.append(layer.state_nbytes / bound)
    assert max(per_slot) == 1


@pytest.mark.parametrize("name", METHODS)
def test_budget_one_equals_the_full_cache(name):
    model = tiny_model("qwen2")
    ids, follow = random_ids(80), random_ids(STEPS, seed=9)
    cache = make_cache(model, name, 1.0)
    reference = DynamicCache(config=model.config)
    with torch.inference_mode():
        ours = [model(input_ids=ids, cache=cache).logits]
        ours += [model(input_ids=follow[:, i:i + 1], cache=cache).logits for i in range(STEPS)]
        model.set_attn_implementation("sdpa")
        stock = [model(input_ids=ids, cache=reference).logits]
        stock += [model(input_ids=follow[:, i:i + 1], cache=reference).logits for i in range(STEPS)]
    for a, b in zip(ours, stock):
        assert torch.equal(a, b)  # bitwise: the same kernels on the same tensors


@pytest.mark.parametrize("name", METHODS)
def test_float16_stays_finite(name):
    model = tiny_model("llama", dtype=torch.float16)
    cache = make_cache(model, name, 0.3)
    with torch.inference_mode():
        logits = model(input_ids=random_ids(150), cache=cache).logits
        for _ in range(20):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
            assert torch.isfinite(logits).all()
    for layer in cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


# -- reference computations on explicit attention matrices -------------------------------------
PROMPT, BUDGET = 120, 0.5  # 60 tokens per layer


@pytest.fixture(scope="module")
def explicit():
    """A float64 model, its prompt, and the stock eager attention matrices (L x (B, H, S, S))."""
    model = tiny_model("llama", dtype=torch.float64)
    ids = random_ids(PROMPT, seed=4)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    d2o.install(model, "eager")
    return model, ids, [a[0] for a in attentions]


def kept_after_prefill(model, ids, method):
    cache = make_cache(model, method, BUDGET)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache)
    return [[set(head.tolist()) for head in layer.token_index[0]] for layer in cache.layers]


def top(scores, k, among):
    """The k best of `among` by score (positions); equal scores go to the newer token."""
    among = torch.as_tensor(list(among)).flip(0)
    order = scores[among].argsort(descending=True, stable=True)
    return set(among[order[:k]].tolist())


def per_kv_head(attention, group=2):
    return attention.view(-1, group, *attention.shape[1:])


def test_h2o_keeps_the_heavy_hitters_of_the_column_sums(explicit):
    model, ids, attentions = explicit
    budget, recent = 60, 30
    for layer, attention in zip(kept_after_prefill(model, ids, "h2o"), attentions):
        mass = per_kv_head(attention).sum(dim=(1, 2))  # sum over the group's heads and the queries
        for head, kept in enumerate(layer):
            window = set(range(PROMPT - recent, PROMPT))
            assert kept == window | top(mass[head], budget - recent, range(PROMPT - recent))


def test_tova_keeps_what_the_last_query_attends_to(explicit):
    model, ids, attentions = explicit
    for layer, attention in zip(kept_after_prefill(model, ids, "tova"), attentions):
        last = attention[:, -1].mean(0)  # mean over all query heads
        expected = top(last, 60, range(PROMPT))
        assert all(kept == expected for kept in layer)


def test_snapkv_keeps_the_pooled_window_votes(explicit):
    model, ids, attentions = explicit
    window, kernel = 32, 7
    for layer, attention in zip(kept_after_prefill(model, ids, "snapkv"), attentions):
        votes = attention[:, -window:, :-window].sum(1)  # (H, S - w): the prefix alone is pooled
        pooled = F.max_pool1d(votes[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
        scores = per_kv_head(pooled).mean(1)
        for head, kept in enumerate(layer):
            expected = set(range(PROMPT - window, PROMPT)) | top(scores[head], 60 - window, range(PROMPT - window))
            assert kept == expected


def test_snapkv_pools_the_prefix_alone():
    """The window's votes for its own tokens do not spill onto the prefix tokens just before it."""
    window = torch.zeros(1, 1, 1, 4, 12)  # 4 queries over 12 slots, the last 4 their own tokens
    window[..., 8:] = 1.0
    window[..., 2] = 0.5
    observed = get_method("snapkv", window=4).observe(SimpleNamespace(slot_state={}), AttentionStats(4, window=window))
    assert observed.slot_state["votes"][0, 0, :8].tolist() == [2.0] * 6 + [0.0, 0.0]


def reference_spread(values, before, after):
    """Each position gets the largest value of the positions from `after` before it to `before` after it."""
    n = values.shape[-1]
    return torch.stack([values[..., max(0, t - after): t + before + 1].amax(-1) for t in range(n)], dim=-1)


def reference_words(ids, limit):
    """Each token's word (an index): a word starts at a token whose text begins with a blank, and is cut
    every `limit` tokens."""
    tokenizer, words, length = byte_tokenizer(), [], 0
    for i, token in enumerate(ids.tolist()):
        length += 1
        if i == 0 or tokenizer.decode([token])[:1].isspace() or length > limit:
            words.append(i)
            length = 1
        else:
            words.append(words[-1])
    return torch.tensor(words)


def max_per_word(values, words):
    return torch.stack([values[..., words == word].amax(-1) for word in words.tolist()], dim=-1)


@pytest.mark.parametrize("name", ["d2o-plus", "d2o-plus-words"])
def test_d2o_plus_keeps_by_blended_scores_with_forward_spans(explicit, name):
    """d2o-plus's token level (no merge, uniform budgets): mass share + the max-vote share of the last 32
    queries spread 3 back / 8 forward (then, for d2o-plus-words, to every token of the word it reaches)
    + twice the surprisal share spread 3 back / 16 forward."""
    model, ids, attentions = explicit
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()  # no d2o cache: every position, nothing evicted
    surprisal = torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    surprisal = reference_spread(torch.cat([torch.zeros(1, dtype=surprisal.dtype), surprisal]), 3, 16)
    words = reference_words(ids[0], 64)
    assert 4 <= len(set(words.tolist())) <= PROMPT // 8  # words of many tokens to reach
    method = get_method(name, merge=None, allocation="uniform")
    budget, recent = 60, 15  # 3:1 split, 4 sinks
    for layer, attention in zip(kept_after_prefill(model, ids, method), attentions):
        grouped = per_kv_head(attention)  # (G, group, S, S)
        mass = grouped.sum(dim=(1, 2))
        votes = reference_spread(grouped[:, :, -32:].amax(dim=(1, 2)), 3, 8)
        if name == "d2o-plus-words":
            votes = max_per_word(votes, words)
        shares = [mass / mass.sum(-1, keepdim=True), votes / votes.sum(-1, keepdim=True), surprisal / surprisal.sum()]
        scores = shares[0] + shares[1] + 2 * shares[2]
        for head, kept in enumerate(layer):
            expected = set(range(4)) | set(range(PROMPT - recent, PROMPT))
            assert kept == expected | top(scores[head], budget - len(expected), range(4, PROMPT - recent))


def test_words_start_at_a_blank_and_are_cut_after_padding_and_at_the_limit():
    token_index = torch.tensor([[-1, -1, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    starts = torch.tensor([[True, False, False, False, True, False, False, False, False],
                           [False, False, True, False, False, False, False, False, True]])
    first = scoring.word_first_tokens(token_index, starts, limit=3)
    # row 0: two pads, then a word opened by the first real token, one by a blank, cut after 3 tokens
    assert first.tolist() == [[-1, -1, 5, 5, 7, 7, 7, 10, 10], [0, 0, 2, 2, 2, 5, 5, 5, 8]]
    votes = torch.tensor([[[0.0, 0.0, 0.125, 0.5, 0.0, 0.25, 0.0, 0.0, 0.75]]])
    valid = (token_index[:1] >= 0)[:, None]
    valid[..., 8] = False  # an empty slot neither gives nor gets a vote
    most = scoring.max_over_words(votes, first[:1, None], valid, seen=12)
    assert most.tolist() == [[[0.0, 0.0, 0.5, 0.5, 0.25, 0.25, 0.25, 0.0, 0.0]]]


def reference_sentence_means(values, ends, limit):
    """Each token gets the mean of its sentence: the tokens after an end up to and including the
    next, cut every `limit` tokens."""
    means, sentence = [], []
    for value, end in zip(values.tolist(), ends):
        sentence.append(value)
        if end or len(sentence) == limit:
            means += [sum(sentence) / len(sentence)] * len(sentence)
            sentence = []
    return torch.tensor(means + [sum(sentence) / len(sentence)] * len(sentence), dtype=values.dtype)


def test_d2o_novelty_keeps_by_attention_surprisal_and_sentence_novelty(explicit):
    """d2o-novelty's token level (no merge, uniform budgets): mass share + twice the surprisal share
    spread 3 back / 16 forward + ten times the share of each token's sentence's mean surprisal
    (sentences end at a token whose text holds . ! ? or a line break; at most 64 tokens)."""
    model, ids, attentions = explicit
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()  # no d2o cache: every position, nothing evicted
    surprisal = torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    surprisal = torch.cat([torch.zeros(1, dtype=surprisal.dtype), surprisal])
    tokenizer = byte_tokenizer()
    ends = [any(mark in tokenizer.decode([token]) for mark in ".!?\n") for token in ids[0].tolist()]
    assert 3 <= sum(ends) <= PROMPT // 4  # the random prompt has sentences to tell apart
    novelty = reference_sentence_means(surprisal, ends, 64)
    spread = reference_spread(surprisal, 3, 16)
    method = get_method("d2o-novelty", merge=None, allocation="uniform")
    budget, recent = 60, 15  # 3:1 split, 4 sinks
    for layer, attention in zip(kept_after_prefill(model, ids, method), attentions):
        mass = per_kv_head(attention).sum(dim=(1, 2))
        scores = mass / mass.sum(-1, keepdim=True) + 2 * spread / spread.sum() + 10 * novelty / novelty.sum()
        for head, kept in enumerate(layer):
            expected = set(range(4)) | set(range(PROMPT - recent, PROMPT))
            assert kept == expected | top(scores[head], budget - len(expected), range(4, PROMPT - recent))


def test_sentence_means_cut_long_sentences_and_skip_padding():
    values = torch.tensor([[9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    ends = torch.tensor([[False, True, False, True, False, False, False, False],
                         [False, False, True, False, False, False, False, True]])
    real = torch.tensor([[False, False, True, True, True, True, True, True], [True] * 8])
    means = scoring.sentence_means(values, ends, real, limit=3)
    # row 0: two pads (no value, no share), then [1, 2] ends, then [3, 4, 5] cut at 3, then [6]
    assert means[0].tolist() == [0.0, 0.0, 1.5, 1.5, 4.0, 4.0, 4.0, 6.0]
    assert means[1].tolist() == [2.0, 2.0, 2.0, 5.0, 5.0, 5.0, 7.5, 7.5]


def test_spreads_follow_token_order_whatever_the_slots():
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(2, 3, 20, generator=generator)
    in_order = scoring.spread(values, (3, 8))
    assert torch.equal(in_order, reference_spread(values, 3, 8))
    order = torch.stack([torch.randperm(20, generator=generator) for _ in range(6)]).view(2, 3, 20)
    token_index = torch.cat([order, torch.full((2, 3, 2), -1)], dim=-1)  # slots in any order, two empty
    slotted = torch.cat([values.gather(-1, order), torch.full((2, 3, 2), 5.0)], dim=-1)
    spread = scoring.spread_in_token_order(slotted, token_index, (3, 8))
    assert torch.equal(spread[..., :20], in_order.gather(-1, order))  # each token's own spread value
    assert torch.equal(spread[..., 20:], torch.zeros(2, 3, 2))  # empty slots spread nothing and get nothing


def test_streamingllm_keeps_sinks_and_the_last_tokens(explicit):
    model, ids, _ = explicit
    for layer in kept_after_prefill(model, ids, "streamingllm"):
        assert all(kept == set(range(4)) | set(range(PROMPT - 56, PROMPT)) for kept in layer)


def test_local_keeps_the_last_tokens(explicit):
    model, ids, _ = explicit
    for layer in kept_after_prefill(model, ids, "local"):
        assert all(kept == set(range(PROMPT - 60, PROMPT)) for kept in layer)


def test_pyramidkv_budgets_fall_with_depth_and_keep_the_mean():
    model = tiny_model("llama", num_hidden_layers=6)
    cache = make_cache(model, "pyramidkv", 0.4)
    with torch.inference_mode():
        model(input_ids=random_ids(200), cache=cache)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert sum(budgets) == round(6 * 0.4 * 200)
    assert min(budgets) >= cache.policy.min_layer_budget == 9  # its observation window (8, the authors') + 1


def test_cam_merges_values_only_and_reproducibly():
    model = tiny_model("llama")
    ids = random_ids(150)
    runs = []
    for name in ("cam", "cam", "h2o"):
        cache = make_cache(model, name, 0.3)
        with torch.inference_mode():
            model(input_ids=ids, cache=cache)
        runs.append(cache.layers)
    for first, again, plain in zip(*runs):
        assert torch.equal(first.values, again.values) and int(first.merged) > 0  # seeded draws
        # Each evicted token is merged with the probability the current query's attention gives
        # (from accumulated attention that probability was 1: every one of the 210 was merged).
        assert int(first.merged) < (150 - int(first.n_kept[0])) * first.keys.shape[1]
        # H2O's choice of tokens and keys; values received merges.
        assert torch.equal(first.token_index, plain.token_index)
        assert torch.equal(first.keys, plain.keys)
        assert not torch.equal(first.values, plain.values)


def test_sirllm_keeps_the_most_surprising_tokens():
    model = tiny_model("llama")
    ids = random_ids(150)
    cache = make_cache(model, "sirllm", 0.3)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits  # no d2o cache: every position, nothing evicted
    surprisal = torch.logsumexp(logits[0, :-1].float(), -1) - logits[0, :-1].float().gather(-1, ids[0, 1:, None])[:, 0]
    surprisal = torch.cat([torch.zeros(1), surprisal])
    with torch.inference_mode():
        model(input_ids=ids, cache=cache)
    recent = 45 // 2
    scored = 45 - recent - 4
    expected = set(range(4)) | set(range(150 - recent, 150)) | top(surprisal, scored, range(4, 150 - recent))
    for layer in cache.layers:
        assert all(set(head.tolist()) == expected for head in layer.token_index[0])


@pytest.mark.parametrize("look, merged", [(0.4, 1), (0.0, 0)])
def test_cam_merges_by_the_current_querys_look_into_the_next_span(look, merged):
    """Token 3 leaves a layer holding tokens 0-9; the current query looks at the two kept tokens
    after it (span 2) with 0.2 each and at it with ``look``: p = look / 0.2, clamped (here 1 or 0).
    Merged, each of the two receives value / span."""
    from d2o.engine.api import Evicted
    from d2o.methods.cam import LAST_LOOK, ProminenceMerge

    kept = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 9])
    values = torch.zeros(1, 1, 9, 2)
    layer = SimpleNamespace(values=values, token_index=kept.view(1, 1, 9), valid=torch.ones(1, 1, 9, dtype=torch.bool),
                            n_kept=torch.tensor([9]), real_seen=torch.tensor([10]), layer_idx=0,
                            slot_state={LAST_LOOK: torch.full((1, 1, 9), 0.2)})
    gone = Evicted(keys=torch.zeros(1, 1, 1, 2), values=torch.tensor([[[[4.0, -2.0]]]]),
                   token_index=torch.tensor([[[3]]]), valid=torch.ones(1, 1, dtype=torch.bool),
                   slot_state={LAST_LOOK: torch.full((1, 1, 1), look)})
    result = ProminenceMerge(span=2).merge([layer], [gone])[0]
    assert result.count.tolist() == [merged]
    expected = torch.zeros(9, 2)
    expected[3:5] = torch.tensor([2.0, -1.0]) * merged  # tokens 4 and 5, slots 3 and 4
    assert torch.equal(result.values[0, 0], expected) and torch.equal(values, torch.zeros(1, 1, 9, 2))
    assert (result.changed[0, 0] != 0).tolist() == [i in (3, 4) and bool(merged) for i in range(9)]


@pytest.mark.parametrize("name, options, budget, parameter", [
    ("snapkv", {"window": 64}, 0.3, "window 64"),
    ("snapkv", {"kernel": 4}, 0.3, "kernel=4 must be odd"),
    ("pyramidkv", {"pooling": "median"}, 0.3, "pooling='median'"),
    ("roco", {"window": 0}, 0.3, "window=0"),
    ("sirllm", {"decay": 0.0}, 0.3, "decay=0.0"),
    ("cam", {"span": 0}, 0.3, "span"),
    ("h2o", {"split": (1, 2, 3)}, 0.3, "split"),
    ("streamingllm", {"n_sinks": 40}, 0.2, "40 sinks"),
    ("tova", {"window": 3}, 0.3, "options: "),
    ("d2o", {"parity": "official"}, 0.3, "bad option for method 'd2o'"),
    ("d2o-plus", {"scoring.span": (3, -1)}, 0.3, "span=\\(3, -1\\)"),
    ("d2o-plus", {"scoring.surprisal_span": 4}, 0.3, "surprisal_span=4"),
    ("d2o-plus", {"scoring.votes": "mean"}, 0.3, "votes='mean'"),
    ("d2o-plus", {"scoring.surprisal": -1.0}, 0.3, "surprisal=-1.0"),
    ("d2o-plus", {"scoring.window": 0}, 0.3, "scoring.window=0 does not keep"),
    ("d2o-plus", {"scoring.words": "yes"}, 0.3, "words='yes' must be true or false"),
    ("d2o-plus-words", {"scoring.word_limit": 0}, 0.3, "word_limit=0 must be a whole number of tokens"),
    ("h2o", {"n_sinks": 1.5}, 0.3, "n_sinks=1.5 must be a whole number"),
    ("h2o", {"n_sinks": True}, 0.3, "n_sinks=True must be a whole number"),
    ("h2o", {"split": (1.5, 1)}, 0.3, "split=\\(1.5, 1\\) must be two non-negative parts"),
    # Components of the wrong type (an option's "none" or a number) failed deep in the engine:
    ("h2o", {"split": None}, 0.3, "split=None must be two parts"),
    ("d2o", {"allocation": None}, 0.3, "allocation=None must be an allocation"),
    ("d2o", {"scoring": 3}, 0.3, "scoring=3 must be a scoring"),
    ("d2o", {"merge": 5}, 0.3, "merge=5 must be a merge"),
    ("d2o", {"exempt_layers": ("a",)}, 0.3, "exempt_layers=\\('a',\\) must be layer indices"),
    ("d2o-official", {"exempt_layers": (99,)}, 0.3, "exempt_layers=99 is not a layer of a 4-layer model"),
    ("full", {"allocation": "pyramid"}, 0.3, "full keeps every token and takes no options \\(given: allocation\\)"),
])
def test_out_of_range_method_options_name_the_parameter(name, options, budget, parameter):
    model = tiny_model("llama")
    with pytest.raises(D2OError, match=parameter):
        method = get_method(name, **options)
        cache = make_cache(model, method, budget)
        with torch.inference_mode():
            model(input_ids=random_ids(150), cache=cache)
            model(input_ids=random_ids(1), cache=cache)  # d2o-official allocates at its first decode step


@pytest.mark.parametrize("name", ABLATIONS)
def test_every_ablation_is_its_method_with_other_parts_and_holds_the_budget(name):
    entry = REGISTRY[name]
    model = tiny_model("llama")
    cache = make_cache(model, name, 0.3)
    greedy(model, random_ids(150), cache, steps=12)
    assert type(cache.policy) is REGISTRY[entry.base].cls and cache.policy != get_method(entry.base)
    budgets = [int(layer.budget[0]) for layer in cache.layers]
    assert sum(budgets) == round(4 * 0.3 * 150)
    assert [int(layer.n_kept[0]) for layer in cache.layers] == budgets  # each step evicts what it adds


def test_the_catalogue_lists_the_methods_to_choose_and_the_ablations_on_request():
    from typer.testing import CliRunner

    from d2o.cli import app

    def listed(*args):
        result = CliRunner().invoke(app, ["methods", *args])
        assert result.exit_code == 0, result.output
        return [line.split()[0] for line in result.output.splitlines() if line and not line.startswith(" ")]

    chosen = listed()
    ablations = [name for name, entry in REGISTRY.items() if entry.ablation]
    assert chosen[:-1] == [name for name in REGISTRY if name not in ablations]  # then "N ablations more: ..."
    assert chosen[-1] == str(len(ablations))
    assert {"full", "kvzip", "expected-attention", "d2o", "d2o-official", "d2o-plus", "d2o-novelty"} <= set(chosen)
    assert {"d2o-nomerge", "d2o-plus-nowindow", "d2o-novelty-uniform"} <= set(ablations)
    assert listed("--all") == list(REGISTRY)
