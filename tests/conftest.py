"""Shared fixtures: tiny random-weight models of the supported architectures, and the real model."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import d2o
from d2o.engine.api import LayerView
from d2o.engine.slots import SlotTable
from d2o.engine.storage import CompressedLayer
from d2o.methods import REGISTRY

# GQA everywhere: 4 query heads over 2 KV heads.
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.1)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    # Hybrid attention: layers 0 and 2 slide over 16 tokens, 1 and 3 attend to everything; the
    # attention scale is not head_dim ** -0.5, so a hook that ignores the scale it is given fails.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "sliding_window": 16, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
}

DENSE = [arch for arch in ARCHITECTURES if arch != "gemma3"]  # every layer attends to every token

CHOSEN = [name for name, entry in REGISTRY.items() if not entry.ablation]  # the methods `d2o methods` lists
ABLATIONS = [name for name, entry in REGISTRY.items() if entry.ablation]


def chosen(**flags) -> list[str]:
    """The methods `d2o methods` lists whose classes have these flags (``repeats_kv_heads=False``, ...)."""
    return [name for name in CHOSEN if all(getattr(REGISTRY[name].cls, flag) == value for flag, value in flags.items())]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer of the tiny models' 256 ids: one token per byte of UTF-8 (for methods that write
    text of their own into a probe, such as KVzip's request to repeat the context)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


# The tiny models name this folder as theirs, so that a cache finds their tokenizer as it finds a
# real model's (saved with it).
TOKENIZER_FOLDER = tempfile.mkdtemp(prefix="d2o-test-tokenizer-")
byte_tokenizer().save_pretrained(TOKENIZER_FOLDER)


def tiny_model(arch: str = "llama", dtype=torch.float32, attention: str = "sdpa", seed: int = 0, **overrides):
    """A random-weight model of ``arch`` with d2o's hook installed (outputs equal the stock model's)."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_class(**{**SHAPE, **extra, **overrides}, attn_implementation="sdpa")
    config._name_or_path = TOKENIZER_FOLDER
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # Gemma's norms start at a scale of 1: make the q/k norms matter
                parameter.normal_(0.0, 0.3)
    d2o.install(model, attention)
    return model


def make_cache(model, method, budget, min_tokens: int = 0, **options):
    """A compressed cache for ``method`` (a name, with options, or a method object) at ``budget``.

    The floor is off (``min_tokens=0``) unless asked for: these tests compress short prompts on
    purpose; the floor has tests of its own.
    """
    policy = d2o.get_method(method, **options) if isinstance(method, str) else method
    return d2o.CompressedCache(model, policy, d2o.Budget.parse(budget, min_tokens=min_tokens))


def standalone_layer(keys, values):
    """A layer of no cache holding ``keys`` and ``values`` (B, G, N, D), token i in slot i (a
    method's part tested alone)."""
    layer = CompressedLayer(cache=None, layer_idx=0)
    layer.lazy_initialization(keys, values)
    batch, heads, n, _ = keys.shape
    layer.adopt(keys.clone(), values.clone(), SlotTable({}, torch.arange(n).expand(batch, heads, n).clone()))
    return layer


def merge_into(merge, layers, evicted) -> list[torch.Tensor]:
    """``merge`` of ``evicted`` into ``layers`` as the cache runs it (its results written into the
    layers); the (token, KV head) pairs merged per row of each layer."""
    results = merge.merge([LayerView(layer, None) for layer in layers], evicted)
    for layer, result in zip(layers, results):
        layer.apply_merged(result)
    return [result.count for result in results]


def kept_tokens(layer, row: int) -> list[list[int]]:
    """The tokens a layer holds for ``row``, per KV head, in token order (slots are in no order)."""
    return [sorted(t for t in head.tolist() if t >= 0) for head in layer.token_index[row]]


def random_ids(n: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (batch, n), generator=generator)


def left_pad(sequences: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id tensors with left padding; returns ids and the 2D attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = seq
        mask[row, width - len(seq):] = 1
    return ids, mask


def greedy(model, ids, cache=None, steps: int = 10, mask=None) -> torch.Tensor:
    """Greedy continuation through transformers' generate (the new tokens only)."""
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                             cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[1]:]


def assert_fed_at_once_as_one_by_one(model, cache, ids: torch.Tensor) -> None:
    """``ids`` fed to (copies of) ``cache`` in one forward and token by token, each copy held at
    its length while fed (no eviction between the tokens): the logits must agree."""
    at_once, one_by_one = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.inference_mode():
        with at_once.hold():
            joint = model(input_ids=ids, cache=at_once).logits
        with one_by_one.hold():
            steps = torch.cat([model(input_ids=ids[:, i:i + 1], cache=one_by_one).logits
                               for i in range(ids.shape[1])], dim=1)
    torch.testing.assert_close(joint, steps, atol=1e-9, rtol=0)


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache folder)."""
    from d2o.models import load_model

    return load_model("smollm2")
