"""The benchmarks on a tiny random model: what they plan, measure and write."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from d2o import Budget, get_method
from d2o.bench import fit
from d2o.bench.decode import bench_decode, window_means
from d2o.bench.fit import bench_fit, largest_batch
from d2o.bench.memory import measure_peak
from d2o.bench.models import random_model, row_prompts
from d2o.bench.prefill import bench_prefill
from d2o.bench.serve import serve_prompts
from d2o.bench.throughput import integrate
from d2o.engine.cache import CompressedCache
from d2o.runtime.memory import plan

from conftest import random_ids, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny", positions=512)


@pytest.mark.parametrize("name, budget", [("h2o", "0.3"), ("d2o", "0.3"), ("snapkv", "0.5"), ("full", "0.3"),
                                          ("streamingllm", Budget(ratio=0.05, min_tokens=40))])
def test_the_plan_bounds_what_a_sequence_holds_and_is_tight_for_evicting_methods(tiny, name, budget):
    method, budget = get_method(name), Budget.parse(budget)
    prompt, new = 120, 30
    need = plan(tiny.config, method, budget, prompt, new, dtype_bytes=4)
    # Per KV head (2): K and V (head dim 16, float32), the token index (int32), and the method's state:
    # h2o its mass per query head (2, float32), d2o that and its merge counts (int32), snapkv its votes.
    state = {"h2o": 8, "d2o": 12, "snapkv": 4, "full": 0, "streamingllm": 0}[name]
    slot = 2 * (2 * 16 * 4 + 4 + state)
    assert need.prefill_bytes == 4 * prompt * slot
    cache = CompressedCache(tiny, method, budget)
    most = 0
    with torch.inference_mode():
        logits = tiny(input_ids=random_ids(prompt), cache=cache).logits
        for _ in range(new - 1):  # the last token generated is never fed back
            logits = tiny(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
            most = max(most, cache.nbytes)
    assert most <= need.held_bytes
    if name in ("h2o", "d2o", "streamingllm"):  # at their budget plus one free slot per layer: exact
        assert most == need.held_bytes
    if name in ("full", "snapkv"):
        assert most == need.held_bytes - 4 * slot  # the plan counts the last token, which is never fed


def test_fit_packs_the_largest_batch_under_the_cap_and_stays_under_it(tiny):
    prompt, generate = 96, 16
    full = plan(tiny.config, get_method("full"), Budget(ratio=1.0), prompt, generate)
    cap = 4 * full.held_bytes  # four full sequences
    rows = {row["method"]: row for row in bench_fit(tiny, None, cap, prompt, generate, ["full", "h2o"],
                                                    Budget(ratio=0.2, min_tokens=8), 4)}
    assert rows["full"]["batch"] == 4
    h2o = plan(tiny.config, get_method("h2o"), Budget(ratio=0.2, min_tokens=8), prompt, generate)
    # At least the plan's rows: the plan counts the rows waiting beside a prefill at their decoding
    # peak, a slot per layer more than they hold then.
    assert rows["h2o"]["batch"] >= largest_batch(cap, h2o.prefill_bytes, h2o.held_bytes) > 4 * 3
    for row in rows.values():
        assert row["peak_kv_mib"] <= row["planned_kv_mib"] <= round(cap / 2**20, 1)  # rounding keeps the order
    assert rows["h2o"]["decode_vs_full"] == pytest.approx(rows["h2o"]["decode_tokens_per_s"]
                                                          / rows["full"]["decode_tokens_per_s"], abs=0.01)


def test_fit_leaves_out_a_row_whose_padding_would_take_the_batch_past_the_cap(tiny):
    """D2O gives each row its own layer budgets and a joined batch is as wide as its widest row in
    every layer: 60 rows of the plan's size fit this cap, but padded only 52 do."""
    prompt, generate, budget = 200, 16, Budget(ratio=0.2, min_tokens=8)
    need = plan(tiny.config, get_method("d2o"), budget, prompt, generate)
    cap = need.prefill_bytes + 59 * need.held_bytes
    row, = bench_fit(tiny, None, cap, prompt, generate, ["d2o"], budget, 4)
    assert row["batch"] < largest_batch(cap, need.prefill_bytes, need.held_bytes) == 60
    assert row["peak_kv_mib"] <= row["planned_kv_mib"] <= round(cap / 2**20, 1)  # rounding keeps the order


