"""d2o as an lm-evaluation-harness model: a local task (a YAML and a JSONL written here, no hub)."""

import json
import os
import textwrap

import pytest
import torch
from conftest import tiny_model

lm_eval = pytest.importorskip("lm_eval", reason="the lmeval extra is not installed (pip install 'd2o[lmeval]')")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from d2o import D2OError  # noqa: E402
from d2o.eval.harness import D2OLM  # noqa: E402
from d2o.runtime.generation import generate  # noqa: E402

FACTS = [("The capital of France is", " Paris"), ("Two plus two equals", " four"),
         ("The colour of a clear sky is", " blue"), ("Water freezes at zero degrees", " Celsius")]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two local tasks: answers generated until a newline, and a choice among continuations."""
    folder = tmp_path_factory.mktemp("tasks")
    filler = "Notes kept in the old harbour office list ships, their cargo and the weather of each day. " * 6
    with (folder / "facts.jsonl").open("w") as stream:
        for i, (prompt, answer) in enumerate(FACTS):
            stream.write(json.dumps({"prompt": filler[: 80 * (i + 1)] + prompt, "answer": answer.strip(),
                                     "choices": [answer, " London", " seven"], "label": 0}) + "\n")
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / "facts.jsonl"}
        test_split: test
        """
    (folder / "local_generate.yaml").write_text(textwrap.dedent("""
        task: d2o_local_generate
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{answer}}"
        generation_kwargs:
          until: ["\\n", "."]
          max_gen_toks: 6
          do_sample: false
        metric_list:
          - metric: exact_match
        """) + textwrap.dedent(common))
    (folder / "local_choice.yaml").write_text(textwrap.dedent("""
        task: d2o_local_choice
        output_type: multiple_choice
        doc_to_text: "{{prompt}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{label}}"
        metric_list:
          - metric: acc
        """) + textwrap.dedent(common))
    return TaskManager(include_path=str(folder)), [json.loads(line) for line in (folder / "facts.jsonl").open()]


