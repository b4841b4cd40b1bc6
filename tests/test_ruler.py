"""RULER's tasks: prompts as RULER's own scripts write them, its scorers, both protocols, the summary."""

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import byte_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from d2o import D2OError
from d2o.eval import results
from d2o.eval.metrics import string_match_all, string_match_part
from d2o.eval.sweep import EvalConfig, run_eval
from d2o.eval.tasks import get_task
from d2o.eval.tasks.ruler import TASKS

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
OFFLINE = dict(haystack=str(FIXTURES / "haystack.txt"), data_dir=str(FIXTURES / "qa"), chat=False)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word or run of punctuation: the tokenizer the reference was written with."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def reference() -> dict[tuple[str, int], list[dict]]:
    """Samples written by RULER's scripts (tests/fixtures/ruler/make_reference.py), seed 42."""
    cases = defaultdict(list)
    with gzip.open(FIXTURES / "reference.jsonl.gz", "rt", encoding="utf-8") as stream:
        for line in stream:
            row = json.loads(line)
            cases[(row["task"], row["length"])].append(row)
    return cases


CASES = reference()


def test_the_reference_covers_every_task():
    assert {task for task, _ in CASES} == set(TASKS) and len(TASKS) == 13


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda case: f"{case[0]}-{case[1]}")
def test_prompts_are_rulers_character_for_character(case):
    name, length = case
    expected = CASES[case]
    task = get_task("ruler", length=length, tasks=name, **OFFLINE)
    samples = task.samples(word_tokenizer(), len(expected), 42)
    assert [s.prompt for s in samples] == [row["prompt"] for row in expected]
    assert [s.gold for s in samples] == [row["outputs"] for row in expected]
    tokenizer = word_tokenizer()
    for sample in samples:  # the prompt and its answer fit the length, as RULER counts tokens
        assert len(tokenizer(sample.prompt, add_special_tokens=False).input_ids) + sample.max_new_tokens <= length
        assert sample.meta["subtask"] == name and sample.id.startswith(f"ruler-{name}-{length}-42-")


