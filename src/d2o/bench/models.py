"""What a benchmark runs on: the embedded model, or random weights of a named shape.

Speed and memory depend on a model's shape, not its weights, so shapes too large to download or
to run here (Llama-3-8B on a GPU) are built with random weights, and the embedded model's shape
can go past its 8,192 positions (``positions``) to show how cost grows with length.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from d2o.engine.attention import install, uninstall
from d2o.errors import D2OError

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def random_model(shape: str, positions: int, dtype: str = "float32", device: str | None = None):
    """A Llama model of ``shape`` with random weights and ``positions`` positions, hooked by d2o."""
    if shape not in SHAPES:
        raise D2OError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise D2OError(f"dtype {dtype!r} is not supported: choose one of {', '.join(DTYPES)}")
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=positions, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = LlamaForCausalLM._from_config(config, dtype=DTYPES[dtype]).eval()
    install(model)
    return model


def prompt_ids(tokenizer, vocab_size: int, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` of the essays with a tokenizer, else random token ids (a random model)."""
    if tokenizer is not None:
        from d2o.data import essay_tokens

        return essay_tokens(tokenizer, n_tokens)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n_tokens,), generator=generator).tolist()


def row_prompts(tokenizer, vocab_size: int, n_tokens: int):
    """``row -> token ids``: a different prompt of ``n_tokens`` for every row of a batch. Random ids
    seeded by the row without a tokenizer; else consecutive stretches of the essays, tokenized once
    and read as a ring: each pass around starts one token later, so rows differ (up to about as
    many rows as the essays have tokens)."""
    if tokenizer is None:
        return lambda row: prompt_ids(None, vocab_size, n_tokens, seed=row)
    from d2o.data import all_essay_tokens

    ids = all_essay_tokens(tokenizer, n_tokens)
    ring, per_pass = ids + ids[:n_tokens], len(ids) // n_tokens

    def prompt(row: int) -> list[int]:
        start = row % per_pass * n_tokens + row // per_pass
        return ring[start:start + n_tokens]

    return prompt


@contextmanager
def stock_attention(model):
    """The model as transformers ships it (no d2o hook) inside the block: the honest baseline."""
    backend = "eager" if model.config.get_text_config()._attn_implementation == "d2o_eager" else "sdpa"
    uninstall(model)
    try:
        yield model
    finally:
        install(model, backend)
