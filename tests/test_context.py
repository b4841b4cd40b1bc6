"""Compress once, answer many: ``d2o.compress``, ``ask``, saving and loading, the CLI, and the
evaluation's shared contexts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import byte_tokenizer, tiny_model

import d2o
from d2o.engine.cache import CompressedCache
from d2o.engine.schedule import Schedule
from d2o.eval.runner import Run, Runner
from d2o.eval.sweep import shared_contexts
from d2o.eval.tasks import get_task
from d2o.eval.tasks.niah import NEEDLES
from d2o.runtime.context import compress, load_context
from d2o.runtime.decoding import Batch, Sequence

CONTEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 5
QUESTIONS = ["What jumps?", "Who is lazy? Tell me now, please.", "Where?"]
METHODS = ["d2o-novelty", "h2o", "snapkv", "kvzip", "expected-attention", "full"]


def budget_of(method: str):
    return d2o.Budget.parse(1.0) if method == "full" else d2o.Budget(ratio=0.3, min_tokens=0)


def context_protocol(model, tokenizer, method: str, ids: list[int], question: str, stops) -> list[int]:
    """The evaluation's --protocol context by hand: the context prefilled and compressed alone,
    then the question fed, then greedy decoding."""
    cache = CompressedCache(model, d2o.get_method(method), budget_of(method), tokenizer=tokenizer)
    batch = Batch.prefill(model, cache, [ids], [Sequence(tokenizer, 8, stop_ids=stops)])
    batch.feed([tokenizer(question, add_special_tokens=False).input_ids])
    return batch.run()[0].tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", METHODS)
def test_each_answer_is_the_context_protocols_and_a_batch_is_them_one_by_one(arch, method):
    model, tokenizer = tiny_model(arch), byte_tokenizer()
    context = compress(model, tokenizer, CONTEXT, method, budget_of(method), evict_every=1)  # as the evaluation's
    before = [(layer.keys, layer.token_index.clone()) for layer in context.cache.layers]
    nbytes = context.nbytes
    one_by_one = [context.ask(q, max_new_tokens=8).new_tokens[0] for q in QUESTIONS]
    together = context.ask(QUESTIONS, max_new_tokens=8)
    assert together.new_tokens == one_by_one
    assert one_by_one == [context_protocol(model, tokenizer, method, context.ids, q, context.stop_ids)
                          for q in QUESTIONS]
    # Asking changed nothing: the same tensors, the same slots, the same answers again.
    assert context.nbytes == nbytes
    for layer, (keys, index) in zip(context.cache.layers, before):
        assert layer.keys is keys and torch.equal(layer.token_index, index)
    assert context.ask(QUESTIONS[0], max_new_tokens=8).new_tokens[0] == one_by_one[0]
    # Every question's row holds its layer's budget exactly: the context's tokens and its own, evicted to it.
    budgets = [(k, b) for layer in together.report.layers for k, b in zip(layer.kept, layer.budget) if b is not None]
    assert (method == "full") == (not budgets)
    if d2o.get_method(method).evicts_during_decode:
        assert all(k == b for k, b in budgets)
    else:  # compressed once (SnapKV, KVzip, ...): the question's and answer's tokens stay beside the context's
        assert all(k > b for k, b in budgets)


def test_a_saved_context_answers_alike_and_refuses_another_model(tmp_path):
    model, tokenizer = tiny_model("qwen3"), byte_tokenizer()
    context = compress(model, tokenizer, CONTEXT, "d2o-plus", 0.3, min_tokens=0)
    path = context.save(tmp_path / "ctx.safetensors")
    loaded = load_context(path, model, tokenizer)
    assert loaded.ids == context.ids and loaded.budget == context.budget and loaded.method == context.method
    assert loaded.nbytes == context.nbytes
    assert loaded.ask(QUESTIONS, max_new_tokens=8).new_tokens == context.ask(QUESTIONS, max_new_tokens=8).new_tokens
    with pytest.raises(d2o.D2OError, match="compressed with another model .*weights differ"):
        load_context(path, tiny_model("qwen3", seed=1), tokenizer)
    with pytest.raises(d2o.D2OError, match="compressed with another model .*config"):
        load_context(path, tiny_model("llama"), tokenizer)
    with pytest.raises(d2o.D2OError, match="compressed with another model .*dtype"):
        load_context(path, tiny_model("qwen3", dtype=torch.bfloat16), tokenizer)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(d2o.D2OError, match="is not a saved context"):
        load_context(tmp_path / "junk.safetensors", model, tokenizer)
    with pytest.raises(d2o.D2OError, match="no context file"):
        load_context(tmp_path / "missing.safetensors", model, tokenizer)


def test_a_context_of_another_d2o_version_is_refused(tmp_path, monkeypatch):
    from d2o.runtime import context as module

    model, tokenizer = tiny_model(), byte_tokenizer()
    path = compress(model, tokenizer, CONTEXT, "h2o", 0.3, min_tokens=0).save(tmp_path / "ctx.safetensors")
    monkeypatch.setattr(module, "_version", lambda: "9.9.9")
    with pytest.raises(d2o.D2OError, match=r"saved by d2o 0\.1\.0 .* this is d2o 9\.9\.9"):
        load_context(path, model, tokenizer)


def test_bad_contexts_and_questions_are_refused():
    model, tokenizer = tiny_model(), byte_tokenizer()
    with pytest.raises(d2o.D2OError, match="d2o-official first compresses after the first decode step"):
        compress(model, tokenizer, CONTEXT, "d2o-official", 0.3)
    with pytest.raises(d2o.D2OError, match="the prompt is empty"):
        compress(model, tokenizer, "  ", "h2o", 0.3)
    with pytest.raises(d2o.D2OError, match="no chat template"):
        compress(model, tokenizer, CONTEXT, "h2o", 0.3, chat=True)
    context = compress(model, tokenizer, CONTEXT, "h2o", 0.3, min_tokens=0)
    with pytest.raises(d2o.D2OError, match="the question is empty"):
        context.ask(" ")
    with pytest.raises(d2o.D2OError, match="no question to ask"):
        context.ask([])
    with pytest.raises(d2o.D2OError, match="needs a context compressed as a conversation"):
        context.ask("What?", chat=True)
    with pytest.raises(d2o.D2OError, match="prompt too long for the model"):
        context.ask("What?", max_new_tokens=2000)


class _Echo:
    """A task stub: keeps the answer, scores nothing."""

    def answer(self, text):
        return text

    def score(self, prediction, sample):
        return {"score": 0.0}


def test_the_evaluation_compresses_a_shared_context_once_and_answers_as_alone(monkeypatch):
    model, tokenizer = tiny_model(), byte_tokenizer()
    methods = {name: d2o.get_method(name) for name in ("d2o-novelty", "snapkv")}
    runs = [Run(name, d2o.Budget(ratio=0.3, min_tokens=0)) for name in methods]
    ids = tokenizer(CONTEXT).input_ids
    questions = [tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS]

    class Sample:
        def __init__(self, i):
            self.id, self.max_new_tokens, self.stop = f"s{i}", 8, ()

    samples = [Sample(i) for i in range(3)]
    compressions = []
    original = Schedule.compress

    def counted(schedule):
        cache = schedule.cache
        if not schedule.allocated and schedule.forwards >= cache.policy.compress_after_forward \
                and not cache.budget.unlimited:
            compressions.append(cache.policy.name)
        return original(schedule)

    monkeypatch.setattr(Schedule, "compress", counted)
    runner = Runner(model, tokenizer, methods)
    grouped = {(s.id, o.run.method): o.prediction
               for s, o in runner.answer(_Echo(), samples, ids, questions, [runs] * 3)}
    assert sorted(compressions) == ["d2o-novelty", "snapkv"]  # once per run, not once per question
    for sample, question in zip(samples, questions):
        for run in runs:
            alone = next(runner.answer(_Echo(), [sample], ids, [question], [[run]]))[1]
            assert grouped[(sample.id, run.method)] == alone.prediction


def test_samples_of_one_context_are_grouped_under_the_context_protocol_only():
    class Sample:
        def __init__(self, name):
            self.id = name

    samples = [Sample(name) for name in "abcd"]
    encoded = {"a": ([1, 2], [3]), "b": ([1, 2], [4]), "c": ([1, 5], [3]), "d": ([1, 2], [3])}
    assert [[s.id for s in g] for g in shared_contexts(samples, encoded, "context")] == [["a", "b"], ["c"], ["d"]]
    assert [[s.id for s in g] for g in shared_contexts(samples, encoded, "prompt")] == [["a"], ["b"], ["c"], ["d"]]


def test_niah_with_several_needles_asks_each_of_one_context(real_model):
    _, tokenizer = real_model
    task = get_task("niah", needles=4, lengths=(600,))
    samples = task.samples(tokenizer, 2, 0)
    assert len(samples) == 8 and len({s.id for s in samples}) == 8
    contexts = [task.encode(s, tokenizer, "context")[0] for s in samples]
    assert contexts[:4] == [contexts[0]] * 4 and contexts[4] != contexts[0]
    for index, sample in enumerate(samples[:4]):  # every needle is in every context; each sample asks its own
        assert all(needle in sample.prompt for needle, *_ in NEEDLES[:4])
        assert NEEDLES[index][1] in sample.question and sample.gold == NEEDLES[index][3]
    assert [s.meta["depth"] for s in samples[:4]] == [0.0, 1 / 3, 2 / 3, 1.0]
    with pytest.raises(d2o.D2OError, match="needles=4 hides built-in needles .*: needle, fact cannot be set"):
        get_task("niah", needles=4, needle="The cat is blue.", fact="blue")
    with pytest.raises(d2o.D2OError, match="needles=9 must be a whole number from 1 to 8"):
        get_task("niah", needles=9)


SQUAD = {"data": [{"title": f"T{t}", "paragraphs": [
    {"context": f"Passage {t}.{p} says the answer is {t}{p}.",
     "qas": [{"id": f"q{t}{p}{q}", "question": f"Question {q} on {t}.{p}?", "answers": [{"text": f"{t}{p}"}]}
             for q in range(3)]} for p in range(2)]} for t in range(6)]}
COQA = {"data": [{"id": f"story{s}", "story": f"Story {s} is about a dog named Rex{s}.",
                  "questions": [{"input_text": f"Turn {i} of {s}?"} for i in range(4)],
                  "answers": [{"input_text": f"answer {i}"} for i in range(4)]} for s in range(45)]}


def test_squad_and_coqa_ask_several_questions_of_one_context(real_model, tmp_path, monkeypatch):
    from d2o.eval.tasks import coqa, squad

    _, tokenizer = real_model
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    (tmp_path / "coqa.json").write_text(json.dumps(COQA))
    monkeypatch.setattr(squad, "archive_member", lambda package, member: tmp_path / "squad.json")
    monkeypatch.setattr(coqa, "archive_member", lambda package, member: tmp_path / "coqa.json")
    task = get_task("squad", questions=3, length=200)
    samples = task.samples(tokenizer, 2, 0)
    assert len(samples) == 6
    for group in (samples[:3], samples[3:]):
        assert len({s.id.split("-")[1][:-1] for s in group}) == 1  # one paragraph's questions
        contexts = [task.encode(s, tokenizer, "context")[0] for s in group]
        assert contexts == [contexts[0]] * 3
        assert [s.meta["turn"] for s in group] == [0, 1, 2]
    task = get_task("coqa", turns=3, length=300, history=1)
    samples = task.samples(tokenizer, 2, 0)
    assert [s.meta["turn"] for s in samples] == [0, 1, 2, 0, 1, 2]
    contexts = [task.encode(s, tokenizer, "context")[0] for s in samples[:3]]
    assert contexts == [contexts[0]] * 3
    assert "Q: Turn 1 of" in samples[2].question and "A: answer 1" in samples[2].question  # the turn before
    assert "Turn 0 of" not in samples[2].question  # history=1: only the last earlier turn


def test_a_conversation_compressed_whole_answers_as_the_full_cache(real_model):
    model, tokenizer = real_model
    conversation = [{"role": "system", "content": "You answer in one short sentence."},
                    {"role": "user", "content": "My cat is called Biscuit and she is orange."},
                    {"role": "assistant", "content": "Biscuit sounds lovely."}]
    context = compress(model, tokenizer, conversation, "full", 1.0, chat=True)
    question = "What is my cat called?"
    whole = d2o.generate(model, tokenizer, conversation + [{"role": "user", "content": question}], "full", 1.0,
                         chat=True, max_new_tokens=12)
    asked = context.ask(question, max_new_tokens=12)
    assert asked.new_tokens == whole.new_tokens and "Biscuit" in asked.text
    assert asked.prompt_tokens == whole.prompt_tokens


def test_the_cli_saves_a_context_and_a_new_process_answers_alike(real_model, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("Notes from the harbour. " * 20 + "The ferry to Marrow Island leaves at seven. "
                        + "Gulls everywhere. " * 20)
    questions = tmp_path / "questions.txt"
    questions.write_text("Question: When does the ferry to Marrow Island leave? Answer: It leaves at\n\n"
                         "Question: Where does the ferry go? Answer: To\n")
    saved = tmp_path / "ctx.safetensors"
    command = [sys.executable, "-m", "d2o", "generate", "--max-new-tokens", "6", "--json"]
    first = subprocess.run([*command, "--context-file", str(document), "--questions-file", str(questions),
                            "--budget", "0.5", "--save-context", str(saved)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([*command, "--load-context", str(saved), "--questions-file", str(questions)],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    first, again = json.loads(first.stdout), json.loads(again.stdout)
    assert first["method"] == "d2o-novelty" and first["budget"] == "0.5"
    assert [a["text"] for a in first["answers"]] == [a["text"] for a in again["answers"]]
    assert len(first["answers"]) == 2 and first["kv_tokens_kept"] == again["kv_tokens_kept"]
    refused = subprocess.run([*command, "--load-context", str(saved), "--question", "Why?", "--budget", "0.1"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "--budget cannot change a saved context" in refused.stderr
