"""A shared prefill forks into caches identical to each method's own run."""

import pytest
import torch

from d2o import Budget, D2OError, get_method
from d2o.runtime.sharing import SharedPrefill
from conftest import chosen, make_cache, random_ids, tiny_model

SHAREABLE = chosen(repeats_kv_heads=False)


def decode(model, cache, logits, steps=12):
    tokens = []
    with torch.inference_mode():
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(input_ids=token, cache=cache).logits
    return tokens


def test_forks_equal_separate_runs():
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = random_ids(160)
    methods = [get_method(name) for name in SHAREABLE]
    shared = SharedPrefill(model, methods)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=shared.cache).logits
    for index, name in enumerate(SHAREABLE):
        for budget in (0.3, "50t"):
            fork = shared.fork(index, Budget.parse(budget, min_tokens=0))
            alone = make_cache(model, name, budget)
            with torch.inference_mode():
                alone_logits = model(input_ids=ids, cache=alone).logits
            torch.testing.assert_close(alone_logits, logits)
            for a, b in zip(fork.layers, alone.layers):
                assert torch.equal(a.token_index, b.token_index), name
                torch.testing.assert_close(a.keys, b.keys)
                torch.testing.assert_close(a.values, b.values)
            assert decode(model, fork, logits) == decode(model, alone, alone_logits), name
    # The shared prefill itself kept everything, so it can be forked again.
    assert [layer.keys.shape[2] for layer in shared.cache.layers] == [160] * 4


def test_the_official_preset_cannot_share_a_prefill():
    model = tiny_model("llama")
    shared = SharedPrefill(model, [get_method("d2o")])
    with torch.inference_mode():
        model(input_ids=random_ids(50), cache=shared.cache)
    shared.methods.append(get_method("d2o-official"))
    with pytest.raises(D2OError, match="cannot share"):
        shared.fork(1, 0.5)


def test_a_compressed_cache_cannot_be_forked():
    """A fork continues from every token; a compressed cache no longer has them (nor can it hand
    over its merged slots' weights and thresholds), so forking it is refused, not approximated."""
    model = tiny_model("llama")
    cache = make_cache(model, "d2o", 0.3)
    with torch.inference_mode():
        model(input_ids=random_ids(50), cache=cache)
    with pytest.raises(D2OError, match=r"only a cache that holds every token \(budget 1.0\) can be forked"):
        cache.fork(get_method("d2o"), 0.3)
