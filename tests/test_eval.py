"""`d2o eval` end to end on the real model, with small settings."""

import csv
import json
import math

import pytest
import torch

from d2o import D2OError
from d2o.eval.sweep import EvalConfig, check_folder, record_config, run_eval
from d2o.eval.tasks import get_task

PASSKEY = dict(task="passkey", budgets=("0.5",), limit=2, task_options={"length": 400})


def lines(folder):
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def key(line):
    return line["sample_id"], line["method"], line["budget"]


def test_sweep_writes_results_and_resumes(real_model, tmp_path):
    out = tmp_path / "run"
    rows = run_eval(EvalConfig(methods=("full", "h2o", "d2o"), out=str(out), **PASSKEY), progress=False)
    first = (out / "samples.jsonl").read_text()
    assert len(lines(out)) == 2 * 3
    assert {(r["method"], r["budget"], r["n"]) for r in rows} == {
        ("full", "1", 2), ("h2o", "0.5", 2), ("d2o", "0.5", 2)}
    with (out / "summary.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert list(table[0]) == ["task", "method", "budget", "score", "n"]
    assert "| method | budget 0.5 | n |" in (out / "summary.md").read_text()
    assert (out / "score_vs_budget.png").stat().st_size > 0 and (out / "d2o_layer_budgets.png").exists()
    for line in lines(out):
        assert line["score"] == float(line["prediction"].strip(". ").startswith(line["gold"]))
        assert line["seconds"] >= line["prefill_seconds"] > 0  # a shared prefill counted in every row
        if line["method"] != "full":
            assert line["kv_tokens_kept"] == sum(line["layer_budgets"])
            assert line["kv_tokens_kept"] == round(30 * 0.5 * line["meta"]["tokens"])

    # A rerun with one more method computes only that method; what was written stays as it was.
    run_eval(EvalConfig(methods=("full", "h2o", "d2o", "snapkv"), out=str(out), **PASSKEY), progress=False)
    assert (out / "samples.jsonl").read_text().startswith(first)
    assert sorted(line["method"] for line in lines(out)[6:]) == ["snapkv", "snapkv"]

    # One prefill per sample gives the answers of separate runs, and a seed gives the same samples.
    separate = tmp_path / "separate"
    run_eval(EvalConfig(methods=("full", "h2o", "d2o", "snapkv"), out=str(separate), shared_prefill=False,
                        **PASSKEY), progress=False)
    shared = {key(line): line["prediction"] for line in lines(out)}
    assert {key(line): line["prediction"] for line in lines(separate)} == shared

    # A run of fewer samples at another budget summarises its own runs only, not the folder's.
    rows = run_eval(EvalConfig(methods=("full", "h2o"), out=str(out), **{**PASSKEY, "limit": 1, "budgets": ("0.2",)}),
                    progress=False)
    assert {(r["method"], r["budget"], r["n"]) for r in rows} == {("full", "1", 1), ("h2o", "0.2", 1)}
    assert "budget 0.5" not in (out / "summary.md").read_text()


def test_bad_input_leaves_results_intact(real_model, tmp_path):
    out = tmp_path / "run"
    run_eval(EvalConfig(methods=("full",), out=str(out), **PASSKEY), progress=False)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(D2OError, match="another configuration .*seed"):
        run_eval(EvalConfig(methods=("full",), out=str(out), **{**PASSKEY, "limit": 1}, seed=1), progress=False)
    with pytest.raises(D2OError, match="unknown method 'nope'"):
        run_eval(EvalConfig(methods=("full", "nope"), out=str(out), **PASSKEY), progress=False)
    with pytest.raises(D2OError, match="budget ratio must be in"):
        run_eval(EvalConfig(methods=("h2o",), out=str(out), **{**PASSKEY, "budgets": ("2",)}), progress=False)
    with pytest.raises(D2OError, match="unknown task"):
        run_eval(EvalConfig(task="nope", out=str(out)), progress=False)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    too_long = tmp_path / "long"
    with pytest.raises(D2OError, match=r"prompt too long for the model: .* the model has 8192 \(\d+ too many\)"):
        run_eval(EvalConfig(methods=("full",), out=str(too_long), **{**PASSKEY, "task_options": {"length": 8400}}),
                 progress=False)
    assert not (too_long / "samples.jsonl").exists()


def test_a_corrupt_config_is_named(tmp_path):
    config = EvalConfig(**PASSKEY, out=str(tmp_path))
    task = get_task("passkey", length=400)
    for text in ('{"identity": {"task": "pass', "[1, 2]", '{"last_run": {}}', "\xff"):  # were tracebacks
        (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
        with pytest.raises(D2OError, match="config.json is not a configuration that d2o eval wrote"):
            check_folder(tmp_path, config, task)


def test_list_options_take_a_python_list_a_tuple_a_text_or_one_value():
    # A list from Python (lengths=[300, 500]) was refused as "lengths=[300, 500] must be a whole number".
    for given in ([300, 500], (300, 500), "300,500"):
        assert get_task("niah", lengths=given).lengths == (300, 500)
    assert get_task("niah", lengths=300).lengths == (300,)
    with pytest.raises(D2OError, match="option lengths='a' must be a whole number"):
        get_task("niah", lengths=[300, "a"])


def test_a_folder_from_before_a_task_option_existed_resumes_at_its_default(tmp_path):
    """A folder written before `needles` was a NIAH option records no `needles`: it ran one needle,
    the default, and resumes; another value is refused."""
    config = EvalConfig(task="niah", out=str(tmp_path), task_options={"lengths": (300,)})
    task = get_task("niah", lengths=(300,))
    record_config(tmp_path, config, task)
    written = json.loads((tmp_path / "config.json").read_text())
    del written["identity"]["task_settings"]["needles"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    check_folder(tmp_path, config, task)
    with pytest.raises(D2OError, match="differs in: task_settings"):
        check_folder(tmp_path, config, get_task("niah", lengths=(300,), needles=2))


def test_niah_grid_and_heatmaps(real_model, tmp_path):
    config = EvalConfig(task="niah", methods=("full", "d2o"), budgets=("0.5",), out=str(tmp_path),
                        task_options={"lengths": (300, 500), "depths": (0.0, 1.0)})
    rows = run_eval(config, progress=False)
    assert len(lines(tmp_path)) == 4 * 2 and {r["n"] for r in rows} == {4}
    assert {(line["meta"]["length"], line["meta"]["depth"]) for line in lines(tmp_path)} == {
        (300, 0.0), (300, 1.0), (500, 0.0), (500, 1.0)}
    assert (tmp_path / "niah_heatmap_0.5.png").exists()


def test_perplexity_with_full_cache_equals_one_forward(real_model, tmp_path):
    model, tokenizer = real_model
    task = get_task("perplexity", length=256, chunk=64, window=128)
    tokens = torch.tensor([task.encode(task.samples(tokenizer, None, 0)[0], tokenizer)[0]])
    with torch.inference_mode():
        logits = model(input_ids=tokens).logits[0, :-1].float()
    direct = math.exp(torch.nn.functional.cross_entropy(logits, tokens[0, 1:]).item())
    config = EvalConfig(task="perplexity", methods=("full", "streamingllm"), budgets=("0.25",), out=str(tmp_path),
                        task_options={"length": 256, "chunk": 64})
    rows = {r["method"]: r for r in run_eval(config, progress=False)}
    assert rows["full"]["score"] == pytest.approx(direct, rel=1e-4)
    assert rows["streamingllm"]["score"] > rows["full"]["score"]
    streaming = next(line for line in lines(tmp_path) if line["method"] == "streamingllm")
    assert streaming["kv_tokens_kept"] == 30 * 64  # 0.25 of 256 tokens per layer
    assert (tmp_path / "perplexity_curve_0.25.png").exists()


def test_the_eval_command(real_model, tmp_path, monkeypatch, capsys):
    import sys

    from d2o.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["d2o", "eval", *args])
        try:
            main()
        except SystemExit as exit_info:
            return exit_info.code
        return 0

    out = tmp_path / "cli"
    assert run("--task", "passkey", "--task-option", "length=300", "--limit", "1", "--methods", "full,h2o",
               "--budgets", "0.5", "--option", "h2o.split=3:1", "--out", str(out)) == 0
    assert "| h2o | " in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["identity"]["method_options"] == {"h2o": {"split": [3, 1]}}
    assert run("--task", "passkey", "--task-option", "lengths=300,400", "--out", str(tmp_path / "bad")) == 2
    assert "task 'passkey' takes no option lengths" in capsys.readouterr().err
    assert run("--task", "longbench", "--task-option", f"data_dir={tmp_path / 'missing'}",
               "--out", str(tmp_path / "bad")) == 2
    assert "LongBench data folder" in capsys.readouterr().err


def test_the_perplexity_curve_is_drawn_at_the_end_of_each_window():
    """1,000 tokens, 999 predicted, windows of 400: 401, 801 and the short last one at 1,000 (the
    points were spaced by 1,000 // 3 = 333)."""
    from d2o.eval.plots import window_ends

    assert window_ends(3, 400, 1000) == [401, 801, 1000]
    assert window_ends(2, 64, 129) == [65, 129]



@pytest.mark.real_model
def test_a_sweep_on_two_ray_workers_writes_the_rows_of_one_process_and_resumes(real_model, tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'd2o[ray]')")
    settings = dict(methods=("full", "h2o"), **{**PASSKEY, "limit": 3})
    run_eval(EvalConfig(out=str(tmp_path / "one"), **settings), progress=False)
    spread = tmp_path / "ray"
    run_eval(EvalConfig(out=str(spread), ray="local", workers=2, **settings), progress=False)

    def rows(folder):
        return {key(line): (line["prediction"], line["score"], line["kv_tokens_kept"], line["kv_bytes"],
                            line["layer_budgets"]) for line in lines(folder)}

    assert rows(spread) == rows(tmp_path / "one") and len(rows(spread)) == 3 * 2
    # Cut off after two samples (one sample's rows lost): the rerun computes only that sample's rows.
    kept = [line for line in lines(spread) if line["sample_id"] != lines(spread)[-1]["sample_id"]]
    (spread / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in kept))
    before = (spread / "samples.jsonl").read_text()
    run_eval(EvalConfig(out=str(spread), ray="local", workers=2, **settings), progress=False)
    assert (spread / "samples.jsonl").read_text().startswith(before)
    assert len(lines(spread)) == 6 and rows(spread) == rows(tmp_path / "one")
