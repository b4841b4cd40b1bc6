"""d2o compare: paired differences of two methods with a bootstrap interval, on folders d2o eval wrote."""

import json
import math

import pytest

from d2o import D2OError
from d2o.eval.compare import compare, markdown
from d2o.eval.results import SampleStore
from tests.test_errors import run_cli


def write_folder(path, lines, task="niah", protocol="prompt", seed=0, **identity):
    """A results folder as d2o eval leaves it: config.json with its identity, samples.jsonl."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"identity": {"task": task, "protocol": protocol, "model": "m",
                                                               "seed": seed, **identity}}))
    store = SampleStore(path / "samples.jsonl")
    for method, budget, sample_id, score, *curve in lines:
        store.append({"task": task, "subtask": None, "sample_id": sample_id, "method": method, "budget": budget,
                      "score": score, **({"curve": curve[0]} if curve else {})})
    return path


def scores(method, budget, values):
    return [(method, budget, f"s{i}", value) for i, value in enumerate(values)]


def test_differences_means_and_counts_are_those_of_the_paired_samples(tmp_path):
    folder = write_folder(tmp_path / "r", scores("a", "0.5", [1, 0.5, 0, 1]) + scores("b", "0.5", [0, 0.5, 1, 0])
                          + scores("b", "0.2", [1, 1, 1]))  # no "a" at 0.2: not compared
    (only,) = compare([folder], "a", "b", resamples=200)
    assert (only.budget, only.n, only.mean, only.mean_against) == ("0.5", 4, 0.625, 0.375)
    assert only.difference == pytest.approx(0.25)
    assert (only.better, only.worse) == (2, 1)
    assert -1 <= only.low <= only.difference <= only.high <= 1


def test_the_full_cache_run_once_pairs_with_every_budget(tmp_path):
    folder = write_folder(tmp_path / "r", scores("full", "1", [1, 1]) + scores("a", "0.1", [0, 1])
                          + scores("a", "0.2", [1, 1]))
    result = compare([folder], "a", "full", resamples=100)
    assert [(r.budget, r.difference, r.worse) for r in result] == [("0.1", -0.5, 1), ("0.2", 0.0, 0)]


def test_a_constant_difference_has_no_spread(tmp_path):
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [0.75, 0.5, 1.0]) + scores("b", "0.2", [0.5, 0.25, 0.75]))
    (only,) = compare([folder], "a", "b", resamples=500)
    assert (only.low, only.difference, only.high) == pytest.approx((0.25, 0.25, 0.25))


def test_the_interval_is_the_bootstraps_binomial_quantiles(tmp_path):
    """With 5 of 20 differences 1 and the rest 0, a resampled mean is Binomial(20, 1/4) / 20:
    its 2.5% and 97.5% quantiles, computed exactly, are the interval's ends."""
    n, k = 20, 5
    cdf = [sum(math.comb(n, i) * 0.25**i * 0.75 ** (n - i) for i in range(j + 1)) for j in range(n + 1)]
    low = next(j for j in range(n + 1) if cdf[j] >= 0.025) / n
    high = next(j for j in range(n + 1) if cdf[j] >= 0.975) / n
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [1] * k + [0] * (n - k)) + scores("b", "0.2", [0] * n))
    (only,) = compare([folder], "a", "b", resamples=40_000, seed=3)
    assert (only.low, only.high) == pytest.approx((low, high), abs=1 / n)
    wider = compare([folder], "a", "b", resamples=40_000, confidence=0.99, seed=3)[0]
    assert wider.low <= only.low and wider.high >= only.high and (wider.low, wider.high) != (only.low, only.high)


def test_perplexity_is_compared_window_by_window_as_a_ratio(tmp_path):
    folder = write_folder(tmp_path / "p", [("a", "0.1", "text", 20.0, [10.0, 40.0, 20.0]),
                                           ("b", "0.1", "text", 21.0, [12.0, 36.0, 24.0])], task="perplexity")
    (only,) = compare([folder], "a", "b", resamples=100)
    ratios = [10 / 12, 40 / 36, 20 / 24]
    assert math.exp(only.difference) == pytest.approx(math.prod(ratios) ** (1 / 3))
    assert (only.n, only.better, only.worse) == (3, 2, 1)  # lower perplexity is better
    assert "| x0.9" in markdown([only], "a", "b", 0.95)


def test_folders_of_one_task_and_protocol_are_also_pooled(tmp_path):
    one = write_folder(tmp_path / "seed0", scores("a", "0.2", [1, 0]) + scores("b", "0.2", [0, 0]))
    two = write_folder(tmp_path / "seed1", scores("a", "0.2", [1, 1, 1]) + scores("b", "0.2", [1, 1, 0]))
    other = write_folder(tmp_path / "context", scores("a", "0.2", [0]) + scores("b", "0.2", [1]), protocol="context")
    result = compare([one, two, other], "a", "b", resamples=100)
    assert [(r.results, r.n) for r in result] == [(str(one), 2), (str(two), 3), (str(other), 1),
                                                  ("pooled: 2 folders", 5)]
    assert result[-1].difference == pytest.approx(0.4) and result[-1].better == 2


