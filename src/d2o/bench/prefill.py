"""Prefill speed and statistics memory: D2O (SDPA output + exact chunked statistics + compression)
against plain SDPA prefill, measured alternately in one process."""

from __future__ import annotations

import statistics
import time

import torch

from d2o.bench.memory import peak_allocated_bytes
from d2o.data import essay_tokens
from d2o.engine.cache import CompressedCache
from d2o.engine.stats import StatsRequest, attention_stats
from d2o.methods import get_method
from d2o.runtime.prompts import check_length


def _timed_prefill(model, ids: torch.Tensor, cache) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def stats_peak_bytes(model, n_tokens: int) -> int:
    """Peak extra memory of one layer's statistics (column mass) at ``n_tokens``, in bytes."""
    config = model.config.get_text_config()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    query = torch.randn(1, heads, n_tokens, dim, dtype=dtype, device=model.device)
    key = torch.randn(1, kv_heads, n_tokens, dim, dtype=dtype, device=model.device)
    valid = torch.ones(1, n_tokens, dtype=torch.bool, device=model.device)
    request = StatsRequest(column_mass=True)
    return peak_allocated_bytes(lambda: attention_stats(query, key, valid, valid, dim**-0.5, request))


def bench_prefill(model, tokenizer, lengths: list[int], method: str = "d2o", budget="0.2",
                  repeats: int = 1, eager: bool = False) -> list[dict]:
    """Per length: median seconds of plain SDPA and of ``method`` prefill, their ratio, and the
    statistics' peak extra memory against the S x S attention matrix eager attention needs."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    hooked = config._attn_implementation
    policy = get_method(method)
    rows = []
    for n_tokens in lengths:
        check_length(model, n_tokens)
        ids = torch.tensor([essay_tokens(tokenizer, n_tokens)])
        timings = {"sdpa": [], method: [], **({"eager": []} if eager else {})}
        for _ in range(repeats):
            for name in timings:  # alternate, so drifts in machine load hit every variant alike
                if name == method:
                    model.set_attn_implementation(hooked)
                    timings[name].append(_timed_prefill(model, ids, CompressedCache(model, policy, budget)))
                else:
                    model.set_attn_implementation(name)
                    timings[name].append(_timed_prefill(model, ids, None))
        model.set_attn_implementation(hooked)
        seconds = {name: statistics.median(values) for name, values in timings.items()}
        row = {
            "length": n_tokens,
            "sdpa_seconds": round(seconds["sdpa"], 3),
            f"{method}_seconds": round(seconds[method], 3),
            f"{method}_over_sdpa": round(seconds[method] / seconds["sdpa"], 3),
            "stats_peak_bytes": stats_peak_bytes(model, n_tokens),
            "attention_matrix_bytes": heads * n_tokens * n_tokens * 4,
        }
        if eager:
            row["eager_seconds"] = round(seconds["eager"], 3)
            row["eager_over_sdpa"] = round(seconds["eager"] / seconds["sdpa"], 3)
        rows.append(row)
    return rows
