"""Prefill speed and memory: a method's prefill (SDPA output + exact chunked statistics +
compression) against transformers' plain SDPA prefill, alternately in one process, and the peak
memory of each against the S x S attention matrix the statistics never build; with ``chunks``,
each method's prefill in chunks of those sizes too (``CompressedCache(prefill_chunk=)``), its time
and peak beside the prompt prefilled whole."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from d2o.bench import WARM_UP_TOKENS
from d2o.bench.memory import measure_peak
from d2o.bench.models import prompt_ids, stock_attention
from d2o.engine.cache import CompressedCache
from d2o.engine.model_facts import head_dim
from d2o.engine.api import StatsRequest
from d2o.engine.stats import attention_stats
from d2o.methods import get_method
from d2o.runtime.decoding import question_pass
from d2o.runtime.prompts import check_length

BASELINES = ("sdpa", "eager")


def _prefill(model, ids: torch.Tensor, name: str, policy, budget, chunk: int | None = None) -> tuple[float, int]:
    """Seconds and peak extra bytes of one prefill of ``ids`` by ``name``: a stock kernel, or the
    method (in chunks of ``chunk`` tokens, a method that scores with the question shown the prompt's
    last tokens after each, as ``generate`` does)."""
    def run(cache):
        def timed():
            start = time.perf_counter()
            with torch.inference_mode():
                if chunk is None:
                    model(input_ids=ids, cache=cache, logits_to_keep=1)
                else:
                    cache.prefill(model, ids, logits_to_keep=1, **question_pass(cache, ids.tolist(), "tail"))
            if ids.device.type == "cuda":
                torch.cuda.synchronize(ids.device)
            return time.perf_counter() - start

        return measure_peak(timed, ids.device)

    if name not in BASELINES:
        return run(CompressedCache(model, policy, budget, prefill_chunk=chunk))
    with stock_attention(model):
        model.set_attn_implementation(name)
        try:
            return run(DynamicCache(config=model.config))
        finally:
            model.set_attn_implementation("sdpa")


def stats_peak_bytes(model, n_tokens: int) -> int:
    """Peak extra memory of one layer's statistics (column mass) at ``n_tokens``, in bytes."""
    config = model.config.get_text_config()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = head_dim(config)
    dtype = next(model.parameters()).dtype
    query = torch.randn(1, heads, n_tokens, dim, dtype=dtype, device=model.device)
    key = torch.randn(1, kv_heads, n_tokens, dim, dtype=dtype, device=model.device)
    valid = torch.ones(1, n_tokens, dtype=torch.bool, device=model.device)
    request = StatsRequest(column_mass=True)
    per_head = valid[:, None].expand(-1, kv_heads, -1)
    return measure_peak(lambda: attention_stats(query, key, per_head, valid, dim**-0.5, request), model.device)[1]


def bench_prefill(model, tokenizer, lengths: list[int], methods: list[str], budget, repeats: int = 1,
                  eager: bool = False, chunks: list[int] = ()) -> list[dict]:
    """Per length: median seconds of plain SDPA and of each method's prefill (its statistics, any
    probe it runs, its compression) and their ratio, the peak memory of each prefill, the
    statistics' own peak, and the S x S matrix of one layer; per method and chunk size ``c``
    (``method@c``), the same in chunks, and its time and peak over the method's prefill whole."""
    policies = {method: get_method(method) for method in methods}
    variants = {f"{method}@{chunk}": (method, chunk) for method in methods for chunk in chunks}
    variants.update({name: (name, None) for name in ["sdpa", *methods, *(["eager"] if eager else [])]})
    for policy in policies.values():
        policy.check_budget(budget)
    config = model.config.get_text_config()
    dtype_bytes = next(model.parameters()).element_size()  # what the attention matrix would be stored in
    names = ["sdpa", *methods, *(f"{method}@{chunk}" for method in methods for chunk in chunks)] + \
        (["eager"] if eager else [])
    for n_tokens in lengths:
        check_length(model, n_tokens)
    warm_up = torch.tensor([prompt_ids(tokenizer, config.vocab_size, WARM_UP_TOKENS)], device=model.device)
    for name in names:  # one-time allocations (thread pools, kernels' buffers) before any is measured
        _prefill(model, warm_up, variants[name][0], policies.get(variants[name][0]), budget, variants[name][1])
    rows = []
    for n_tokens in lengths:
        ids = torch.tensor([prompt_ids(tokenizer, config.vocab_size, n_tokens)], device=model.device)
        runs = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:  # alternate, so drifts in machine load hit every variant alike
                method, chunk = variants[name]
                runs[name].append(_prefill(model, ids, method, policies.get(method), budget, chunk))
        median = {name: statistics.median(seconds for seconds, _ in values) for name, values in runs.items()}
        peaks = {name: max(peak for _, peak in values) for name, values in runs.items()}
        row = {"length": n_tokens, "sdpa_s": round(median["sdpa"], 3)}
        for name in names[1:]:
            row[f"{name}_s"] = round(median[name], 3)
            row[f"{name}_over_sdpa"] = round(median[name] / median["sdpa"], 3)
        row["sdpa_peak_mib"] = round(peaks["sdpa"] / 2**20, 1)
        for name in names[1:]:
            if name != "eager":
                row[f"{name}_peak_mib"] = round(peaks[name] / 2**20, 1)
        for name, (method, chunk) in variants.items():
            if chunk is not None:  # the same method, its prompt prefilled whole
                row[f"{name}_over_whole"] = round(median[name] / median[method], 3)
                row[f"{name}_peak_over_whole"] = round(peaks[name] / max(peaks[method], 1), 3)
        row["stats_peak_mib"] = round(stats_peak_bytes(model, n_tokens) / 2**20, 1)
        row["attention_matrix_mib"] = round(config.num_attention_heads * n_tokens**2 * dtype_bytes / 2**20, 1)
        rows.append(row)
    return rows