def test_fit_counts_the_last_rows_uncompressed_prompt_in_its_peak(tiny):
    """11 rows fit: 10 compressed and the 11th's whole prompt before it is compressed, the peak."""
    prompt, generate, budget = 400, 8, Budget(ratio=0.05, min_tokens=8)
    need = plan(tiny.config, get_method("h2o"), budget, prompt, generate)
    row, = bench_fit(tiny, None, need.prefill_bytes + 10 * need.held_bytes, prompt, generate, ["h2o"], budget, 4)
    assert row["batch"] == 11
    # Rounded to 0.1 MiB: the 10 compressed rows alone hold 0.2 MiB.
    assert row["peak_kv_mib"] == row["planned_kv_mib"]
    assert abs(row["peak_kv_mib"] - (need.prefill_bytes + 10 * need.held_bytes) / 2**20) <= 0.1


def test_fit_in_chunks_counts_a_chunk_not_the_last_rows_whole_prompt(tiny):
    """The cap of the test above, prompts prefilled 50 tokens at a time: the last row's prefill holds
    its budget and a chunk, so more rows fit, and the batch still stays under the cap."""
    prompt, generate, budget = 400, 8, Budget(ratio=0.05, min_tokens=8)
    whole = plan(tiny.config, get_method("h2o"), budget, prompt, generate)
    chunked = plan(tiny.config, get_method("h2o"), budget, prompt, generate, prefill_chunk=50)
    cap = whole.prefill_bytes + 10 * whole.held_bytes
    row, = bench_fit(tiny, None, cap, prompt, generate, ["h2o"], budget, 4, prefill_chunk=50)
    assert row["batch"] >= largest_batch(cap, chunked.prefill_bytes, chunked.held_bytes) > 11
    assert row["peak_kv_mib"] <= row["planned_kv_mib"] <= round(cap / 2**20, 1)


def test_fit_stops_at_max_batch_when_the_cap_holds_more(tiny):
    """A terabyte cap on a tiny model would build and decode millions of rows."""
    rows = bench_fit(tiny, None, 2**40, 32, 4, ["full", "h2o"], Budget(ratio=0.5, min_tokens=8), 4, max_batch=3)
    assert [row["batch"] for row in rows] == [3, 3]


