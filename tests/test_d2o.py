"""D2O's three parts against direct reference computations."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import d2o
from d2o import Budget, D2OError, get_method
from d2o.engine.cache import CompressedCache
from d2o.methods.allocation import InverseVariance, Pyramid, conserve, layer_density
from d2o.methods.d2o import SimilarityMerge
from d2o.methods.d2o.merging import MergeState

from conftest import greedy, make_cache, merge_into, random_ids, standalone_layer as make_layer, tiny_model


def merged_layer(merge, keys, values, keep, evict, tau=None):
    """A layer holding ``keys``/``values`` that keeps the slots ``keep`` and merges ``evict`` into them
    (handed only the evicted vectors it declares it reads, as the cache does)."""
    layer = make_layer(keys, values)
    layer.state = MergeState(tau=tau)
    valid = torch.ones(evict.shape[0], evict.shape[2], dtype=torch.bool)
    evicted = layer.evicted(evict, valid, vectors=merge.vectors)
    layer.keep(keep, torch.ones(keep.shape[0], keep.shape[2], dtype=torch.bool))
    return layer, merge_into(merge, [layer], [evicted])[0]


def reference_merge(keys, values, keep, evict, tau_previous=None, alpha=0.5):
    """Loops over rows, heads and tokens: the paper's rule written out plainly."""
    batch, heads = keep.shape[:2]
    best = torch.zeros(evict.shape, dtype=torch.float64)
    target = torch.zeros(evict.shape, dtype=torch.long)
    for b in range(batch):
        for g in range(heads):
            for i, e in enumerate(evict[b, g].tolist()):
                sims = [torch.nn.functional.cosine_similarity(keys[b, g, e], keys[b, g, c], dim=0).item()
                        for c in keep[b, g].tolist()]
                best[b, g, i] = max(sims)
                target[b, g, i] = sims.index(max(sims))
    tau = best.mean(dim=(1, 2))
    if tau_previous is not None:
        tau = alpha * tau_previous + (1 - alpha) * tau
    new_keys = keys.gather(2, keep[..., None].expand(-1, -1, -1, keys.shape[-1])).double().clone()
    new_values = values.gather(2, keep[..., None].expand(-1, -1, -1, values.shape[-1])).double().clone()
    for b in range(batch):
        for g in range(heads):
            for slot, c in enumerate(keep[b, g].tolist()):
                merged = [(i, e) for i, e in enumerate(evict[b, g].tolist())
                          if target[b, g, i] == slot and best[b, g, i] >= tau[b]]
                denominator = sum(math.exp(best[b, g, i]) for i, _ in merged) + math.e
                weights = [math.exp(best[b, g, i]) / denominator for i, _ in merged]
                self_weight = math.e / denominator
                assert abs(self_weight + sum(weights) - 1.0) < 1e-12  # convex
                new_keys[b, g, slot] = self_weight * keys[b, g, c].double() + sum(
                    w * keys[b, g, e].double() for w, (_, e) in zip(weights, merged))
                new_values[b, g, slot] = self_weight * values[b, g, c].double() + sum(
                    w * values[b, g, e].double() for w, (_, e) in zip(weights, merged))
    return new_keys, new_values, tau


def test_similarity_merge_equals_the_papers_rule_and_its_ema_threshold():
    torch.manual_seed(0)
    batch, heads, n, dim = 2, 3, 12, 8
    keys, values = torch.randn(batch, heads, n, dim), torch.randn(batch, heads, n, dim)
    keep = torch.stack([torch.randperm(n)[:5].sort().values for _ in range(batch * heads)]).view(batch, heads, 5)
    evict = torch.stack([torch.tensor([i for i in range(n) if i not in row]) for row in keep.view(-1, 5).tolist()])
    evict = evict.view(batch, heads, n - 5)
    merge = SimilarityMerge()
    tau = None
    for _ in range(2):  # the second eviction uses the EMA of the first threshold
        layer, count = merged_layer(merge, keys, values, keep, evict, None if tau is None else tau.float())
        expected_keys, expected_values, expected_tau = reference_merge(keys, values, keep, evict, tau)
        torch.testing.assert_close(layer.keys.double(), expected_keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values.double(), expected_values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.state.tau.double(), expected_tau, atol=1e-6, rtol=1e-6)
        assert 0 < int(count.sum()) < batch * heads * (n - 5)  # some merged, some dropped
        tau = expected_tau


