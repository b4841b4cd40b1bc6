"""Query-agnostic scores against reference computations: KVzip's reconstruction attention (from the
stock model's eager attention probabilities) and Expected Attention's (from the queries before
RoPE, captured where the model computes them)."""

import pytest
import torch

import d2o
from d2o import D2OError, get_method
from d2o.methods.kvzip import RECALL, REPEAT, REPEAT_PART, reconstruction, reply_suffix

from conftest import byte_tokenizer, make_cache, random_ids, tiny_model


def probe_attention(model, prompt: torch.Tensor, probe: list[int]) -> list[torch.Tensor]:
    """Per layer, the stock model's attention probabilities (H, q, T) of the probe's queries when
    the prompt and the probe are fed as one sequence (eager attention)."""
    model.set_attn_implementation("eager")
    try:
        ids = torch.cat([prompt, torch.tensor([probe])], dim=1)
        with torch.inference_mode():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        d2o.install(model)
    return [layer[0, :, -len(probe):] for layer in attentions]


def expected_recall(model, prompt, probe, start, end, n_sinks=4) -> torch.Tensor:
    """(L, G, n) KVzip's scores of the prompt's tokens [start, end): each row renormalised over the
    sinks before the chunk, the chunk and the probe's own tokens; the most over the probe's queries
    and the group's heads."""
    n = prompt.shape[1]
    kv_heads = model.config.num_key_value_heads
    visible = torch.zeros(n + len(probe), dtype=torch.bool)
    visible[: min(n_sinks, start)] = True
    visible[start:end] = visible[n:] = True
    scores = []
    for probs in probe_attention(model, prompt, probe):
        probs = probs * visible
        probs = probs / probs.sum(-1, keepdim=True)
        heads = probs[:, :, start:end].amax(1)  # (H, n)
        scores.append(heads.view(kv_heads, -1, end - start).amax(1))
    return torch.stack(scores)


@pytest.mark.parametrize("chunk", [1000, 70])
def test_kvzip_scores_are_the_most_attention_the_reconstruction_pays(chunk):
    model = tiny_model("llama", dtype=torch.float64)
    prompt = random_ids(150)
    cache = d2o.CompressedCache(model, get_method("kvzip", chunk=chunk), 1.0, observe=True)
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache)
    passes = reconstruction(byte_tokenizer(), [prompt[0].tolist()], chunk, overlap=8)
    assert len(passes) == (1 if chunk >= 150 else 3)
    recall = torch.stack([layer.slot_state[RECALL][0] for layer in cache.layers])  # (L, G, 150)
    for probe in passes:
        start, end = probe.spans[0]
        expected = expected_recall(model, prompt, probe.ids[0], start, end)
        torch.testing.assert_close(recall[:, :, start:end], expected.float(), atol=1e-7, rtol=1e-5)
    # The probes left no token behind: the cache holds the prompt, at its positions.
    assert [layer.keys.shape[2] for layer in cache.layers] == [150] * 4
    assert all(layer.seen == 150 and int(layer.real_seen) == 150 for layer in cache.layers)
    assert cache.layers[0].token_index[0, 0].tolist() == list(range(150))


def test_kvzip_probe_asks_to_repeat_each_chunk_as_the_authors_do():
    tokenizer = byte_tokenizer()
    prompt = list(range(10, 110))
    first, second = reconstruction(tokenizer, [prompt, prompt[:30]], chunk=60, overlap=8)
    suffix = tokenizer(reply_suffix(tokenizer), add_special_tokens=False).input_ids
    assert suffix == tokenizer("\n").input_ids  # no chat template: kvpress's "\n"
    assert first.ids[0] == tokenizer(REPEAT).input_ids + suffix + prompt[:60]
    assert first.spans == [(0, 60), (0, 30)]
    assert second.ids[0] == tokenizer(REPEAT_PART).input_ids + prompt[52:60] + suffix + prompt[60:]
    assert second.ids[1] == [] and second.spans[1] == (30, 30)  # the short row sits the second chunk out
    # A memory plan reserves the longest pass beside the prompt (one token per byte: the worst case).
    assert max(len(ids) for ids in first.ids + second.ids) <= get_method("kvzip", chunk=60).probe_tokens(100)