def test_scorers_are_rulers():
    assert string_match_all("Keys: 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_all("the words: APPLE, pear", ["apple", "Pear"]) == 1.0  # case does not matter
    assert string_match_part("It is Paris, France.", ["London", "paris"]) == 1.0
    assert string_match_part("It is Rome.", ["London", "Paris"]) == 0.0
    task = get_task("ruler", tasks="niah_multivalue,qa_1", length=1024, **OFFLINE)
    niah, qa = task.samples(word_tokenizer(), 1, 0)
    assert task.score(" ".join(niah.gold[:3]), niah) == {"score": 0.75}  # all of them: 3 of 4 found
    assert task.score(f"maybe {qa.gold[0]}", qa) == {"score": 1.0}  # any of them
    assert task.answer("  1234567\x0b 7654321\t ") == "1234567\n 7654321"  # control characters -> newlines


def test_the_question_comes_last_and_can_be_kept_out_of_compression():
    tokenizer = word_tokenizer()
    task = get_task("ruler", tasks="niah_single_1,vt,cwe,qa_2", length=1024, **OFFLINE)
    niah, vt, cwe, qa = task.samples(tokenizer, 1, 3)
    assert niah.question.startswith("\nWhat is the special magic number for ") and niah.question.endswith(
        "mentioned in the provided text is")
    assert vt.question.startswith("\nQuestion: Find all variables that are assigned the value ")
    assert cwe.question.startswith("\nQuestion: What are the 10 most common words in the above list?")
    assert qa.question.startswith("\n\nAnswer the question based on the given documents.")
    for sample in (niah, vt, cwe, qa):
        context, question = task.encode(sample, tokenizer, "context")
        assert question == tokenizer(sample.question, add_special_tokens=False).input_ids
        assert context + question == tokenizer(sample.prompt).input_ids  # (a word tokenizer splits there)


def test_a_chat_template_frames_the_task_as_rulers_model_templates_do():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "<user>{{ messages[0]['content'] }}</user><bot>"
    sample = get_task("ruler", tasks="niah_single_1", length=2048).samples(tokenizer, 1, 0)[0]
    assert sample.prompt.startswith("<user>A special magic number is hidden within the following text.")
    assert "mentioned in the provided text?</user><bot> The special magic number for " in sample.prompt
    assert sample.question.startswith("\nWhat is the special magic number") and "</user><bot>" in sample.question
    assert not sample.special_tokens  # the template's text carries them


def test_missing_qa_data_is_skipped_or_refused(monkeypatch, capsys, tmp_path):
    from d2o.eval import downloads

    def unreachable(*args):
        raise D2OError("no network")

    monkeypatch.setattr(downloads, "archive_member", unreachable)
    samples = get_task("ruler", length=1024, haystack=OFFLINE["haystack"], chat=False).samples(word_tokenizer(), 1, 0)
    assert {s.meta["subtask"] for s in samples} == set(TASKS) - {"qa_1", "qa_2"}
    assert "ruler: qa_1 skipped: no squad data; point --task-option data_dir=DIR" in capsys.readouterr().err
    with pytest.raises(D2OError, match="ruler: qa_2 skipped: no hotpotqa data"):
        get_task("ruler", tasks="qa_2", data_dir=str(tmp_path)).samples(word_tokenizer(), 1, 0)


def test_bad_options_are_named(tmp_path):
    with pytest.raises(D2OError, match="ruler has no task niah_single_9; its tasks: niah_single_1, "):
        get_task("ruler", tasks="niah_single_9")
    with pytest.raises(D2OError, match="length=100 must be at least 256"):
        get_task("ruler", length=100)
    with pytest.raises(D2OError, match="data_dir '.*nowhere' is not a folder"):
        get_task("ruler", data_dir=str(tmp_path / "nowhere"))
    (tmp_path / "squad.json").write_text('{"data": [{"paragraphs": [{}]}]}')
    with pytest.raises(D2OError, match="squad.json is not squad's JSON as RULER reads it"):
        get_task("ruler", tasks="qa_1", data_dir=str(tmp_path)).samples(word_tokenizer(), 1, 0)
    with pytest.raises(D2OError, match="ruler: length 300 is too short for variable tracking"):
        get_task("ruler", tasks="vt", length=300).samples(word_tokenizer(), 1, 0)


def test_the_summary_has_a_column_per_task_and_the_averages():
    rows = [{"task": f"ruler/{name}", "method": method, "budget": budget, "score": score, "n": 2, "kv_share": share}
            for name, scores in (("niah_single_1", (1.0, 0.5)), ("vt", (0.8, 0.4)), ("qa_2", (0.1, 0.3)))
            for (method, budget, share), score in zip((("full", "1", 1.0), ("h2o", "0.25", 0.25)), scores)]
    rows += results.averages(rows)
    summary = {(r["task"], r["method"]): r["score"] for r in rows}
    assert summary[("ruler (average)", "h2o")] == pytest.approx((0.5 + 0.4 + 0.3) / 3, abs=1e-4)
    assert summary[("ruler (average, full >= 0.3)", "h2o")] == pytest.approx(0.45)  # qa_2 left out
    assert summary[("ruler (average, full >= 0.3)", "full")] == pytest.approx(0.9)
    config = EvalConfig(task="ruler", methods=("full", "h2o"))
    table = results.markdown_table(rows, get_task("ruler"), config)
    header = "| method | budget | niah_single_1 | qa_2 * | vt | average | average, full >= 0.3 | KV held / full |"
    assert header in table
    assert "| h2o | 0.25 | 0.500 | 0.300 | 0.400 | 0.400 | 0.450 | 0.25 | 2 |" in table
    assert "### ruler/vt" not in table  # no table per sub-task


@pytest.mark.real_model
def test_ruler_end_to_end(real_model, tmp_path):
    out = tmp_path / "ruler"
    config = EvalConfig(task="ruler", methods=("full", "d2o-plus"), budgets=("0.5",), limit=1, out=str(out),
                        task_options={"tasks": ("niah_single_1", "fwe"), "length": 512})
    rows = run_eval(config, progress=False)
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted((line["subtask"], line["method"]) for line in lines) == [
        ("fwe", "d2o-plus"), ("fwe", "full"), ("niah_single_1", "d2o-plus"), ("niah_single_1", "full")]
    for line in lines:
        assert line["score"] == string_match_all(line["prediction"], line["gold"])
    full_niah = next(line for line in lines if line["subtask"] == "niah_single_1" and line["method"] == "full")
    assert full_niah["score"] == 1.0  # the full cache finds a needle in 512 tokens of repeated noise
    assert {r["task"] for r in rows} == {"ruler/niah_single_1", "ruler/fwe", "ruler (average)"}
    assert "| method | budget | fwe | niah_single_1 | average |" in (out / "summary.md").read_text()
