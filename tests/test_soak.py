"""The soak test, short: 16 mixed requests against a live server (`d2o bench soak` runs 500)."""

from __future__ import annotations

import pytest

from d2o.bench.soak import BAD, KINDS, requests_of, soak, soak_config
from d2o.cli import main

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("prefill_thread", [False, True])
def test_sixteen_mixed_requests_leave_no_error_no_hang_and_the_library_answers(real_model, prefill_thread):
    model, tokenizer = real_model
    config = soak_config("smollm2", requests=16, kv_memory=64_000_000, prefix_cache_memory=16_000_000,
                         prefill_chunk=256, prefill_thread=prefill_thread)
    report = soak(model, tokenizer, config, requests=16, clients=8, max_tokens=8, seed=0, timeout=120)
    assert set(report["kinds"]) == set(KINDS)  # every kind was sent
    assert report["server_errors"] == 0 and report["hung"] == 0 and report["unexpected_status"] == 0, report
    assert report["answers_compared"] >= 12 and report["answers_different"] == 0, report["examples_different"]
    assert report["kv_bytes_peak"] <= report["kv_memory"]
    # Idle again: only the kept documents remain, counted under the cap, and reused while the soak ran.
    assert report["idle_at_end"] and report["kv_bytes_end"] == report["prefix_cache_bytes_end"] > 0
    assert report["prefix_cache_hits"] >= 1
    # Every client that left (mid-stream, or tired of waiting for 200 tokens) was seen to leave.
    assert report["requests_cancelled"] == report["kinds"]["cancel"]
    assert report["requests_finished"] == 16 - report["kinds"]["bad"] - report["kinds"]["cancel"]
    assert report["ok"]


def test_the_requests_drawn_are_the_seeds_and_mix_every_kind(real_model):
    _, tokenizer = real_model
    first, again, other = (requests_of(tokenizer, "smollm2", 200, seed, 8) for seed in (0, 0, 1))
    assert [(r.kind, r.body) for r in first] == [(r.kind, r.body) for r in again]
    assert [(r.kind, r.body) for r in first] != [(r.kind, r.body) for r in other]
    assert {r.kind for r in first} == set(KINDS)
    bad = [r for r in first if r.kind == "bad"]
    assert bad and all(r.status in (400, 404) and r.expected is None for r in bad)
    assert all(isinstance(r.body, bytes) or r.body["model"] == ("gpt-9" if r.status == 404 else "smollm2")
               for r in bad)
    assert len({str(body) for body, _ in BAD}) == len(BAD)


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "requests, clients and max-tokens must be at least 1"),
    (["--prefix-cache-memory", "64MB", "--kv-memory", "64MB"], "must be >= 0 and leave room for the requests"),
    (["--kv-memory", "lots"], "lots"),
])
def test_bad_soak_options_are_one_line_and_exit_code_2(monkeypatch, capsys, args, message):
    monkeypatch.setattr("sys.argv", ["d2o", "bench", "soak", *args])
    with pytest.raises(SystemExit) as raised:
        main()
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
