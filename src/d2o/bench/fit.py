"""Throughput under a KV memory cap: the paper's experiment, scaled to the machine at hand.

For each method, the largest batch whose KV cache stays under the cap at every moment, then that
batch measured: ``generate`` tokens decoded per row. The full cache prefills every prompt in one
batch, as transformers does; its batch comes from ``runtime.memory.plan``, exact for it (every
row holds its prompt and every generated token). A compressed cache prefills each prompt alone
and compresses it, and the rows join one batch (as a server's requests do), one at a time: a row
is prefilled only while the rows joined so far (waiting, not decoding) and its uncompressed prompt
fit the cap, and joins only while the batch with it fits at its decoding peak, padding included
(``runtime.memory.padded_bytes``: rows share one tensor per layer as wide as the widest, and D2O
gives each row its own per-layer budgets; a plan per row, as if each held its budget alone, let
such a batch outgrow the cap). Tokens/s is given over the decoding and over the whole run
(prefills included).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from time import perf_counter

import torch
from transformers import DynamicCache

from d2o.bench import FIT_MAX_BATCH, WARM_UP_TOKENS, check_fit_generate
from d2o.bench.memory import cache_bytes
from d2o.bench.models import row_prompts, stock_attention
from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.runtime.decoding import Batch, Sequence, seconds_since
from d2o.runtime.memory import joined_widths, padded_bytes, peak_slots, plan, row_bytes, slot_bytes
from d2o.runtime.prompts import check_length

FULL = "full"


@dataclass
class Run:
    """A measured batch: its rows, the KV bytes its fit rule let it reach, the most it held
    (measured after every prefill, before and after compression, and every step), its seconds, and
    the tokens its decode steps computed (a row's first token comes from its prefill's logits)."""

    batch: int
    planned_bytes: int
    peak_bytes: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int


def largest_batch(cap: int, prefill_bytes: int, held_bytes: int) -> int:
    """The most rows whose caches fit ``cap`` while the last of them is prefilled."""
    if max(prefill_bytes, held_bytes) > cap:
        return 0
    return 1 + (cap - max(prefill_bytes, held_bytes)) // held_bytes


def _run_full(model, need, cap: int, max_batch: int, prompt_of, generate: int) -> Run:
    """The stock cache: ``largest_batch`` rows (at most ``max_batch``) prefilled in one batch, then decoded."""
    batch = min(max_batch, largest_batch(cap, need.prefill_bytes, need.held_bytes))
    prompts = [prompt_of(row) for row in range(batch)]
    start = perf_counter()
    decoding = Batch.prefill(model, DynamicCache(config=model.config), prompts,
                             [Sequence(None, generate) for _ in prompts])
    prefill_seconds = perf_counter() - start
    decode_seconds, decode_tokens, most = _decode(decoding, cache_bytes(decoding.cache))
    return Run(batch, (batch - 1) * need.held_bytes + need.peak_bytes, most, prefill_seconds, decode_seconds,
               decode_tokens)


def _run_packed(model, method, budget, need, cap: int, max_batch: int, per_slot: list[int], prompt_of,
                generate: int, evict_every: int = 1, kv_bits=None, per_row: int = 0,
                prefill_chunk: int | None = None) -> Run:
    """A compressed cache: rows prefilled alone, compressed and joined while they fit (see above), at
    most ``max_batch`` of them."""
    decoding, peaks, planned, most, prefill_seconds = None, None, 0, 0, 0.0
    while decoding is None or decoding.size < max_batch:
        held = decoding.cache.nbytes if decoding else 0  # the rows wait, not decoding, while the next is prefilled
        if held + need.prefill_bytes > cap:
            break
        cache = CompressedCache(model, method, budget, evict_every=evict_every, kv_bits=kv_bits,
                                prefill_chunk=prefill_chunk)
        start = perf_counter()
        one, whole = _prefill_measured(model, cache, prompt_of(decoding.size if decoding else 0), generate)
        seconds = seconds_since(start, cache.layers[0].device)  # its compression included
        widths = joined_widths([cache, decoding.cache] if decoding else [cache], generate)
        joined = peak_slots(cache, generate) if peaks is None else torch.cat([peaks, peak_slots(cache, generate)])
        bound = padded_bytes(widths, joined, per_slot, per_row)
        if bound > cap:  # with this row the batch would outgrow the cap while it decodes: left out
            break
        peaks, planned = joined, max(planned, held + need.prefill_bytes, bound)
        most, prefill_seconds = max(most, held + whole), prefill_seconds + seconds
        if decoding is None:
            decoding = one
        else:
            decoding.join(one)
        most = max(most, decoding.cache.nbytes)
    if decoding is None:
        return Run(0, 0, 0, 0.0, 0.0, 0)
    batch = decoding.size  # rows leave the batch as they finish
    decode_seconds, decode_tokens, most = _decode(decoding, most)
    return Run(batch, planned, most, prefill_seconds, decode_seconds, decode_tokens)


def _prefill_measured(model, cache: CompressedCache, prompt: list[int], generate: int) -> tuple[Batch, int]:
    """One row prefilled as a server prefills it (compressed at the end of its pass, or of each
    chunk's), and the most bytes its cache held just before a compression: its whole prompt, or its
    budget and a chunk. (Under ``hold`` every layer would
    keep its window's attention rows until the block ended, memory no prefill holds otherwise.)"""
    schedule = cache.schedule
    compress, whole = schedule.compress, []

    def measured() -> None:
        whole.append(cache.nbytes)
        compress()

    schedule.compress = measured
    try:
        one = Batch.prefill(model, cache, [prompt], [Sequence(None, generate)])
    finally:
        del schedule.compress
    return one, max(whole)


def _decode(decoding: Batch, most: int) -> tuple[float, int, int]:
    """Decode every row to its end; the seconds it took, the tokens its forward passes computed
    (a row's last step picks its last token and runs none) and the most KV bytes held (``most`` so far)."""
    start, tokens = perf_counter(), 0
    while decoding.sequences:
        decoding.step()
        tokens += decoding.size  # the rows still running: each took a forward pass in this step
        most = max(most, cache_bytes(decoding.cache))
    return perf_counter() - start, tokens, most


def _warm_up(model, name: str, method, budget: Budget, ids: list[int]) -> None:
    """A short prefill and two decode steps of ``name``, outside the timings: one-time costs (thread
    pools, kernels' buffers, on a GPU its libraries' start) would land on whichever method ran first."""
    with torch.inference_mode(), stock_attention(model) if name == FULL else contextlib.nullcontext():
        cache = DynamicCache(config=model.config) if name == FULL else CompressedCache(model, method, budget)
        decoding = Batch.prefill(model, cache, [ids], [Sequence(None, 3)])
        while decoding.sequences:
            decoding.step()


def bench_fit(model, tokenizer, cap: int, prompt: int, generate: int, methods: list[str], budget: Budget,
              dtype_bytes: int, max_batch: int = FIT_MAX_BATCH, evict_every: int = 1,
              kv_bits: tuple[int | None, ...] = (None,), prefill_chunk: int | None = None) -> list[dict]:
    """Per method: the largest batch under ``cap`` (and at most ``max_batch`` rows: a cap far above
    the model's needs would otherwise build and decode millions of rows), its measured tokens/s and
    peak KV bytes, and the ratios to the full cache. ``evict_every``: the compressed caches' (their
    plans count its slack slots); ``kv_bits``: each compressed method once per value (None: unquantized);
    ``prefill_chunk``: the compressed caches prefill their prompts that many tokens at a time."""
    check_length(model, prompt, generate)
    check_fit_generate(generate)
    prompt_of = row_prompts(tokenizer, model.config.get_text_config().vocab_size, prompt)
    chosen = {name: get_method(name) for name in methods}
    for name, method in chosen.items():
        method.check_budget(budget)
        _warm_up(model, name, method, budget, prompt_of(0)[:WARM_UP_TOKENS])
    rows = []
    for name, bits in [(name, bits) for name in methods for bits in ((None,) if name == FULL else kv_bits)]:
        method = chosen[name]
        need = plan(model.config, method, budget, prompt, generate, dtype_bytes, stock=name == FULL,
                    evict_every=evict_every, kv_bits=bits, prefill_chunk=prefill_chunk,
                    question=bool(method.question_tokens))

        none_fit = D2OError(f"a KV cap of {cap:,} bytes holds not one {prompt}+{generate}-token sequence "
                            f"under {name} (it needs {need.peak_bytes:,})")
        if need.peak_bytes > cap:
            raise none_fit
        with torch.inference_mode():
            if name == FULL:
                with stock_attention(model):
                    run = _run_full(model, need, cap, max_batch, prompt_of, generate)
            else:
                per_slot = slot_bytes(model.config, dtype_bytes, method, kv_bits=bits)
                run = _run_packed(model, method, budget, need, cap, max_batch, per_slot, prompt_of, generate,
                                  evict_every, bits, row_bytes(model.config, dtype_bytes, method, bits),
                                  prefill_chunk)
        if run.batch == 0:  # a row's plan bounds its peak, so this is not expected
            raise none_fit
        rows.append({"method": name, "budget": "-" if name == FULL else str(budget),
                     **({"kv_bits": bits or "-"} if kv_bits != (None,) else {}), "batch": run.batch,
                     "planned_kv_mib": round(run.planned_bytes / 2**20, 1),
                     "peak_kv_mib": round(run.peak_bytes / 2**20, 1),
                     "decode_tokens_per_s": round(run.decode_tokens / run.decode_seconds, 1),
                     "total_tokens_per_s": round(run.batch * generate / (run.prefill_seconds + run.decode_seconds), 1)})
    full = next((row for row in rows if row["method"] == FULL), None)
    for row in rows:
        if full is not None:
            row["decode_vs_full"] = round(row["decode_tokens_per_s"] / full["decode_tokens_per_s"], 2)
            row["total_vs_full"] = round(row["total_tokens_per_s"] / full["total_tokens_per_s"], 2)
    return rows
