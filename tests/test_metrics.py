"""Metrics against hand-computed values, and LongBench's loader on fixtures written here."""

import json

import pytest

from d2o import D2OError
from d2o.eval.metrics import (
    best_over,
    coqa_scores,
    classification_score,
    code_sim_score,
    count_score,
    exact_match,
    final_number,
    normalize_answer,
    qa_f1,
    retrieval_score,
    rouge_l,
    rouge_lsum,
)
from d2o.eval.tasks import get_task
from d2o.eval.tasks.base import Sample
from d2o.eval.tasks.longbench import PROMPTS
from d2o.eval.tasks.niah import fact_recall
from d2o.options import option_texts


def test_squad_normalisation_f1_and_exact_match():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    # "denver broncos" vs "broncos of denver": 2 common, P = 2/2, R = 2/3 -> F1 = 0.8
    assert qa_f1("The Denver Broncos", "Broncos of Denver") == pytest.approx(0.8)
    assert exact_match("the Broncos.", "Broncos") == 1.0
    assert best_over(qa_f1, "Santa Clara", ["Levi's Stadium", "Santa Clara, California"]) == pytest.approx(0.8)
    assert qa_f1("", "anything") == 0.0


def test_coqa_scores_leave_each_gold_out():
    # Golds white x3, grey: leaving a "white" out, the best of the rest is "grey" (1); leaving "grey"
    # out, 0. Mean 3/4, where the best over all would say 1.
    assert coqa_scores("grey", ["white", "white", "white", "grey"]) == {"f1": 0.75, "exact_match": 0.75}
    assert coqa_scores("white", ["white", "white", "white", "grey"]) == {"f1": 1.0, "exact_match": 1.0}
    assert coqa_scores("a white cat", ["white"]) == {"f1": pytest.approx(2 / 3), "exact_match": 0.0}
    # An answer with no words left after normalisation ("the"), against another: 1, as CoQA's scorer
    # says (SQuAD's F1 says 0), so F1 agrees with exact match.
    assert coqa_scores("", ["the", "a"]) == {"f1": 1.0, "exact_match": 1.0}
    assert coqa_scores("white", ["the"]) == {"f1": 0.0, "exact_match": 0.0}


def test_rouge_l_is_the_union_lcs_over_distinct_words():
    # One sentence each: LCS of "the cat sat on the mat" / "the cat lay on the mat" = the cat on the mat,
    # distinct LCS words {the, cat, on, mat} = 4; distinct words 5 and 5 -> P = R = 0.8.
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(0.8, abs=1e-6)
    # Two reference sentences: LCS words {a, b} and {d} -> 3 of the reference's 4 distinct words,
    # the hypothesis has 5 distinct words: R = 3/4, P = 3/5, F = 2/3.
    assert rouge_l("a b c d e", "a b. x d") == pytest.approx(2 / 3, abs=1e-6)
    assert rouge_l("", "a b") == 0.0 and rouge_l("same words", "same words") == pytest.approx(1.0, abs=1e-6)
    # Two LCS of "a c c" (reference) and "c a c": "a c" and "c c"; the package rebuilds "c c" (on a
    # tie it steps back in the hypothesis), one distinct word of two: P = R = 1/2.
    assert rouge_l("c a c", "a c c") == pytest.approx(0.5, abs=1e-6)
    # A part of blanks after the last "." is a sentence of one empty word: the hypothesis has 3
    # distinct words, the reference 2 (its part after "." is empty, dropped): R = 1, P = 2/3.
    assert rouge_l("Summary: good. ", "Summary: good.") == pytest.approx(0.8, abs=1e-6)


