"""Decoding speed and KV memory of several methods against the full cache, in one process.

Every (length, batch) cell prefills one prompt once per kind of cache (the stock transformers
cache for ``full``; one shared prefill forked per method for the others), repeats that row to
the batch size and times ``steps`` decode steps. On the CPU the methods take their steps in
turn (the order reversed every step), so a drift in machine load hits every method alike, step by
step; on a GPU, where timings are steady, each method's batch is built, decoded and freed before
the next one's is built, so that the peak memory it reports is its own (what its run adds to the
memory held before it: the weights and the prompt's prefills). The full cache is transformers' own
``DynamicCache`` under its own SDPA attention: the baseline a user has without d2o. With
``budget_sized_full`` the same cache also runs over the prompt's last tokens, as many as the
budget keeps on average per layer: the least a step costs with a cache of that size, whatever
compressed it (at batch 1 on a CPU, the model's weights bound a step whatever the cache)."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from d2o.bench.memory import cache_bytes, measure_peak
from d2o.bench.models import prompt_ids, stock_attention
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.prompts import check_length
from d2o.runtime.sharing import SharedPrefill

FULL = "full"
BUDGET_SIZED_FULL = "full, budget-sized"  # the full cache of a prompt as short as what the budget keeps
STOCK = (FULL, BUDGET_SIZED_FULL)


def _start(model, cache, first: Batch, batch: int, steps: int) -> Batch:
    """``batch`` copies of ``first``'s row, on ``cache``, to decode ``steps`` steps."""
    cache.batch_repeat_interleave(batch)
    sequences = [Sequence(None, steps + 1) for _ in range(batch)]
    return Batch(model, cache, sequences, first.logits.expand(batch, -1), first.positions.expand(batch))


def _step(model, name: str, run: Batch) -> None:
    with stock_attention(model) if name in STOCK else contextlib.nullcontext():
        run.step()