def test_merged_keys_stay_in_the_convex_hull():
    """Merging identical vectors leaves them unchanged (weights sum to one)."""
    keys = torch.ones(1, 1, 6, 4)
    values = torch.full((1, 1, 6, 4), 3.0)
    keep, evict = torch.tensor([[[0, 1]]]), torch.tensor([[[2, 3, 4, 5]]])
    layer, _ = merged_layer(SimilarityMerge(), keys, values, keep, evict)
    torch.testing.assert_close(layer.keys, torch.ones(1, 1, 2, 4))
    torch.testing.assert_close(layer.values, torch.full((1, 1, 2, 4), 3.0))


def test_official_weighting_is_the_released_codes_mean():
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
    values = torch.tensor([[[[2.0, 0.0], [0.0, 2.0], [4.0, 4.0]]]])
    layer, _ = merged_layer(SimilarityMerge(weighting="official"), keys, values, torch.tensor([[[0, 1]]]),
                            torch.tensor([[[2]]]))
    kept_keys, kept_values = layer.keys, layer.values
    similarity = 1 / math.sqrt(2)  # token 2 is equally close to both; the first wins the tie
    torch.testing.assert_close(kept_keys[0, 0, 0], (keys[0, 0, 0] + similarity * keys[0, 0, 2]) / 2)
    torch.testing.assert_close(kept_values[0, 0, 0], (values[0, 0, 0] + similarity * values[0, 0, 2]) / 2)
    torch.testing.assert_close(kept_keys[0, 0, 1], keys[0, 0, 1])


def run_tau(model, method, ids):
    cache = make_cache(model, method, 0.2)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache).logits
        for _ in range(5):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
    return [layer.method["tau"] for layer in cache.report().layers]


def test_tau_is_reset_for_every_sequence():
    model = tiny_model("llama")
    method = get_method("d2o")
    first, second = random_ids(150, seed=1), random_ids(150, seed=2)
    alone = run_tau(model, method, second)
    run_tau(model, method, first)
    after_another = run_tau(model, method, second)
    for a, b in zip(alone, after_another):
        assert a == b
    # A reset cache starts again too.
    cache = make_cache(model, method, 0.2)
    with torch.inference_mode():
        model(input_ids=first, cache=cache)
        cache.reset()
        model(input_ids=second, cache=cache)
    assert [layer.method["tau"][0][0] for layer in cache.report().layers] == [h[0][0] for h in alone]


def test_density_statistic_matches_its_definition():
    torch.manual_seed(0)
    layer = make_layer(torch.zeros(1, 2, 30, 4), torch.zeros(1, 2, 30, 4))
    mass = torch.rand(1, 2, 30, 3) ** 4
    layer.slot_state["mass"] = mass
    per_head = mass.permute(0, 1, 3, 2).reshape(6, 30)
    variance = per_head.var(dim=-1)  # unbiased, over the prompt's tokens
    expected = ((variance - variance.min()) / (variance.max() - variance.min() + 1e-6)).mean()
    torch.testing.assert_close(layer_density(layer)[0], expected)


