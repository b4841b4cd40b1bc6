"""Decoding speed and KV memory: METHOD at a budget against the full cache, alternately in one process."""

from __future__ import annotations

import statistics

from d2o.data import essay_tokens
from d2o.engine.cache import CompressedCache
from d2o.methods import get_method
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.prompts import check_length


def _decode(model, tokenizer, ids: list[int], method, budget, steps: int) -> tuple[float, int]:
    """Seconds per decoded token after a prefill (greedy, fed back, never stopping early), and the
    cache's KV bytes at the end."""
    cache = CompressedCache(model, method, budget)
    batch = Batch.prefill(model, cache, [ids], [Sequence(tokenizer, steps + 1)])
    batch.run()
    return statistics.fmean(batch.step_seconds), cache.nbytes


def bench_decode(model, tokenizer, lengths: list[int], method: str = "d2o", budget="0.2", steps: int = 32,
                 repeats: int = 1) -> list[dict]:
    """Per prompt length: median ms per token of the full cache and of ``method``, their ratio, and
    the KV bytes each holds at the end."""
    methods = {"full": (get_method("full"), 1.0), method: (get_method(method), budget)}
    rows = []
    for n_tokens in lengths:
        check_length(model, n_tokens, steps)
        ids = essay_tokens(tokenizer, n_tokens)
        runs = {name: [] for name in methods}
        for _ in range(repeats):
            for name, (policy, held) in methods.items():  # alternate, so drifts in machine load hit both alike
                runs[name].append(_decode(model, tokenizer, ids, policy, held, steps))
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