class _OperationCount(TorchDispatchMode):
    """Counts the tensor operations dispatched while it is active (each a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        return func(*args, **(kwargs or {}))


def operations_per_step(model, name: str, run: Batch, evict_every: int = 1) -> tuple[int, float] | None:
    """The tensor operations of ``run``'s decode steps over ``evict_every`` steps in a row, an
    eviction's among them (``evict_every`` 1: three steps), after the steps that bring the cache to
    its steady width (the first may allocate what the others reuse): their median (a step between
    evictions) and their mean (each step's share of an eviction included); None when ``run`` has
    too few steps left for that."""
    for _ in range(evict_every):
        _step(model, name, run)
    steps = max(3, evict_every)
    counts = []
    for _ in range(steps):
        if not run.sequences:
            break
        with _OperationCount() as counter:
            _step(model, name, run)
        if not run.sequences:  # it finished in that step, which then ran no forward pass
            return None
        counts.append(counter.operations)
    return (int(statistics.median(counts)), statistics.mean(counts)) if len(counts) == steps else None


def window_means(step_seconds: list[float], window: int) -> list[float]:
    """The mean step of each whole ``window`` of consecutive steps (the run's mean if it has none):
    with a window a multiple of every eviction period, each window pays as many evictions, so a
    median over windows is robust to a stray slow step yet counts what evictions cost (a median
    over single steps would skip them)."""
    whole = len(step_seconds) // window * window
    if not whole:
        return [statistics.mean(step_seconds)]
    return [statistics.mean(step_seconds[start : start + window]) for start in range(0, whole, window)]


def _decode_alone(model, name: str, run: Batch) -> Batch:
    while run.sequences:
        _step(model, name, run)
    return run


def _decode_in_turn(model, runs: dict[tuple[str, int], Batch]) -> None:
    order = list(runs)
    while any(run.sequences for run in runs.values()):
        for variant in order:
            if runs[variant].sequences:
                _step(model, variant[0], runs[variant])
        order.reverse()


def takes_adaptive_heads(name: str) -> bool:
    """Whether method ``name`` takes ``heads=adaptive`` (cam's merge and d2o-official's storage do not)."""
    try:
        get_method(name, heads="adaptive")
    except D2OError:
        return False
    return True


def bench_decode(model, tokenizer, methods: list[str], lengths: list[int], batches: list[int], budget,
                 steps: int = 32, repeats: int = 1, alone: bool | None = None,
                 evict_every: tuple[int, ...] = (1,), kv_bits: tuple[int | None, ...] = (None,),
                 budget_sized_full: bool = False, heads: tuple[str, ...] = ("even",)) -> list[dict]:
    """Per (length, batch, method): ms per decode step, tokens/s, KV bytes, the tensor operations of
    one decode step (counted apart from the timed runs; with ``steps`` >= 4), and each against the
    full cache measured in the same run. ``alone``: each method decodes alone, its peak memory
    measured (``peak_mib``; by default on a GPU), rather than in turn with the others.
    ``evict_every``, ``kv_bits``: each compressed method runs once per pair of values (``CompressedCache``'s;
    ``kv_bits`` None: unquantized). ``budget_sized_full``: also a row of the full cache over the
    prompt's last ``budget.total(layers, length) / layers`` tokens (its KV and time against the full
    cache's are the floor a compressed cache of that size can reach). ``heads``: each method that
    takes it runs once per value of its ``heads`` option (even, adaptive)."""
    policies = {(name, way): get_method(name, heads=way) for name in methods if name != FULL
                for way in heads if way == "even" or takes_adaptive_heads(name)}
    for (name, _), policy in policies.items():
        policy.check_budget(budget)
        if policy.repeats_kv_heads:
            raise D2OError(f"{name} stores KV heads per query head and cannot share a prefill: bench it with full only")
    text_config = model.config.get_text_config()
    vocab, n_layers = text_config.vocab_size, text_config.num_hidden_layers
    device = next(model.parameters()).device
    alone = device.type == "cuda" if alone is None else alone
    for n_tokens in lengths:  # every length before any is measured
        check_length(model, n_tokens, steps)
    rows = []
    for n_tokens in lengths:
        ids = prompt_ids(tokenizer, vocab, n_tokens)
        stock_prompts = {FULL: ids}
        if budget_sized_full:
            stock_prompts[BUDGET_SIZED_FULL] = ids[-round(budget.total(n_layers, n_tokens) / n_layers):]
        stock, stock_first = {}, {}
        with torch.inference_mode():
            with stock_attention(model):
                for name, stock_ids in stock_prompts.items():
                    stock[name] = DynamicCache(config=model.config)
                    stock_first[name] = Batch.prefill(model, stock[name], [stock_ids], [Sequence(None, 1)])
            shared = SharedPrefill(model, list(policies.values()))
            first = Batch.prefill(model, shared.cache, [ids], [Sequence(None, 1)])
        names = list(policies)
        variants = [(name, k, bits, way) for name in [*methods, *list(stock_prompts)[1:]]
                    for k in ((1,) if name in STOCK else evict_every)
                    for bits in ((None,) if name in STOCK else kv_bits)
                    for way in (("even",) if name in STOCK else [way for way in heads if (name, way) in policies])]

        def start(variant: tuple[str, int, int | None, str], batch: int) -> Batch:
            name, k, bits, way = variant
            if name in STOCK:
                with stock_attention(model):
                    return _start(model, copy.deepcopy(stock[name]), stock_first[name], batch, steps)
            return _start(model, shared.fork(names.index((name, way)), budget, evict_every=k, kv_bits=bits), first,
                          batch, steps)

        window = math.lcm(*evict_every)
        for batch in batches:
            step_seconds, held, peak = {variant: [] for variant in variants}, {}, {}
            for _ in range(repeats):
                if alone:
                    for variant in variants:  # no other method's batch is held while this one runs
                        run, most = measure_peak(lambda: _decode_alone(model, variant[0], start(variant, batch)),
                                                 device)
                        peak[variant] = max(peak.get(variant, 0), most)
                        held[variant] = cache_bytes(run.cache)
                        step_seconds[variant] += window_means(run.step_seconds, window)
                        del run  # freed before the next method's run is measured
                else:
                    runs = {variant: start(variant, batch) for variant in variants}
                    _decode_in_turn(model, runs)
                    for variant, run in runs.items():
                        held[variant] = cache_bytes(run.cache)
                        step_seconds[variant] += window_means(run.step_seconds, window)
                    del runs
            seconds = {variant: statistics.median(values) for variant, values in step_seconds.items()}
            operations = {variant: operations_per_step(model, variant[0], start(variant, batch), variant[1])
                          for variant in variants}
            full = (FULL, 1, None, "even")
            for variant in variants:
                name, k, bits, way = variant
                row = {"length": n_tokens, "batch": batch, "method": name,
                       "budget": "-" if name == FULL else str(budget)}
                if len(evict_every) > 1 or evict_every != (1,):
                    row["evict_every"] = "-" if name in STOCK else k
                if kv_bits != (None,):
                    row["kv_bits"] = bits or "-"
                if heads != ("even",):
                    row["heads"] = "-" if name in STOCK else way
                row |= {"ms_per_step": round(1000 * seconds[variant], 2),
                        "tokens_per_s": round(batch / seconds[variant], 1),
                        "kv_mib": round(held[variant] / 2**20, 3)}
                if operations[variant] is not None:
                    row["ops_per_step"], mean_ops = operations[variant]
                    if k > 1:
                        row["mean_ops_per_step"] = round(mean_ops)
                if variant in peak:
                    row["peak_mib"] = round(peak[variant] / 2**20, 1)
                if full in seconds:
                    row["time_vs_full"] = round(seconds[variant] / seconds[full], 3)
                    row["kv_vs_full"] = round(held[variant] / held[full], 3)
                rows.append(row)
    return rows