def test_fit_says_which_batches_stopped_at_max_batch(tmp_path):
    done = subprocess.run([sys.executable, "-c", "from d2o.cli import main; main()", "bench", "fit", "--kv-memory",
                           "1TB", "--shape", "tiny", "--prompt", "32", "--generate", "4", "--methods", "full,h2o",
                           "--budget", "0.5", "--min-tokens", "4", "--max-batch", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "full, h2o: the batch reached --max-batch 2 rows before the KV cap" in done.stderr
    written = json.loads((tmp_path / "fit.json").read_text())
    assert [row["batch"] for row in written["rows"]] == [2, 2]
    assert written["setting"]["min_tokens"] == 4 and "budget 0.5 (floor 4)" in (tmp_path / "fit.md").read_text()


def test_a_method_decoding_alone_reports_its_own_peak_not_the_others_caches(tiny):
    """As on a GPU: each method's batch is built, decoded and freed before the next one's."""
    rows = {row["method"]: row for row in bench_decode(tiny, None, ["full", "h2o"], [480], [32], Budget.parse("0.2"),
                                                       steps=2, alone=True)}
    assert rows["full"]["peak_mib"] >= rows["full"]["kv_mib"] > 3 * rows["h2o"]["kv_mib"]  # 15 MiB
    assert rows["h2o"]["peak_mib"] < rows["full"]["kv_mib"]  # the full cache is not held beside it


def test_decode_counts_the_operations_of_a_step_and_compression_adds_some(tiny):
    rows = {row["method"]: row for row in bench_decode(tiny, None, ["full", "streamingllm", "h2o", "d2o"], [200], [1],
                                                       Budget(ratio=0.2, min_tokens=0), steps=6)}
    ops = {name: row["ops_per_step"] for name, row in rows.items()}
    # The stock cache appends and attends; an evicting cache also masks by slot and chooses a victim;
    # H2O accumulates attention besides; D2O also merges.
    assert 0 < ops["full"] < ops["streamingllm"] < ops["h2o"] < ops["d2o"], ops
    short = bench_decode(tiny, None, ["full"], [200], [1], Budget.parse("0.2"), steps=3)
    assert "ops_per_step" not in short[0]  # too few steps to count one past the first


def test_the_budget_sized_full_cache_holds_the_prompts_last_tokens_the_budget_keeps(tiny):
    """Its KV is the full cache's over as many tokens as the budget keeps per layer (0.25 of 400 = 100),
    each cache grown by the same decode steps."""
    steps = 3
    rows = {row["method"]: row for row in bench_decode(tiny, None, ["full", "h2o"], [400], [2], Budget(ratio=0.25,
                                                       min_tokens=0), steps=steps, budget_sized_full=True)}
    sized, full = rows["full, budget-sized"], rows["full"]
    assert sized["budget"] == "0.25" and sized["batch"] == 2 and "evict_every" not in sized
    per_token = full["kv_mib"] / (400 + steps)
    assert sized["kv_mib"] == pytest.approx(per_token * (100 + steps), rel=1e-3)
    assert sized["kv_vs_full"] == pytest.approx((100 + steps) / (400 + steps), abs=1e-3)


def test_decode_runs_each_method_that_takes_it_with_adaptive_heads_too(tiny):
    """snapkv and h2o with each KV head its own count: a row of their own, the same pairs held as the
    even layout's (batch 1; h2o's even layout also holds the empty slots its next evict_every tokens
    go to, its runs do not); cam's merge cannot take uneven heads, so it runs even only."""
    rows = bench_decode(tiny, None, ["full", "snapkv", "h2o", "cam"], [200], [1], Budget(ratio=0.3, min_tokens=0),
                        steps=3, heads=("even", "adaptive"))
    found = {(row["method"], row["heads"]): row for row in rows}
    assert sorted(found) == [("cam", "even"), ("full", "-"), ("h2o", "adaptive"), ("h2o", "even"),
                             ("snapkv", "adaptive"), ("snapkv", "even")]
    assert found["snapkv", "adaptive"]["kv_mib"] == found["snapkv", "even"]["kv_mib"]
    assert found["h2o", "adaptive"]["kv_mib"] < found["h2o", "even"]["kv_mib"]


def test_the_gpu_script_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu.sh with a tiny shape: the same commands and files as on a GPU."""
    env = {**os.environ, "SHAPE": "tiny", "DEVICE": "cpu", "DTYPE": "float32", "PROMPT": "64", "GENERATE": "64",
           "BATCHES": "1,2", "STEPS": "2", "D2O": str(Path(sys.executable).parent / "d2o")}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("decode.md", "decode.json", "decode.png", "throughput.md", "throughput.json", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 0
    decode = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert {row["length"] for row in decode} == {64, 80, 96, 112, 128}
    rows = json.loads((tmp_path / "throughput.json").read_text())["rows"]
    assert {(row["method"], row["batch"]) for row in rows} == {(m, b) for m in ("full", "h2o", "d2o") for b in (1, 2)}
    at_end = {(row["method"], row["batch"]): row["kv_mib_at_end"] for row in rows}
    assert at_end[("d2o", 2)] < at_end[("full", 2)] / 3  # 12 tokens per layer against 128


@pytest.mark.parametrize("args, message", [
    (["fit", "--kv-memory", "1KB", "--shape", "tiny", "--prompt", "64", "--generate", "8"],
     "a KV cap of 1,000 bytes holds not one 64+8-token sequence under full (it needs 73,728)"),
    (["fit", "--kv-memory", "1MB", "--shape", "tiny", "--generate", "1"], "generate must be at least 2, got 1"),
    (["fit", "--kv-memory", "1MB", "--shape", "tiny", "--max-batch", "0"], "max_batch must be at least 1, got 0"),
    (["fit", "--kv-memory", "12XB", "--shape", "tiny"],
     "memory size '12XB': expected a number of bytes or a number with a unit"),
    (["decode", "--shape", "tiny", "--positions", "100", "--lengths", "200", "--steps", "2"],
     "prompt too long for the model: 200 tokens + 2 new need 202 positions, the model has 100"),
    (["decode", "--shape", "tiny", "--methods", "full,nope"], "unknown method 'nope'"),
    (["decode", "--shape", "huge"], "unknown shape 'huge'; choose one of: smollm2, llama-3-8b, tiny"),
    (["prefill", "--shape", "tiny", "--budget", "3t"], "budget 3t leaves 3 tokens per layer; d2o needs at least 5"),
    (["prefill", "--shape", "tiny", "--methods", "h2o,full"],
     "full is the stock prefill: plain SDPA is timed in every run already"),
    (["prefill", "--shape", "tiny", "--methods", "h2o,d2o,h2o"], "h2o given twice in methods"),
])
def test_bad_bench_input_is_one_line_and_exit_code_2(args, message, tmp_path):
    done = subprocess.run([sys.executable, "-c", "from d2o.cli import main; main()", "bench", *args,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr


def test_a_cpu_run_is_measured_on_the_cpu_even_where_a_gpu_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, this run on its CPU
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)  # what a GPU's allocator would say
    result, peak = measure_peak(lambda: torch.ones(64, 2**20).sum(), torch.device("cpu"))  # 256 MiB
    assert result == 64 * 2**20
    assert peak > 128 * 2**20


def test_prefill_times_each_method_against_the_same_sdpa_runs(tiny):
    row, = bench_prefill(tiny, None, [96], ["h2o", "d2o"], Budget.parse("0.2"), repeats=2)
    assert list(row) == ["length", "sdpa_s", "h2o_s", "h2o_over_sdpa", "d2o_s", "d2o_over_sdpa", "sdpa_peak_mib",
                         "h2o_peak_mib", "d2o_peak_mib", "stats_peak_mib", "attention_matrix_mib"]
    assert row["length"] == 96 and all(row[f"{method}_over_sdpa"] > 0 for method in ("h2o", "d2o"))


def test_prefill_in_chunks_is_timed_beside_the_same_method_prefilled_whole(tiny):
    row, = bench_prefill(tiny, None, [96], ["h2o"], Budget.parse("0.2"), chunks=[32])
    assert [key for key in row if "@" in key] == ["h2o@32_s", "h2o@32_over_sdpa", "h2o@32_peak_mib",
                                                   "h2o@32_over_whole", "h2o@32_peak_over_whole"]
    # Its time is measured; its peak (resident-memory growth) may be 0 here: a tiny model's 32-token
    # chunks can fit in memory the process holds already.
    assert row["h2o@32_over_whole"] > 0


def test_the_attention_matrix_is_sized_in_the_models_dtype():
    half = random_model("tiny", positions=512, dtype="bfloat16")
    row, = bench_prefill(half, None, [512], ["h2o"], Budget.parse("0.2"))
    assert row["attention_matrix_mib"] == 4 * 512**2 * 2 / 2**20  # 4 heads, 2 bytes each


class TenTokenEssays:
    """A tokenizer to which the essays are 10 tokens, 0 to 9; it counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text, add_special_tokens):
        self.calls += 1
        return SimpleNamespace(input_ids=list(range(10)))

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_fit_prompts_come_from_one_tokenization_and_differ_past_the_end_of_the_essays():
    tokenizer = TenTokenEssays()
    prompt_of = row_prompts(tokenizer, 256, 4)
    prompts = [prompt_of(row) for row in range(8)]
    assert tokenizer.calls == 1
    assert prompts[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the essays in order
    assert prompts[2:4] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the next pass a token later
    assert prompts[7] == [7, 8, 9, 0]  # around the end
    assert len({tuple(p) for p in prompts}) == 8 and all(len(p) == 4 for p in prompts)


def test_serve_prompts_differ_for_more_requests_than_the_essays_hold():
    prompts = serve_prompts(TenTokenEssays(), 8, 4)  # 8 x 4 tokens from essays of 10 (a stride of 97 ran out)
    assert prompts[:3] == ["0 1 2 3", "4 5 6 7", "1 2 3 4"]
    assert len(set(prompts)) == 8 and all(len(p.split()) == 4 for p in prompts)


def test_fit_decode_rate_counts_the_tokens_its_steps_computed(tiny, monkeypatch):
    """generate - 1 per row: the first token comes from the prefill's logits, before decoding."""
    clock = iter(range(10**6))
    monkeypatch.setattr(fit, "perf_counter", lambda: next(clock))  # every timed phase takes 1 s
    prompt, generate, budget = 64, 5, Budget(ratio=0.2, min_tokens=8)
    full = plan(tiny.config, get_method("full"), budget, prompt, generate)
    for row in bench_fit(tiny, None, 3 * full.held_bytes, prompt, generate, ["full", "h2o"], budget, 4):
        assert row["decode_tokens_per_s"] == row["batch"] * (generate - 1)


def test_throughput_reads_the_memory_at_the_last_steps_context_as_it_does_the_step_times():
    measured = [{"method": "full", "budget": "-", "batch": 2, "length": length, "ms_per_step": ms, "kv_mib": kv,
                 "peak_mib": peak} for length, ms, kv, peak in [(100, 10.0, 1.0, 3.0), (200, 20.0, 2.0, 5.0)]]
    row, = integrate(measured, prompt=100, generate=51)  # steps at contexts 100..150
    assert row["seconds"] == round(sum(10 + (context - 100) / 10 for context in range(100, 151)) / 1000, 2)
    assert row["kv_mib_at_end"] == 1.5 and row["peak_mib"] == 4.0  # not the longest context's 2.0 and 5.0


@pytest.mark.parametrize("rows, message", [
    ([], "no rows of `d2o bench decode` to integrate"),
    ([{"method": "full", "budget": "-", "batch": 8, "peak_kv_mib": 1.7}],  # a row of bench fit
     "a row that `d2o bench decode` did not write: length, ms_per_step, kv_mib missing, not a number"),
    # Numbers no measurement gives: a division by zero, negative tokens/s, a TypeError
    ([{"method": "full", "budget": "-", "batch": 1, "length": 10, "ms_per_step": 0, "kv_mib": 1.0}],
     "did not write: ms_per_step missing, not a number or not positive"),
    ([{"method": "full", "budget": "-", "batch": 1, "length": 10, "ms_per_step": 2.0, "kv_mib": 1.0,
       "peak_mib": "x"}], "did not write: peak_mib missing"),
    ([{"method": ["full"], "budget": "-", "batch": 1, "length": 10, "ms_per_step": 2.0, "kv_mib": 1.0}],
     "did not write: method missing"),
])
def test_throughput_of_rows_not_from_bench_decode_is_one_line_and_exit_code_2(rows, message, tmp_path):
    (tmp_path / "decode.json").write_text(json.dumps({"rows": rows}))
    done = subprocess.run([sys.executable, "-c", "from d2o.cli import main; main()", "bench", "throughput",
                           "--decode", str(tmp_path / "decode.json"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr


def test_between_evictions_a_step_costs_at_most_a_third_more_operations_than_the_full_cache():
    """Thirty layers, as SmolLM2: with eviction every 8 steps a step between evictions writes its token,
    attends and accumulates (D2O, d2o-plus) or only attends (StreamingLLM), and no more (counted by
    dispatched operations)."""
    deep = tiny_model("llama", num_hidden_layers=30)
    rows = bench_decode(deep, None, ["full", "d2o", "d2o-plus", "streamingllm"], [300], [1],
                        Budget(ratio=0.2, min_tokens=0), steps=18, evict_every=(1, 8))
    ops = {(row["method"], row["evict_every"]): row["ops_per_step"] for row in rows}
    full = ops[("full", "-")]
    for method in ("d2o", "d2o-plus", "streamingllm"):
        assert ops[(method, 8)] <= 1.3 * full < ops[(method, 1)], ops
    # The mean over 8 steps carries an eighth of the eviction's operations.
    mean = {row["method"]: row["mean_ops_per_step"] for row in rows if row["evict_every"] == 8}
    for method in ("d2o", "d2o-plus"):
        assert mean[method] > ops[(method, 8)] + (ops[(method, 1)] - ops[(method, 8)]) / 8, (mean, ops)


def test_time_per_step_is_a_median_over_windows_that_each_pay_an_eviction():
    """Steps of 1 ms with an eviction of 9 ms every fourth: the median over single steps would say 1."""
    assert window_means([1, 1, 1, 9] * 3, 4) == [3, 3, 3]
    assert window_means([1, 1, 1, 9, 5], 4) == [3]  # a partial window is left out
    assert window_means([2, 4], 4) == [3]  # fewer steps than a window: the run's mean
