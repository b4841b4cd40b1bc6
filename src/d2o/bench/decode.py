"""Decoding speed and KV memory: METHOD at a budget against the full cache, alternately in one process."""

from __future__ import annotations

import statistics
import time

import torch

from d2o.bench.prefill import real_tokens
from d2o.engine.cache import CompressedCache
from d2o.generation import check_length


def _decode(model, ids: torch.Tensor, method: str, budget, steps: int) -> tuple[float, int]:
    """Seconds per decoded token after a prefill (greedy, fed back), and the cache's KV bytes."""
    cache = CompressedCache(model, method, budget)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), cache=cache, logits_to_keep=1).logits
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache, logits_to_keep=1).logits
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, cache.nbytes


def bench_decode(model, tokenizer, lengths: list[int], method: str = "d2o", budget: float = 0.2, steps: int = 32,
                 repeats: int = 1) -> list[dict]:
    """Per prompt length: median ms per token of the full cache and of ``method``, their ratio, and
    the KV bytes each holds at the end."""
    rows = []
    for n_tokens in lengths:
        check_length(model, n_tokens, steps)
        ids = real_tokens(tokenizer, n_tokens)
        runs = {"full": [], method: []}
        for _ in range(repeats):
            for name in runs:  # alternate, so drifts in machine load hit both alike
                runs[name].append(_decode(model, ids, name, 1.0 if name == "full" else budget, steps))
        full = statistics.median(seconds for seconds, _ in runs["full"])
        mine = statistics.median(seconds for seconds, _ in runs[method])
        rows.append({
            "length": n_tokens,
            "full_ms_per_token": round(1000 * full, 2),
            f"{method}_ms_per_token": round(1000 * mine, 2),
            f"{method}_over_full": round(mine / full, 3),
            "full_kv_bytes": runs["full"][0][1],
            f"{method}_kv_bytes": runs[method][0][1],
        })
    return rows