def test_rouge_lsum_is_rouge_scores_summary_level_lcs():
    # Case and punctuation are ignored (rouge_l counts "The" and "sat!" as other words).
    assert rouge_lsum("The cat, sat!", "the cat sat") == 1.0
    # Hits are counted per occurrence, not per distinct word: LCS 2 of 3 words each side.
    assert rouge_lsum("a a b", "a b a") == pytest.approx(2 / 3)
    # " . " ends a sentence (lm-eval's preparation), then the union of each reference sentence's
    # LCS with every prediction sentence: [a b] gets a from [a c] and b from [b d], [c d] gets
    # c and d -> 4 of 4. A "." without a blank before it does not split: LCS 3 of 4 -> 0.75.
    assert rouge_lsum("a c . b d", "a b . c d") == 1.0
    assert rouge_lsum("a c. b d", "a b. c d") == 0.75
    # On a tie rouge_score's read-out steps back in the reference: "a b" against the line "b a"
    # gives "a", the line "a" gives "a" again -> 1 hit, P = 1/3, R = 1/2, F = 0.4 (stepping back
    # in the prediction would give "b" too: 0.8).
    assert rouge_lsum("b a\na", "a b") == pytest.approx(0.4)
    assert rouge_lsum("", "a") == 0.0 and rouge_lsum("...", "a") == 0.0


def test_truthfulqa_adds_no_comment_and_scores_with_rouge_lsum(tmp_path, monkeypatch):
    from d2o.eval.tasks import truthfulqa

    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps({"prefix": "Q: x\nA: y\n\n", "examples": [
        {"Question": "What happens if you eat seeds?", "True answers": ["Nothing happens."],
         "False answers": ["You get sick."]},
        {"Question": "Why?", "True answers": ["I have no comment.", "Because."], "False answers": ["No."]},
    ]}))
    monkeypatch.setattr(truthfulqa, "archive_member", lambda package, member: questions)
    task = get_task("truthfulqa")
    samples = sorted(task.samples(None, None, 0), key=lambda sample: sample.id)
    assert samples[0].gold["true"] == ["Nothing happens.", "I have no comment."]
    assert samples[1].gold["true"] == ["I have no comment.", "Because."]  # not twice
    assert task.score("I have no comment.", samples[0]) == {"accuracy": 1.0, "rouge_diff": 1.0}
    assert task.score("nothing happens!", samples[0]) == {"accuracy": 1.0, "rouge_diff": 1.0}
    assert task.score("You get SICK", samples[0]) == {"accuracy": 0.0, "rouge_diff": -1.0}


def test_classification_gives_partial_credit_and_drops_contained_names():
    classes = ["City", "Location City", "Person"]
    assert classification_score("It is a Location City.", "Location City", classes) == 1.0  # "City" dropped
    assert classification_score("Person or Location City", "Location City", classes) == 0.5
    assert classification_score("Person", "Location City", classes) == 0.0
    # LongBench's loop skips the name after a dropped one: [a, ab, abc] -> [ab, abc] -> 1/2.
    assert classification_score("abc ab a", "abc", ["a", "ab", "abc"]) == 0.5


def test_retrieval_count_and_code_similarity():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("no idea", "Paragraph 12") == 0.0
    assert count_score("There are 7 unique paragraphs, not 8", "7") == 0.5
    assert code_sim_score("```python\n# comment\nx = foo(1)\n", "x = foo(1)") == 1.0
    # difflib: "abcd" vs "abce" share 3 of 8 characters twice -> 2*3/8 = 0.75.
    assert code_sim_score("abcd", "abce") == 0.75
    assert code_sim_score("# only comments", "x = 1") == 0.0


def test_final_number_of_a_chain_of_thought():
    assert final_number("12 + 30 = 42 rolls. The answer is 42.") == "42"
    assert final_number("The answer is 16 / 2 = 8. The answer is 8.") == "8"
    assert final_number("It costs $1,250 in total") == "1250"
    assert final_number("x = 2.50") == "2.5"
    assert final_number("no number") is None


def test_needle_fact_recall():
    assert fact_recall("a pinch of smoked sea salt.", "smoked sea salt") == 1.0
    assert fact_recall("sea salt", "smoked sea salt") == pytest.approx(2 / 3)


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