def evaluate(manager, task, model, model_args, batch_size=2):
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=manager,
                                  batch_size=batch_size, log_samples=True, device="cpu")
    return [sample["resps"] for sample in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.real_model
def test_generate_until_answers_as_d2o_generate(tasks, real_model):
    manager, docs = tasks
    model, tokenizer = real_model
    responses = evaluate(manager, "d2o_local_generate", "d2o", "pretrained=smollm2,method=d2o-plus,budget=0.2")
    expected = generate(model, tokenizer, [doc["prompt"] for doc in docs], "d2o-plus", 0.2, max_new_tokens=6,
                        stop=("\n", ".")).texts
    assert [r[0][0] for r in responses] == expected


@pytest.mark.real_model
def test_the_full_method_answers_and_scores_as_lm_evals_hf_model(tasks, real_model):
    from d2o.models import embedded_model_folder

    manager, _ = tasks
    folder = embedded_model_folder("smollm2")
    hf = f"pretrained={folder},dtype=float32"
    assert evaluate(manager, "d2o_local_generate", "d2o", "method=full") == \
        evaluate(manager, "d2o_local_generate", "hf", hf)
    ours, theirs = (evaluate(manager, "d2o_local_choice", model, args) for model, args in
                    (("d2o", "method=full"), ("hf", hf)))
    for mine, reference in zip(ours, theirs):
        assert [r[0][1] for r in mine] == [r[0][1] for r in reference]  # the same choice is greedy
        assert [r[0][0] for r in mine] == pytest.approx([r[0][0] for r in reference], abs=2e-3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from conftest import TOKENIZER_FOLDER
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_FOLDER)
    tokenizer.eos_token = "~"  # an empty context is scored after it
    tokenizer.save_pretrained(folder)
    return str(folder)


def requests(kind, args):
    return [Instance(kind, {}, arguments, i) for i, arguments in enumerate(args)]


PAIRS = [("the quick brown fox jumps over the lazy dog " * 3, "and runs"),
         ("the quick brown fox jumps over the lazy dog " * 3, "away "),
         ("a short one", " and a longer continuation"), ("", "no context at all")]


def reference_loglikelihood(lm, context_ids, continuation_ids):
    """The stock model's log-likelihood of the continuation after the whole context."""
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([context_ids + continuation_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(context_ids) - 1:-1], -1)
    return logprobs.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()


def test_loglikelihood_of_the_full_cache_is_the_models(tiny_folder):
    lm = D2OLM(pretrained=tiny_folder, method="full", batch_size=3)
    scored = lm.loglikelihood(requests("loglikelihood", PAIRS))
    for (context, continuation), (total, _) in zip(PAIRS, scored):
        context_ids, continuation_ids = lm._pair(context, continuation)
        assert total == pytest.approx(reference_loglikelihood(lm, context_ids, continuation_ids), abs=1e-4)
    assert lm._pair("a b ", "c") == (lm.encode("a b"), lm.encode("a b c")[len(lm.encode("a b")):])  # blanks move


def test_loglikelihood_under_compression_sees_the_compressed_context_and_batches(tiny_folder):
    lm = D2OLM(pretrained=tiny_folder, method="h2o", budget="24t", min_tokens=0, batch_size=3)
    batched = lm.loglikelihood(requests("loglikelihood", PAIRS))
    lm.batch_size = 1
    alone = lm.loglikelihood(requests("loglikelihood", PAIRS))
    assert [total for total, _ in alone] == pytest.approx([total for total, _ in batched], abs=1e-4)
    assert [greedy for _, greedy in alone] == [greedy for _, greedy in batched]
    context_ids, continuation_ids = lm._pair(*PAIRS[0])
    assert len(context_ids) > 24  # the context was compressed, so the full model scores it otherwise
    assert batched[0][0] != pytest.approx(reference_loglikelihood(lm, context_ids, continuation_ids), abs=1e-3)


def test_rolling_loglikelihood_and_generation(tiny_folder):
    full = D2OLM(pretrained=tiny_folder, method="full", chunk=16)
    text = "the quick brown fox jumps over the lazy dog " * 4
    ids = full.tokenizer(text, add_special_tokens=False).input_ids
    total = full.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0]
    assert total == pytest.approx(reference_loglikelihood(full, [full.prefix_token()], ids), abs=1e-3)
    lm = D2OLM(pretrained=tiny_folder, method="d2o", budget="16t", min_tokens=0, batch_size=2)
    prompts = [context + continuation for context, continuation in PAIRS[:3]]
    answers = lm.generate_until(requests("generate_until", [(p, {"until": ["x"], "max_gen_toks": 5}) for p in prompts]))
    expected = generate(lm.model, lm.tokenizer, prompts, "d2o", "16t", max_new_tokens=5, stop=("x",),
                        min_tokens=0).texts
    assert answers == expected


def test_bad_arguments_are_named(tiny_folder):
    with pytest.raises(D2OError, match="batch_size='auto' must be a whole number"):
        D2OLM(pretrained=tiny_folder, batch_size="auto")
    with pytest.raises(D2OError, match="unknown method 'nope'"):
        D2OLM(pretrained=tiny_folder, method="nope")
    lm = D2OLM(pretrained=tiny_folder, method="full")
    with pytest.raises(D2OError, match="decodes greedily"):
        lm.generate_until(requests("generate_until", [("hi", {"do_sample": True, "temperature": 0.7})]))


def test_the_lm_eval_command_runs_lm_evals_cli_with_d2o_registered(tasks, tiny_folder, tmp_path):
    import subprocess
    import sys

    manager, _ = tasks
    include = manager.include_path[0] if isinstance(manager.include_path, list) else manager.include_path
    done = subprocess.run([sys.executable, "-m", "d2o", "lm-eval", "--model", "d2o", "--model_args",
                           f"pretrained={tiny_folder},method=h2o,budget=16t,min_tokens=0", "--tasks",
                           "d2o_local_choice", "--include_path", str(include), "--limit", "2", "--device", "cpu",
                           "--output_path", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert written["results"]["d2o_local_choice"]["acc,none"] in (0.0, 0.5, 1.0)
    assert written["config"]["model_args"]["method"] == "h2o" and written["config"]["model_args"]["budget"] == "16t"