@pytest.mark.parametrize("options, message", [
    ({"against": "c"}, "holds no run of 'c'; it holds a, b"),
    ({"against": "a"}, "compare 'a' against another method, or against itself run another way"),
    ({"confidence": 1.5}, "confidence=1.5 must be between 0 and 1"),
    ({"resamples": 0}, "resamples=0 must be at least 1"),
])
def test_bad_input_names_the_problem(tmp_path, options, message):
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [1]) + scores("b", "0.5", [1]))
    with pytest.raises(D2OError, match=message):
        compare([folder], **{"method": "a", "against": "b", **options})


def test_one_method_run_two_ways_pairs_across_two_folders_of_the_same_samples(monkeypatch, capsys, tmp_path):
    chunked = write_folder(tmp_path / "chunked", scores("a", "0.2", [1, 0, 1]) + scores("b", "0.2", [0, 0, 0]),
                           prefill_chunk=64)
    whole = write_folder(tmp_path / "whole", scores("a", "0.2", [1, 1, 1]) + scores("full", "1", [1, 1, 0]))
    (only,) = compare([chunked], "a", "a", resamples=100, against_paths=[whole])
    assert (only.n, only.mean, only.mean_against, only.worse) == (3, 2 / 3, 1.0, 1)
    (full,) = compare([chunked], "a", "full", resamples=100, against_paths=[whole])
    assert (full.difference, full.better, full.worse) == (0.0, 1, 1)
    code, out, _ = run_cli(monkeypatch, capsys, "compare", str(chunked), "--method", "a", "--against", "a",
                           "--against-results", str(whole))
    assert code == 0 and out.splitlines()[0].startswith("| results | budget | n | a (chunked) | a (whole) |")
    other_seed = write_folder(tmp_path / "seed1", scores("a", "0.2", [1]), seed=1)
    with pytest.raises(D2OError, match="hold different samples .* their runs do not pair"):
        compare([chunked], "a", "a", against_paths=[other_seed])
    with pytest.raises(D2OError, match="1 results folder.s. and 2 to compare against"):
        compare([chunked], "a", "a", against_paths=[whole, other_seed])


def test_runs_of_different_ruler_tasks_pair_on_the_tasks_both_ran_and_nothing_else_may_differ(tmp_path):
    def ruler(name, tasks, method, values, length=8192):
        lines = [(method, "0.1", f"ruler-{task}-{length}-0-{i}", value) for task in tasks for i, value in
                 enumerate(values)]
        return write_folder(tmp_path / name, lines, task="ruler",
                            task_settings={"length": length, "tasks": list(tasks)})

    whole = ruler("whole", ["niah_single_1", "fwe"], "a", [1, 1])
    chunked = ruler("chunked", ["niah_single_1"], "a", [1, 0])
    (only,) = compare([chunked], "a", "a", resamples=100, against_paths=[whole])
    assert (only.n, only.mean, only.mean_against, only.worse) == (2, 0.5, 1.0, 1)
    longer = ruler("longer", ["niah_single_1"], "a", [1, 0], length=4096)
    with pytest.raises(D2OError, match="hold different samples"):
        compare([longer], "a", "a", against_paths=[whole])
    niah = write_folder(tmp_path / "niah", scores("a", "0.1", [1]), task_settings={"tasks": ["x"]})
    other = write_folder(tmp_path / "niah2", scores("a", "0.1", [1]), task_settings={"tasks": ["y"]})
    with pytest.raises(D2OError, match="hold different samples"):  # a task of no sub-tasks: any setting counts
        compare([niah], "a", "a", against_paths=[other])


def test_methods_without_a_common_sample_or_a_folder_eval_did_not_write_are_refused(tmp_path):
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [1]) + scores("b", "0.5", [1]))
    with pytest.raises(D2OError, match="'a' and 'b' share no sample at any budget"):
        compare([folder], "a", "b")
    with pytest.raises(D2OError, match="holds no samples.jsonl: give folders that d2o eval wrote"):
        compare([tmp_path], "a", "b")


def test_the_command_prints_the_table(monkeypatch, capsys, tmp_path):
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [1, 1]) + scores("b", "0.2", [0, 1]))
    code, out, _ = run_cli(monkeypatch, capsys, "compare", str(folder), "--method", "a", "--against", "b")
    assert code == 0
    assert out.splitlines()[0].startswith("| results | budget | n | a | b | a - b | 95% interval |")
    assert out.splitlines()[2] == f"| {folder} | 0.2 | 2 | 1.000 | 0.500 | +0.500 | [+0.000, +1.000] | 1 / 0 / 1 |"
    code, _, err = run_cli(monkeypatch, capsys, "compare", str(folder), "--method", "a", "--against", "z")
    assert code == 2 and err.strip() == f"error: {folder} holds no run of 'z'; it holds a, b"


def test_resamples_drawn_in_blocks_are_those_drawn_at_once(tmp_path, monkeypatch):
    """The bootstrap draws its indices a block at a time (memory bounded): the interval is the one
    a single draw of every index gives, block boundaries falling mid-way."""
    folder = write_folder(tmp_path / "r", scores("a", "0.2", [i % 3 / 2 for i in range(40)])
                          + scores("b", "0.2", [i % 5 / 4 for i in range(40)]))
    at_once = compare([folder], "a", "b", resamples=1_000, seed=7)[0]
    monkeypatch.setattr("d2o.eval.compare.RESAMPLE_BLOCK", 40 * 3 + 7)  # 3 draws a block, 334 blocks
    blocked = compare([folder], "a", "b", resamples=1_000, seed=7)[0]
    assert (blocked.low, blocked.high) == (at_once.low, at_once.high) and at_once.low < at_once.high