def test_inverse_variance_budgets_favour_dense_layers_and_conserve_the_total():
    model = tiny_model("llama", num_hidden_layers=6)
    cache = make_cache(model, "d2o", 0.3)
    with torch.inference_mode():
        model(input_ids=random_ids(200), cache=cache)
    # Recompute F from an uncompressed copy of the statistics.
    reference = CompressedCache(model, get_method("d2o"), 1.0, observe=True)
    with torch.inference_mode():
        model(input_ids=random_ids(200), cache=reference)
    density = torch.tensor([float(layer_density(layer)[0]) for layer in reference.layers])
    budgets = torch.tensor([int(layer.budget) for layer in cache.layers])
    assert int(budgets.sum()) == round(6 * 0.3 * 200)
    expected = torch.softmax(-density.double(), 0) * 6 * 0.3 * 200
    assert (budgets - expected).abs().max() <= 1.0
    assert budgets[density.argmin()] == budgets.max() and budgets[density.argmax()] == budgets.min()


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40),
    lower=st.integers(0, 20),
    spare=st.integers(0, 2000),
    upper_slack=st.one_of(st.none(), st.integers(0, 300)),
)
def test_conserve_meets_the_total_within_bounds(weights, lower, spare, upper_slack):
    n = len(weights)
    upper = None if upper_slack is None else lower + upper_slack
    total = n * lower + (spare if upper is None else min(spare, n * (upper - lower)))
    budgets = conserve(torch.tensor(weights), total, lower, upper)
    assert sum(budgets) == total
    assert all(b >= lower and (upper is None or b <= upper) for b in budgets)
    shares = torch.tensor(budgets, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    for i in range(n):  # a heavier layer never gets fewer tokens (beyond rounding)
        for j in range(n):
            if w[i] > w[j]:
                assert shares[i] >= shares[j] - 1


def test_pyramid_budgets_fall_with_depth_and_keep_the_mean():
    budgets = conserve(Pyramid().layer_weights(8), 800, 5, 1000)
    assert budgets == sorted(budgets, reverse=True) and sum(budgets) == 800
    assert budgets[0] > 180 and budgets[-1] < 20


@pytest.mark.parametrize("build, parameter", [
    (lambda: get_method("d2o", split=(0, 0)), "split"),
    (lambda: get_method("d2o", merge=SimilarityMerge(alpha=1.5)), "alpha"),
    (lambda: get_method("d2o", n_sinks=-1), "n_sinks"),
    (lambda: get_method("d2o", allocation=InverseVariance(r_min=2.0)), "r_min"),
    (lambda: get_method("d2o", exempt_layers=(9,)), "exempt_layers"),  # checked against the model
    (lambda: get_method("d2o", heavy=3), "options: "),
])
def test_bad_method_options_name_the_parameter(build, parameter):
    model = tiny_model("llama")
    with pytest.raises(D2OError, match=parameter):
        cache = make_cache(model, build(), 0.5)
        with torch.inference_mode():
            model(input_ids=random_ids(50), cache=cache)


def test_official_preset_follows_the_released_code():
    model = tiny_model("llama", num_hidden_layers=6)
    ids = random_ids(200)
    cache = make_cache(model, "d2o-official", 0.2)
    reference = make_cache(model, "full", 1.0)
    with torch.inference_mode():
        first = model(input_ids=ids, cache=cache).logits
        full = model(input_ids=ids, cache=reference).logits
        assert [layer.keys.shape[2] for layer in cache.layers] == [200] * 6  # nothing evicted at prefill
        density = torch.tensor([float(layer_density(layer)[0]) for layer in cache.layers])
        token = first[:, -1:].argmax(-1)
        model(input_ids=token, cache=cache)  # the first decode step compresses, its query included
    # F_l is the prefill's own, as in the released code: the first decode step's query is not in it.
    assert [float(layer.state.density[0]) for layer in cache.layers] == density.tolist()
    torch.testing.assert_close(first, full)
    ratios = (6 * 0.2 * torch.softmax(-density.double(), 0)).clamp(0.01, 1.0)
    expected = [math.floor(201 * r * 0.5) + math.floor(201 * r * 0.5) for r in ratios.tolist()]
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths[0] == lengths[1] == lengths[5] == 201  # exempt layers keep everything
    assert lengths[2:5] == expected[2:5]
    assert all(layer.keys.shape[1] == model.config.num_attention_heads for layer in cache.layers)  # repeated


def test_official_preset_has_no_floor_unless_one_is_asked_for():
    """The released code has no floor: at the library's default (no --min-tokens) the preset keeps
    what it keeps (a floor would hold its small layers up and part the logits from the first decode
    step); a floor asked for is kept."""
    model = tiny_model("llama", num_hidden_layers=6)
    ids = random_ids(200)
    caches = {"default": d2o.CompressedCache(model, get_method("d2o-official"), 0.2),
              "no floor": make_cache(model, "d2o-official", 0.2, min_tokens=0),
              "floor asked": d2o.CompressedCache(model, get_method("d2o-official"), Budget.parse(0.2, min_tokens=128))}
    logits = {}
    for name, cache in caches.items():
        with torch.inference_mode():
            token = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
            logits[name] = model(input_ids=token, cache=cache).logits
    lengths = {name: [layer.keys.shape[2] for layer in cache.layers] for name, cache in caches.items()}
    assert lengths["default"] == lengths["no floor"] and max(lengths["default"][2:5]) < 128
    assert lengths["floor asked"][2:5] == [128] * 3
    assert caches["default"].report().min_tokens == 0 and caches["floor asked"].report().min_tokens == 128
    torch.testing.assert_close(logits["default"], logits["no floor"], atol=0, rtol=0)


def test_every_knob_is_reachable_by_name():
    method = get_method("d2o", **{"allocation": "pyramid", "merge.alpha": 0.25, "merge.on": "value", "split": (1, 1),
                                  "n_sinks": 2})
    assert isinstance(method.allocation, Pyramid) and method.merge == SimilarityMerge(alpha=0.25, on="value")
    assert get_method("d2o", merge=None).merge is None
    assert get_method("d2o", **{"allocation.r_min": 0.05}).allocation == InverseVariance(r_min=0.05)
    with pytest.raises(D2OError, match="allocation='zigzag' must be one of"):
        get_method("d2o", allocation="zigzag")
    with pytest.raises(D2OError, match=r"no option 'merge.beta': its merge \(SimilarityMerge\) has options alpha, "):
        get_method("d2o", **{"merge.beta": 1})
    with pytest.raises(D2OError, match=r"'scoring.window': its scoring \(AccumulatedAttention\) has options "
                                      r"sum_heads$"):
        get_method("d2o", **{"scoring.window": 8})  # a window needs scoring=blended
    with pytest.raises(D2OError, match="'mrege.alpha': its parts with options are allocation, merge, scoring"):
        get_method("d2o", **{"mrege.alpha": 0.3})
    with pytest.raises(D2OError, match="alpha=2"):
        get_method("d2o", **{"merge.alpha": 2})


def identical_tokens_layer(n_same: int = 3):
    """A layer of 9 tokens of which tokens 2 .. 2+n_same-1 share one key and one value, per KV head."""
    torch.manual_seed(3)
    keys, values = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.randn(1, 2, 9, 8, dtype=torch.float64)
    keys[:, :, 2:2 + n_same] = keys[:, :, 2:3]
    values[:, :, 2:2 + n_same] = values[:, :, 2:3]
    return keys, values


@pytest.mark.parametrize("blend", [True, False])
def test_a_slot_standing_for_identical_tokens_gets_their_attention_and_statistics(blend):
    """With the mass correction, merging n identical tokens into one slot is lossless, whether the
    vectors blend or only the weight moves: the output and the statistics of any query equal those
    over the n tokens uncompressed."""
    from d2o.engine.attention import _one_query_attention
    from d2o.engine.stats import StatsRequest, attention_stats

    keys, values = identical_tokens_layer()
    keep = torch.tensor([0, 1, 2, 5, 6, 7, 8]).expand(1, 2, 7)
    low = torch.zeros(1)  # a low running threshold: every identical token merges (not what is tested here)
    layer, count = merged_layer(SimilarityMerge(mass=True, weighting="count", blend=blend), keys, values, keep,
                                torch.tensor([3, 4]).expand(1, 2, 2), tau=low)
    assert int(count) == 4  # both tokens, in both KV heads
    torch.testing.assert_close(layer.log_weight[0, :, 2], torch.full((2,), math.log(3), dtype=torch.float32))
    query = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    request = StatsRequest(column_mass=True)
    full_out, full_stats = _one_query_attention(query, keys, values, torch.zeros(1, 2, 1, 9, dtype=torch.float64),
                                                None, 0.35, request)
    out, stats = _one_query_attention(query, layer.keys, layer.values, layer.logit_bias(torch.float64), None, 0.35,
                                      request)
    torch.testing.assert_close(out, full_out)
    mass = full_stats.column_mass
    merged_mass = torch.cat([mass[..., :2], mass[..., 2:5].sum(-1, keepdim=True), mass[..., 5:]], dim=-1)
    torch.testing.assert_close(stats.column_mass, merged_mass)

    # The chunked, causal statistics of the last four tokens as queries (a multi-token pass) agree too.
    queries = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    every, real = torch.ones(1, 2, 9, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)
    request = StatsRequest(column_mass=True)
    full = attention_stats(queries, keys, every, real, 0.35, request).column_mass
    kept = attention_stats(queries, layer.keys, every[..., :7], real, 0.35, request,
                           log_weight=layer.log_weight).column_mass
    torch.testing.assert_close(kept[..., 2], full[..., 2:5].sum(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kept[..., :2], full[..., :2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kept[..., 3:], full[..., 5:], atol=1e-6, rtol=1e-6)


def test_the_mass_correction_reaches_the_model_through_sdpa_and_eager():
    """A multi-token input after a lossless merge: SDPA and eager (float masks) give the logits of
    the cache that kept every token."""
    for backend in ("sdpa", "eager"):
        model = tiny_model("llama", dtype=torch.float64, attention=backend)
        ids = random_ids(40)
        whole = make_cache(model, "full", 1.0)
        merged = make_cache(model, "full", 1.0)
        with torch.inference_mode():
            model(input_ids=ids, cache=whole)
            model(input_ids=ids, cache=merged)
            for layer in merged.layers:  # token 7 becomes a copy of token 6, then merges into it: lossless
                layer.keys[:, :, 7] = layer.keys[:, :, 6]
                layer.values[:, :, 7] = layer.values[:, :, 6]
                layer.token_index[:, :, 7] = -1
                layer.slots.log_weight = layer.weights()
                layer.slots.log_weight[:, :, 6] = math.log(2)
            for layer in whole.layers:
                layer.keys[:, :, 7] = layer.keys[:, :, 6]
                layer.values[:, :, 7] = layer.values[:, :, 6]
        follow = random_ids(5, seed=8)
        with torch.inference_mode():
            expected = model(input_ids=follow, cache=whole).logits
            got = model(input_ids=follow, cache=merged).logits
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)  # log weights are kept in float32


@pytest.mark.parametrize("options, parameter", [
    ({"max_merges": -1}, "max_merges=-1"),
    ({"skip_first": 1.5}, "skip_first=1.5"),
    ({"skip_newest": -2}, "skip_newest=-2"),
    ({"min_distance": 2.5}, "min_distance=2.5"),
    ({"mass": "yes"}, "mass='yes'"),
    ({"blend": "no"}, "blend='no' must be true or false"),
    ({"blend": False}, "blend=False keeps the kept slots' vectors as they are: without mass=True"),
    ({"weighting": "mean"}, "weighting=.mean. must be one of paper, official, normalized, count, attention"),
    ({"attention": "surprisal"}, "attention=.surprisal. must be one of votes, mass"),
])
def test_merge_options_out_of_range_name_the_parameter(options, parameter):
    with pytest.raises(D2OError, match=parameter):
        get_method("d2o", **{f"merge.{name}": value for name, value in options.items()})


def test_merge_options_values_only_cap_and_skipped_targets():
    keys, values = identical_tokens_layer(n_same=4)  # tokens 2, 3, 4, 5 alike
    keep, evict = torch.tensor([0, 1, 2, 6, 7, 8]).expand(1, 2, 6), torch.tensor([3, 4, 5]).expand(1, 2, 3)
    before = keys.gather(2, keep[..., None].expand(-1, -1, -1, 8))
    low = torch.zeros(1)
    layer, _ = merged_layer(SimilarityMerge(values_only=True, weighting="count", mass=True), keys, values, keep,
                            evict, tau=low)
    torch.testing.assert_close(layer.keys, before)  # keys untouched
    torch.testing.assert_close(layer.log_weight[0, :, 2], torch.full((2,), math.log(4), dtype=torch.float32))
    layer, count = merged_layer(SimilarityMerge(max_merges=2), keys, values, keep, evict, tau=low)
    assert int(count) == 2 * 2 and layer.slot_state["merges"][0, :, 2].tolist() == [2, 2]
    layer, count = merged_layer(SimilarityMerge(skip_first=3), keys, values, keep, evict, tau=low)
    assert int(layer.slot_state["merges"][0, :, :3].sum()) == 0 and int(count) > 0  # 0, 1, 2 may not absorb


def test_min_distance_sends_a_token_past_its_neighbours_or_drops_it():
    """Token 4 is a copy of its neighbour 3 and nearly of token 8: with min_distance=1 it merges
    into 8 instead of 3; with min_distance=4 no slot may take it, so it is dropped."""
    keys, values = identical_tokens_layer(n_same=2)  # tokens 2 and 3 alike
    keys[:, :, 4] = keys[:, :, 3]
    keys[:, :, 8] = keys[:, :, 3] + 0.05 * torch.randn(8, dtype=torch.float64)
    keep, evict = torch.tensor([0, 3, 8]).expand(1, 2, 3), torch.tensor([4]).expand(1, 2, 1)
    low = torch.full((1,), -1.0)
    for distance, into in ((0, 1), (1, 2)):
        layer, count = merged_layer(SimilarityMerge(min_distance=distance), keys, values, keep, evict, tau=low)
        assert int(count) == 2 and layer.slot_state["merges"][0, :, into].tolist() == [1, 1]
        assert not torch.equal(layer.values[:, :, into], values[:, :, keep[0, 0, into]])
    layer, count = merged_layer(SimilarityMerge(min_distance=4), keys, values, keep, evict, tau=low)
    assert int(count) == 0
    torch.testing.assert_close(layer.values, values.gather(2, keep[..., None].expand(-1, -1, -1, 8)))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_token_no_slot_may_take_is_left_out_of_the_threshold_whatever_the_kv_heads(kv_heads):
    """Token 7 has no slot to go to (0 and 1 are sinks, 6 its neighbour), token 3 has slot 6: the
    first threshold is the mean best similarity of the tokens that had a slot, token 3's alone,
    with one KV head as with two."""
    keys, values = identical_tokens_layer()
    keys, values = keys[:, :kv_heads].contiguous(), values[:, :kv_heads].contiguous()
    keep, evict = torch.tensor([0, 1, 6]).expand(1, kv_heads, 3), torch.tensor([3, 7]).expand(1, kv_heads, 2)
    layer, _ = merged_layer(SimilarityMerge(skip_first=2, min_distance=1), keys, values, keep, evict)
    expected = torch.nn.functional.cosine_similarity(keys[0, :, 3], keys[0, :, 6], dim=-1).mean()
    torch.testing.assert_close(layer.state.tau.double(), expected[None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blend", [True, False])
@pytest.mark.parametrize("attention", ["votes", "mass"])
def test_attention_weighting_blends_by_the_attention_each_token_received(attention, blend):
    """weighting="attention": an evicted token weighs what its attention says against its target's
    (never more than the tokens it stands for); the slot's log weight grows by as much. With
    ``blend=False`` the weight grows alike and the slot keeps its value."""
    keys, values = identical_tokens_layer(n_same=2)  # token 3 is a copy of token 2: it merges there
    values[:, :, 3] = torch.randn(8, dtype=torch.float64)  # ... but carries another value
    keep, evict = torch.tensor([0, 1, 2, 5, 6, 7, 8]).expand(1, 2, 7), torch.tensor([3]).expand(1, 2, 1)
    for evicted_share, expected_weight in ((0.25, 0.25), (4.0, 1.0)):  # the second is capped at one token
        layer = make_layer(keys, values)
        layer.real_seen = torch.tensor([9])
        received = torch.ones(1, 2, 9, dtype=torch.float32)
        received[:, :, 3] = evicted_share
        if attention == "votes":
            layer.slot_state["votes"] = received
        else:  # accumulated over two query heads per KV head, per query that could see the token
            layer.slot_state["mass"] = (received * (9 - torch.arange(9)))[..., None].expand(-1, -1, -1, 2) / 2
        layer.state = MergeState(tau=torch.zeros(1))
        merge = SimilarityMerge(values_only=True, mass=True, weighting="attention", attention=attention, blend=blend)
        evicted = layer.evicted(evict, torch.ones(1, 1, dtype=torch.bool), vectors=merge.vectors)
        layer.keep(keep, torch.ones(1, 7, dtype=torch.bool))
        assert int(merge_into(merge, [layer], [evicted])[0]) == 2
        blended = (values[:, :, 2] + expected_weight * values[:, :, 3]) / (1 + expected_weight)
        if blend:
            torch.testing.assert_close(layer.values[:, :, 2], blended)
        else:  # every value as it was
            assert torch.equal(layer.values, values.gather(2, keep[..., None].expand(-1, -1, -1, 8)))
        torch.testing.assert_close(layer.log_weight[0, :, 2], torch.full((2,), math.log(1 + expected_weight)))
        torch.testing.assert_close(layer.keys, keys.gather(2, keep[..., None].expand(-1, -1, -1, 8)))


@pytest.mark.parametrize("name, vectors", [
    ("d2o", ("keys", "values")),  # compares keys, blends keys and values
    ("d2o-plus-blend", ("keys", "values")),  # compares keys, blends values
    ("d2o-plus", ("keys",)),  # compares keys, moves only the mass
    ("d2o-valuesim", ("keys", "values")),
    ("cam", ("values",)),  # adds values to the next kept tokens
])
def test_the_cache_copies_only_the_evicted_vectors_a_merge_reads(monkeypatch, name, vectors):
    model = tiny_model()
    cache = make_cache(model, name, 0.3)
    merge_class = type(cache.policy.merge)
    assert cache.policy.merge.vectors == vectors
    handed, merge = [], merge_class.merge
    monkeypatch.setattr(merge_class, "merge", lambda self, layers, evicted: handed.extend(evicted) or
                        merge(self, layers, evicted))
    with torch.inference_mode():
        logits = model(input_ids=random_ids(40), cache=cache).logits  # the prefill's eviction
        model(input_ids=logits[:, -1:].argmax(-1), cache=cache)  # a decode step's
    widths = {gone.token_index.shape[-1] for gone in handed}  # tokens evicted per row and head
    assert 1 in widths and max(widths) > 20
    for gone in handed:
        assert (gone.keys is not None, gone.values is not None) == ("keys" in vectors, "values" in vectors)


def test_attention_weighting_needs_the_state_it_reads():
    keys, values = identical_tokens_layer()
    layer = make_layer(keys, values)
    layer.state = MergeState(tau=torch.zeros(1))
    evicted = layer.evicted(torch.tensor([3]).expand(1, 2, 1), torch.ones(1, 1, dtype=torch.bool))
    layer.keep(torch.tensor([0, 1, 2, 5, 6, 7, 8]).expand(1, 2, 7), torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(D2OError, match="slot state 'votes'"):
        merge_into(SimilarityMerge(weighting="attention"), [layer], [evicted])


@pytest.mark.parametrize("merge", [
    SimilarityMerge(),
    SimilarityMerge(weighting="official", decision="mean_over_heads"),
    SimilarityMerge(values_only=True, mass=True, weighting="count", skip_first=1, skip_newest=1, max_merges=1),
    SimilarityMerge(min_distance=2),
    SimilarityMerge(mass=True, blend=False, weighting="count"),
])
def test_layers_merged_in_one_call_equal_each_merged_alone(merge):
    """A decode step hands every layer to one merge call, which stacks their rows: each layer must
    end exactly as a call of its own leaves it (vectors, weights, thresholds, counts)."""
    batch, heads, n, dim = 2, 3, 10, 8

    def evicting_layers():
        made = []
        for i in range(3):
            draw = torch.Generator().manual_seed(i)
            layer = make_layer(torch.randn(batch, heads, n, dim, generator=draw),
                               torch.randn(batch, heads, n, dim, generator=draw))
            layer.real_seen = torch.full((batch,), n)
            layer.state = MergeState(tau=None if i == 0 else torch.tensor([0.1, math.nan]))
            victim = torch.randint(0, n, (batch, heads, 1), generator=draw)
            evicting = torch.tensor([True, i != 1])  # row 1 of layer 1 evicts nothing
            evicted = layer.evicted(victim, evicting[:, None], vectors=merge.vectors)
            layer.drop(victim, None if bool(evicting.all()) else evicting[:, None])
            made.append((layer, evicted))
        return made

    together, alone = evicting_layers(), evicting_layers()
    counts = merge_into(merge, [layer for layer, _ in together], [gone for _, gone in together])
    for (joint, _), (single, gone), count in zip(together, alone, counts):
        assert torch.equal(merge_into(merge, [single], [gone])[0], count)
        assert torch.equal(joint.keys, single.keys) and torch.equal(joint.values, single.values)
        torch.testing.assert_close(joint.state.tau, single.state.tau, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(joint.slot_state["merges"], single.slot_state["merges"])
        if merge.mass:
            assert torch.equal(joint.log_weight, single.log_weight)
    assert sum(int(count.sum()) for count in counts) > 0  # something was merged


def novelty_caches(model, prefill_chunk=None):
    """``d2o-novelty`` as it is (its mass summed over query heads once allocated) and kept per head."""
    from d2o.methods.d2o.novelty import novelty_scores

    return [CompressedCache(model, get_method("d2o-novelty", scoring=novelty_scores(sum_heads=summed)),
                            Budget(ratio=0.2, min_tokens=0), prefill_chunk=prefill_chunk) for summed in (True, False)]


def test_d2o_novelty_sums_its_mass_over_query_heads_once_allocated():
    """The compression reads the same scores (the same slots kept, the summed mass equal to the
    per-head sum); decoding then adds each step's attention to the sum, in another order only: the
    same tokens, masses equal within float rounding, and (group - 1) fewer floats per slot."""
    model = tiny_model("llama")  # 4 query heads on 2 KV heads
    ids = random_ids(150)
    summed, per_head = novelty_caches(model)
    with torch.inference_mode():
        for cache in (summed, per_head):
            model(input_ids=ids, cache=cache)
    for one, other in zip(summed.layers, per_head.layers):
        assert one.slots.state["mass"].shape[-1] == 1 and other.slots.state["mass"].shape[-1] == 2
        assert torch.equal(one.slots.token_index, other.slots.token_index)
        assert torch.equal(one.slots.state["mass"][..., 0], other.slots.state["mass"].sum(-1))
        assert other.state_nbytes - one.state_nbytes == other.token_index.numel() * 4
    summed, per_head = novelty_caches(model)
    tokens = [greedy(model, ids, cache, steps=12) for cache in (summed, per_head)]
    assert torch.equal(*tokens)
    for one, other in zip(summed.layers, per_head.layers):
        assert torch.equal(one.slots.token_index, other.slots.token_index)
        torch.testing.assert_close(one.slots.state["mass"][..., 0], other.slots.state["mass"].sum(-1))


def test_d2o_novelty_allocates_each_chunk_from_the_mass_per_query_head():
    """A prompt in chunks is allocated anew after every chunk, from each query head's spread of mass:
    summed only after the last, the budgets are those of the mass kept per head."""
    model = tiny_model("llama")
    ids = random_ids(150)
    caches = novelty_caches(model, prefill_chunk=40)
    for cache in caches:
        with torch.inference_mode():
            cache.prefill(model, ids)
    budgets = [[int(layer.budget) for layer in cache.layers] for cache in caches]
    assert budgets[0] == budgets[1] and len(set(budgets[0])) > 1
    assert [layer.slots.state["mass"].shape[-1] for layer in caches[0].layers] == [1] * 4


def test_d2o_keeps_its_mass_per_query_head():
    """The paper's method keeps its sums as they were: per query head, added up when scored."""
    model = tiny_model("llama")
    cache = make_cache(model, "d2o", 0.2)
    greedy(model, random_ids(150), cache, steps=4)
    assert all(layer.slots.state["mass"].shape[-1] == 2 for layer in cache.layers)