def test_kvzip_layers_keep_their_share_of_the_highest_scores():
    model = tiny_model("qwen2", num_hidden_layers=6)
    prompt = random_ids(200)
    observed = d2o.CompressedCache(model, get_method("kvzip"), 1.0, observe=True)
    cache = make_cache(model, "kvzip", 0.25)
    with torch.inference_mode():
        model(input_ids=prompt, cache=observed)
        model(input_ids=prompt, cache=cache)
    scores = torch.stack([get_method("kvzip").score(layer)[0] for layer in observed.layers])  # (L, G, N)
    total = round(6 * 0.25 * 200)
    top = scores.flatten().topk(total * 2).indices // scores[0].numel()  # two KV heads per layer
    counts = torch.bincount(top, minlength=6)
    budgets = [int(layer.budget) for layer in cache.layers]
    assert sum(budgets) == total
    # conserve() rounds counts over two heads to whole tokens per layer: within one token of half each count
    assert all(abs(b - c / 2) <= 1 for b, c in zip(budgets, counts.tolist()))
    for layer, observed_layer, budget in zip(cache.layers, observed.layers, budgets):
        for head in range(2):  # each KV head keeps its own best `budget` (the sinks first)
            best = get_method("kvzip").score(observed_layer)[0, head].topk(budget).indices
            assert sorted(layer.token_index[0, head].tolist()) == sorted(best.tolist())


def test_a_probing_method_needs_the_models_tokenizer():
    model = tiny_model("llama")
    model.config._name_or_path = ""
    cache = make_cache(model, "kvzip", 0.3)
    with pytest.raises(D2OError, match=r"kvzip writes text of its own into its probe and needs the model's "
                                       r"tokenizer.*CompressedCache\(\.\.\., tokenizer=tokenizer\)"):
        with torch.inference_mode():
            model(input_ids=random_ids(60), cache=cache)
    cache = d2o.CompressedCache(model, get_method("kvzip"), d2o.Budget.parse(0.3, 0), tokenizer=byte_tokenizer())
    with torch.inference_mode():
        model(input_ids=random_ids(60), cache=cache)
    assert sum(layer.keys.shape[2] for layer in cache.layers) == round(4 * 0.3 * 60)


def test_a_probing_method_needs_token_ids():
    model = tiny_model("llama")
    cache = make_cache(model, "kvzip", 0.3)
    embeddings = model.get_input_embeddings()(random_ids(60))
    with pytest.raises(D2OError, match="kvzip probes the model with the prompt's tokens: give input_ids"):
        with torch.inference_mode():
            model(inputs_embeds=embeddings, cache=cache)


def prerope_queries(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the queries (H, S, D) as the model makes them before RoPE (after q_norm where the
    family has one)."""
    captured = []
    config = model.config

    def keep(module, args, output):
        captured.append(output.view(1, prompt.shape[1], config.num_attention_heads, config.head_dim)[0].transpose(0, 1))

    hooks = []
    for layer in model.model.layers:
        attention = layer.self_attn
        part = attention.q_norm if hasattr(attention, "q_norm") else attention.q_proj
        hooks.append(part.register_forward_hook(keep))
    try:
        with torch.inference_mode():
            model(input_ids=prompt)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_expected_attention_scores_follow_its_formula(arch):
    model = tiny_model(arch, dtype=torch.float64)
    prompt = random_ids(120)
    method = get_method("expected-attention")
    cache = d2o.CompressedCache(model, method, 1.0, observe=True)
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache)
    queries = prerope_queries(model, prompt)
    dim = model.config.head_dim
    future = torch.arange(120, 120 + 512)[None]
    cos, sin = (table[0].mean(0) for table in model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), future))
    eye, zero = torch.eye(dim // 2, dtype=torch.float64), torch.zeros(dim // 2, dim // 2)
    turn = torch.cat([torch.cat([zero, -eye], 1), torch.cat([eye, zero], 1)]).double()  # x -> (-x2, x1)
    rotation = torch.diag(cos) + torch.diag(sin) @ turn
    for layer, q in zip(cache.layers, queries):
        q = q[:, 4:].double() * dim ** -0.5  # the sinks' queries left out, the attention's scale inside
        mean = q.mean(1)
        centred = q - mean[:, None]
        covariance = centred.transpose(1, 2) @ centred / q.shape[1]
        mean, covariance = mean @ rotation.T, rotation @ covariance @ rotation.T
        keys = layer.keys[0].double().repeat_interleave(2, dim=0)[:, 4:]  # (H, N - 4, D)
        logits = keys @ mean[..., None]
        logits = logits[..., 0] + 0.5 * torch.einsum("hnd,hde,hne->hn", keys, covariance, keys)
        expected = torch.softmax(logits, -1).view(2, 2, -1).mean(1) * layer.values[0, :, 4:].double().norm(dim=-1)
        torch.testing.assert_close(method.score(layer.view)[0, :, 4:], expected.float(), atol=1e-7, rtol=1e-5)
