"""Throughput under a KV memory cap: the paper's experiment, scaled to the machine at hand.

For each method, the largest batch whose KV cache fits the cap (``runtime.memory.plan``: every
row holds what it can hold at most while decoding, and the row being prefilled holds its whole
prompt until it is compressed), then that batch measured: each prompt prefilled alone and
compressed, the rows joined into one batch (as a server would), ``generate`` tokens decoded.
Tokens/s is given over the decoding and over the whole run (prefills included).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from d2o.bench.models import prompt_ids, stock_attention
from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import plan
from d2o.runtime.prompts import check_length

FULL = "full"


def largest_batch(cap: int, prefill_bytes: int, held_bytes: int) -> int:
    """The most rows whose caches fit ``cap`` while the last of them is prefilled."""
    if max(prefill_bytes, held_bytes) > cap:
        return 0
    return 1 + (cap - max(prefill_bytes, held_bytes)) // held_bytes


def _run(model, method, budget, prompts: list[list[int]], generate: int) -> tuple[float, float, int]:
    """Prefill, then decode ``generate`` tokens per row; returns decode seconds, total seconds and
    the most KV bytes held at once (measured after every prefill and every step). The stock cache
    (``method`` None) prefills every prompt in one batch, as transformers does; a compressed cache
    prefills each prompt alone and compresses it before the next, and the rows join one batch."""
    start = time.perf_counter()
    if method is None:
        batch = Batch.prefill(model, DynamicCache(config=model.config), prompts,
                              [Sequence(None, generate) for _ in prompts])
        most = _held(batch.cache)
    else:
        batch, most = None, 0
        for ids in prompts:
            one = Batch.prefill(model, CompressedCache(model, method, budget), [ids], [Sequence(None, generate)])
            most = max(most, _held(one.cache) + (_held(batch.cache) if batch else 0))
            if batch is None:
                batch = one
            else:
                batch.join(one)
    decode_start = time.perf_counter()
    while batch.sequences:
        batch.step()
        most = max(most, _held(batch.cache))
    end = time.perf_counter()
    return end - decode_start, end - start, most


def _held(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def bench_fit(model, tokenizer, cap: int, prompt: int, generate: int, methods: list[str], budget: Budget,
              dtype_bytes: int) -> list[dict]:
    """Per method: the largest batch under ``cap``, its measured tokens/s and peak KV bytes, and
    the ratios to the full cache."""
    check_length(model, prompt, generate)
    vocab = model.config.get_text_config().vocab_size
    rows = []
    for name in methods:
        method = get_method(name)
        method.check_budget(budget)
        need = plan(model.config, method, budget, prompt, generate, dtype_bytes)
        batch = largest_batch(cap, need.prefill_bytes, need.held_bytes)
        if batch == 0:
            raise D2OError(f"a KV cap of {cap / 2**20:.0f} MiB holds not one {prompt}+{generate}-token sequence "
                           f"under {name} (it needs {need.peak_bytes / 2**20:.0f} MiB)")
        prompts = [prompt_ids(tokenizer, vocab, prompt, seed=row) if tokenizer is None
                   else prompt_ids(tokenizer, vocab, prompt * (row + 1))[-prompt:] for row in range(batch)]
        with torch.inference_mode():
            if name == FULL:
                with stock_attention(model):
                    decode_s, total_s, most = _run(model, None, budget, prompts, generate)
            else:
                decode_s, total_s, most = _run(model, method, budget, prompts, generate)
        rows.append({"method": name, "budget": "-" if name == FULL else str(budget), "batch": batch,
                     "planned_kv_mib": round(((batch - 1) * need.held_bytes + need.peak_bytes) / 2**20, 1),
                     "peak_kv_mib": round(most / 2**20, 1),
                     "decode_tokens_per_s": round(batch * generate / decode_s, 1),
                     "total_tokens_per_s": round(batch * generate / total_s, 1)})
    full = next((row for row in rows if row["method"] == FULL), None)
    for row in rows:
        if full is not None:
            row["decode_vs_full"] = round(row["decode_tokens_per_s"] / full["decode_tokens_per_s"], 2)
            row["total_vs_full"] = round(row["total_tokens_per_s"] / full["total_tokens_per_s"], 2)
    return rows