@pytest.fixture
def longbench_dir(tmp_path):
    write_jsonl(tmp_path / "hotpotqa.jsonl", [
        {"input": "Who wrote it?", "context": "Passage 1: Ann wrote it.", "answers": ["Ann"], "_id": "h1"},
    ])
    write_jsonl(tmp_path / "trec.jsonl", [
        {"input": "Question: Where is Paris?\nType:", "context": "Question: Who is he?\nType: Individual",
         "answers": ["Location City"], "all_classes": ["City", "Location City", "Individual"], "_id": "t1"},
    ])
    write_jsonl(tmp_path / "passage_retrieval_en.jsonl", [
        {"input": "an abstract", "context": "Paragraph 1: a\n\nParagraph 2: b", "answers": ["Paragraph 2"],
         "_id": "r1"},
    ])
    return tmp_path


class Words:
    """A whitespace tokenizer with LongBench's interface needs (tokens, decode, no chat template)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return type("Encoding", (), {"input_ids": text.split(" ")})

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(ids)


def test_longbench_prompts_truncation_and_scores(longbench_dir):
    task = get_task("longbench", data_dir=str(longbench_dir), max_length=6)
    assert task.datasets == ("hotpotqa", "passage_retrieval_en", "trec")
    samples = {s.meta["subtask"]: s for s in task.samples(Words(), None, 0)}
    hotpot = samples["hotpotqa"]
    assert hotpot.max_new_tokens == 32
    # The formatted prompt is cut in the middle to 6 words, the first 3 and the last 3, decoded
    # and joined as LongBench does (real tokenizers carry the space inside the token).
    assert hotpot.prompt == "Answer the question" + "Who wrote it?\nAnswer:"
    assert task.score("Ann.", hotpot)["score"] == 1.0
    # trec: first line only, partial credit rules.
    assert task.score("Location City\nIndividual", samples["trec"])["score"] == 1.0
    assert task.score("Paragraph 2", samples["passage_retrieval_en"])["score"] == 1.0


def test_longbench_truncation_keeps_the_question_whole(tmp_path):
    context = " ".join(f"c{i}" for i in range(60))
    write_jsonl(tmp_path / "hotpotqa.jsonl", [{"input": "Who wrote it?", "context": context, "answers": ["Ann"]}])
    words = Words()

    task = get_task("longbench", data_dir=str(tmp_path))

    def sample(max_length):
        return get_task("longbench", data_dir=str(tmp_path), max_length=max_length).samples(words, None, 0)[0]

    prompt = words(PROMPTS["hotpotqa"].format(input="Who wrote it?", context=context)).input_ids
    after = PROMPTS["hotpotqa"].split("{context}")[1].format(input="Who wrote it?")
    # The part after the context is 23 words alone; one more is kept, as a word may span the
    # border ("c59\n\nAnswer" here). With 60, LongBench's 30 + 30 words hold it: its rule as it is.
    assert sample(60).prompt == words.decode(prompt[:30]) + words.decode(prompt[-30:])
    # With 40, LongBench's last 20 words would cut it: the last 24 are kept, the first 16.
    at_40 = sample(40)
    assert at_40.prompt == words.decode(prompt[:16]) + words.decode(prompt[-24:])
    assert at_40.prompt.endswith("c58 c59" + after) and at_40.question == after
    assert task.encode(at_40, words, "context")[1] == words(after).input_ids
    # With 10 it cannot fit: LongBench's 5 + 5 words, and the question fed is what it keeps of it.
    at_10 = sample(10)
    assert at_10.prompt == words.decode(prompt[:5]) + words.decode(prompt[-5:])
    assert at_10.question == "other words.\n\nQuestion: Who wrote it?\nAnswer:"
    for max_length in (1, 0, -4):
        with pytest.raises(D2OError, match=f"max_length={max_length} must be a whole number >= 2"):
            sample(max_length)
    with pytest.raises(D2OError, match="sample x has no question to keep out of compression"):
        task.encode(Sample("x", "p", "g", 8), words, "context")


def test_longbench_scores_the_answer_as_generated(tmp_path):
    write_jsonl(tmp_path / "lcc.jsonl", [{"input": "", "context": "def f(x):\n", "answers": ["    return x"]}])
    task = get_task("longbench", data_dir=str(tmp_path))
    sample = task.samples(Words(), None, 0)[0]
    generated = "\n    return x\n"
    assert task.answer(generated) == generated
    assert task.score(task.answer(generated), sample)["score"] == 1.0
    # Stripped (as every task's answer was), the line lost its indentation: 2 * 8 / 20 = 0.8.
    assert task.score(generated.strip(), sample)["score"] == 0.8
    assert get_task("squad").answer(" Paris. \n") == "Paris."


def test_longbench_bad_data_names_the_problem(tmp_path):
    with pytest.raises(D2OError, match="not found"):
        get_task("longbench", data_dir=str(tmp_path / "missing"))
    with pytest.raises(D2OError, match="no LongBench files"):
        get_task("longbench", data_dir=str(tmp_path))
    (tmp_path / "qasper.jsonl").write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{"input": "q"\n')
    task = get_task("longbench", data_dir=str(tmp_path))
    with pytest.raises(D2OError, match=r"qasper.jsonl:2: not valid JSON"):
        task.samples(Words(), None, 0)
    (tmp_path / "qasper.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(D2OError, match=r"qasper.jsonl:1: missing field answers"):
        task.samples(Words(), None, 0)
    # A trec record without its classes was a TypeError once its answer came, the run lost.
    for classes in ("null", "[]", '"City"', '[1, 2]'):
        record = f'{{"input": "q", "context": "c", "answers": ["a"], "all_classes": {classes}}}'
        (tmp_path / "trec.jsonl").write_text(record + "\n")
        with pytest.raises(D2OError, match=r"trec.jsonl:1: 'all_classes' must be a non-empty list of class names"):
            get_task("longbench", data_dir=str(tmp_path), datasets=("trec",)).samples(Words(), None, 0)
    with pytest.raises(D2OError, match="Chinese"):
        get_task("longbench", data_dir=str(tmp_path), datasets=("dureader",))
    with pytest.raises(D2OError, match="trec given twice in longbench's datasets"):
        get_task("longbench", data_dir=str(tmp_path), datasets=("trec", "trec"))
    with pytest.raises(D2OError, match="unknown LongBench dataset"):
        get_task("longbench", data_dir=str(tmp_path), datasets=("nope",))


def test_task_options_are_checked():
    with pytest.raises(D2OError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(D2OError, match="task 'passkey' takes no option lengths"):
        get_task("passkey", lengths=(1, 2))
    with pytest.raises(D2OError, match="depths must be between 0 and 1"):
        get_task("niah", depths=(0.5, 2.0))
    for shots in (5, -1):  # were 4 and 3 examples, silently
        with pytest.raises(D2OError, match=f"shots={shots} must be a whole number from 0 to 4"):
            get_task("gsm8k", shots=shots)
    assert get_task("gsm8k", shots=0).shots == 0
    for window in (0, -3):  # were a RuntimeError from torch once the whole text had been run
        with pytest.raises(D2OError, match=f"window .* must be at least 1, got {window}"):
            get_task("perplexity", window=window)
    sample = Sample("x", "p", "42", 8)
    assert get_task("gsm8k").score("so the answer is 42.", sample) == {"accuracy": 1.0}


def test_task_options_from_the_command_line_are_read_by_their_defaults(tmp_path):
    # Texts and paths are taken as given, commas and colons included; lists split on "," or ":".
    folder = tmp_path / "lb,v1:2"
    folder.mkdir()
    write_jsonl(folder / "hotpotqa.jsonl", [{"input": "q", "context": "c", "answers": ["a"]}])
    task = get_task("longbench", **option_texts([f"data_dir={folder}", "datasets=hotpotqa", "max_length=100"]))
    assert (task.data_dir, task.datasets, task.max_length) == (str(folder), ("hotpotqa",), 100)
    niah = get_task("niah", **option_texts(["needle=The code is 42, remember it.", "fact=42", "lengths=300,400",
                                            "depths=0:0.5", "haystack=none"]))
    assert niah.needle == "The code is 42, remember it." and niah.haystack is None
    assert niah.lengths == (300, 400) and niah.depths == (0, 0.5)
    assert get_task("longbench", data_dir=folder).data_dir == str(folder)  # a Path from Python
    with pytest.raises(D2OError, match=r"option data_dir=\('a', 'b'\) must be a text"):
        get_task("longbench", data_dir=("a", "b"))
