"""Generate text under a KV budget: prompts in, answers and the cache's report out."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from d2o.budget import Budget
from d2o.engine.cache import CacheReport, CompressedCache
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.methods.base import Method


@dataclass
class Generation:
    """The answers to a batch of prompts and what their cache held."""

    texts: list[str]
    new_tokens: list[list[int]]
    prompt_tokens: list[int]
    report: CacheReport
    seconds: float


def encode_prompts(tokenizer, prompts: list[str], chat: bool = False) -> dict[str, torch.Tensor]:
    """Tokenize with left padding (what batched decoding needs); apply the chat template if asked."""
    if not prompts or any(not p.strip() for p in prompts):
        raise D2OError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise D2OError("this model's tokenizer has no chat template: drop --chat")
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)


def check_length(model, n_tokens: int, max_new_tokens: int = 0) -> None:
    """Refuse a prompt the model has no positions for, saying by how much."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and n_tokens + max_new_tokens > limit:
        over = n_tokens + max_new_tokens - limit
        raise D2OError(
            f"prompt too long for the model: {n_tokens} tokens + {max_new_tokens} new need "
            f"{n_tokens + max_new_tokens} positions, the model has {limit} ({over} too many)"
        )


def generate(
    model,
    tokenizer,
    prompts: str | list[str],
    method: str | Method = "d2o",
    budget: Budget | str | float = 0.2,
    *,
    max_new_tokens: int = 32,
    chat: bool = False,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    **method_options,
) -> Generation:
    """Answer ``prompts`` (one string or a batch) with ``method`` holding the cache to ``budget``."""
    single = isinstance(prompts, str)
    batch = encode_prompts(tokenizer, [prompts] if single else list(prompts), chat)
    prompt_tokens = batch["attention_mask"].sum(-1).tolist()
    check_length(model, batch["input_ids"].shape[1], max_new_tokens)
    if max_new_tokens < 1:
        raise D2OError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    method = get_method(method, **method_options) if isinstance(method, str) else method
    cache = CompressedCache(model, method, budget)
    device = next(model.parameters()).device
    if seed is not None:
        torch.manual_seed(seed)
    options = dict(do_sample=do_sample, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            cache=cache,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **options,
        )
    seconds = time.perf_counter() - start
    new = output[:, batch["input_ids"].shape[1] :]
    stops = {tokenizer.pad_token_id, tokenizer.eos_token_id, *_eos_ids(model)}
    new_tokens = _until_stop(new.tolist(), stops)
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in new_tokens]
    return Generation(texts, new_tokens, prompt_tokens, cache.report(), seconds)


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _until_stop(rows: list[list[int]], stops: set) -> list[list[int]]:
    cut = []
    for row in rows:
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        cut.append(row[:end])
    return cut
