"""The d2o command line (thin: checks its input, calls the library, prints).

Input is checked before torch and transformers load (a bad budget or option fails at once), and
before any model loads; a ``D2OError`` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from d2o.bench import FIT_MAX_BATCH, SERVE_WORKLOADS, check_fit_generate
from d2o.budget import EVICT_EVERY, Budget, parse_budgets
from d2o.errors import D2OError
from d2o.options import (HEADS, check_kv_bits, distinct, option_texts, parse_bytes, parse_method_options, parse_options,
                         split_list)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Long-context inference under a KV-cache budget.")
bench_app = typer.Typer(no_args_is_help=True, help="Speed and memory, measured side by side in one run.")
app.add_typer(bench_app, name="bench")

BUDGET_HELP = "KV budget: a ratio of the prompt (0.2) or tokens per layer (128t)."
MODEL_HELP = "'smollm2' (default), 'gemma3-270m' (embedded models) or a local model folder."
FLOOR_HELP = "Under a ratio budget, no layer is brought below min(tokens seen, N) (default 128)."
BENCH_EVICT_HELP = ("Evict in batches: a layer runs up to k-1 tokens over its budget (benchmarks evict at every "
                    "step unless told, as the committed tables; d2o generate and serve evict every 8).")
EVICT_HELP = "Evict in batches: a layer runs up to k-1 tokens over its budget (1: evict at every step)."
CHUNK_HELP = ("Prefill the prompt N tokens at a time, compressed after each chunk: the cache never holds more than "
              "its budget and a chunk \\[default: whole].")
QUESTION_BLIND_HELP = ("With --prefill-chunk: the methods that score with the question (the prompt's last tokens) "
                       "are not shown it after each chunk (only the last chunk holds it).")
KV_BITS_HELP = ("Store kept keys and values at 8, 4 or 2 bits (per token, groups of 32 channels; the newest 32 tokens "
                "also in full precision) \\[default: none, the model's dtype].")


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    context_file: Optional[Path] = typer.Option(
        None, "--context-file", help="Compress this file's text once, then answer each --question from it."),
    question: list[str] = typer.Option([], "--question", help="A question asked of the context (repeatable)."),
    questions_file: Optional[Path] = typer.Option(
        None, "--questions-file", help="Questions asked of the context, one per line."),
    save_context: Optional[Path] = typer.Option(None, "--save-context", help="Save the compressed context here."),
    load_context: Optional[Path] = typer.Option(
        None, "--load-context", help="Answer from a saved context (its method and budget) instead of compressing."),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    method: Optional[str] = typer.Option(
        None, help="Compression method (see `d2o methods`) \\[default: d2o; d2o-novelty for a context]."),
    budget: Optional[str] = typer.Option(None, help=BUDGET_HELP + " \\[default: 0.2]"),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    evict_every: int = typer.Option(EVICT_EVERY, help=EVICT_HELP),
    kv_bits: Optional[str] = typer.Option(None, help=KV_BITS_HELP),
    prefill_chunk: Optional[int] = typer.Option(None, help=CHUNK_HELP),
    question_blind: bool = typer.Option(False, "--question-blind", help=QUESTION_BLIND_HELP),
    kv_memory: Optional[str] = typer.Option(None, help="Refuse a prompt whose KV cache would exceed this at its "
                                            "peak (the library's memory plan): 512MB, 2GiB or bytes."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    sample: bool = typer.Option(False, "--sample", help="Sample instead of greedy decoding."),
    temperature: Optional[float] = typer.Option(None, help="With --sample: the softmax temperature \\[default: 1.0]."),
    top_p: Optional[float] = typer.Option(None, help="With --sample: the nucleus \\[default: 1.0]."),
    top_k: Optional[int] = typer.Option(None, help="With --sample: draw among the k likeliest \\[default: 0, all]."),
    seed: Optional[int] = typer.Option(None, help="With --sample: the seed of the draws."),
    attention: str = typer.Option("sdpa", help="Kernel for the attention output: sdpa or eager."),
    dtype: str = typer.Option("float32", help="float32, float16 or bfloat16."),
    option: list[str] = typer.Option([], "--option", help="A method option NAME=VALUE (repeatable)."),
    layers: bool = typer.Option(False, "--layers", help="Print the per-layer cache table."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Generate under a KV budget and report what the cache held; or compress a context once and
    answer several questions from it (--context-file, --question)."""
    from d2o.data import read_text_file

    bits = check_kv_bits(kv_bits)
    if bits is not None and load_context is not None:
        raise D2OError("--kv-bits goes with compressing: a saved context keeps the bits it was saved with")
    context_mode = context_file is not None or load_context is not None
    if context_mode:
        text = check_context_input(prompt, prompt_file, context_file, question, questions_file, save_context,
                                   load_context, method, budget, min_tokens, option)
    else:
        if question or questions_file is not None or save_context is not None:
            raise D2OError("--question, --questions-file and --save-context go with --context-file "
                           "(or --load-context for the questions)")
        if (prompt is None) == (prompt_file is None):
            raise D2OError("give exactly one of --prompt and --prompt-file (or a --context-file and --question)")
        text = prompt if prompt is not None else read_text_file(prompt_file)
    parsed_budget, options = parse_budgets([budget or "0.2"], min_tokens)[0], parse_options(option)
    at_least_one(max_new_tokens=max_new_tokens, evict_every=evict_every)
    given = [name for name, value in (("--temperature", temperature), ("--top-p", top_p), ("--top-k", top_k),
                                      ("--seed", seed)) if value is not None]
    if given and not sample:  # decoding would be greedy: the options would be silently ignored
        raise D2OError(f"{', '.join(given)} apply with --sample only (without it decoding is greedy)")
    if question_blind and prefill_chunk is None:
        raise D2OError("--question-blind goes with --prefill-chunk: a prompt prefilled whole holds its question")
    if prefill_chunk is not None:
        at_least_one(prefill_chunk=prefill_chunk)
    cap = parse_bytes(kv_memory) if kv_memory is not None else None
    if sample and temperature == 0:
        raise D2OError("--sample with --temperature 0 is greedy decoding: drop --sample, or give a temperature > 0")

    sampling = dict(temperature=(1.0 if temperature is None else temperature) if sample else 0.0,
                    top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed)
    if context_mode:
        questions = list(question) + (read_questions(questions_file) if questions_file is not None else [])
        answer_context(model, dtype, attention, text, questions, method, parsed_budget, options, chat, save_context,
                       load_context, max_new_tokens, sampling, layers, as_json, evict_every, bits, prefill_chunk,
                       question_blind, cap)
        return

    from d2o.runtime.generation import generate as run
    from d2o.runtime.generation import resolve

    chosen, parsed_budget = resolve(method or "d2o", parsed_budget, **options)  # before the model loads
    net, tokenizer = load(model, dtype=dtype, attention=attention)
    result = run(net, tokenizer, text, chosen, parsed_budget, max_new_tokens=max_new_tokens, chat=chat,
                 evict_every=evict_every, kv_bits=bits, prefill_chunk=prefill_chunk,
                 question_aware=not question_blind, kv_memory=cap, **sampling)
    report = result.report
    if as_json:
        summary = report.as_dict()
        del summary["layers"]
        print(json.dumps({"text": result.texts[0], "prompt_tokens": result.prompt_tokens[0],
                          "seconds": round(result.seconds, 3), **summary,
                          "layers": [layer.as_dict() for layer in report.layers] if layers else None}))
        return
    print(result.texts[0])
    print(f"\n[{report.summary()}, {result.seconds:.1f} s]", file=sys.stderr)
    if layers:
        print(report.table(), file=sys.stderr)


def check_context_input(prompt, prompt_file, context_file, question, questions_file, save_context, load_context,
                        method, budget, min_tokens, option) -> str | None:
    """The context's text (None when a saved one is loaded), once the flags are known to agree."""
    from d2o.data import read_text_file

    if prompt is not None or prompt_file is not None:
        raise D2OError("give a --prompt (answered as it is) or a --context-file with --question, not both")
    if (context_file is None) == (load_context is None):
        raise D2OError("give one of --context-file (compress it) and --load-context (a saved one), not both")
    if load_context is not None:
        fixed = [flag for flag, value in (("--method", method), ("--budget", budget), ("--min-tokens", min_tokens),
                                          ("--option", option or None), ("--save-context", save_context))
                 if value is not None]
        if fixed:
            raise D2OError(f"{', '.join(fixed)} cannot change a saved context: it was compressed with its own "
                           f"method and budget")
        if not load_context.is_file():
            raise D2OError(f"no context file {str(load_context)!r}")
    if not question and questions_file is None and save_context is None:
        raise D2OError("a context needs a --question (or --questions-file), or --save-context to keep it")
    if save_context is not None and save_context.is_dir():
        raise D2OError(f"--save-context {str(save_context)!r} is a folder: give a file name")
    return None if context_file is None else read_text_file(context_file)


def read_questions(path: Path) -> list[str]:
    """The non-blank lines of a questions file."""
    from d2o.data import read_text_file

    questions = [line.strip() for line in read_text_file(path).splitlines() if line.strip()]
    if not questions:
        raise D2OError(f"{path} holds no question (one per line)")
    return questions


def answer_context(model, dtype, attention, text, questions, method, budget, options, chat, save_context,
                   load_context, max_new_tokens, sampling, layers, as_json, evict_every, kv_bits, prefill_chunk,
                   question_blind, cap) -> None:
    """Compress (or load) the context, save it if asked, answer the questions as one batch (a loaded
    context evicts as it was saved to)."""
    from d2o.runtime.context import DEFAULT_METHOD, check_asks_later, compress
    from d2o.runtime.context import load_context as load_saved
    from d2o.runtime.generation import resolve

    if load_context is not None and (prefill_chunk is not None or cap is not None):
        raise D2OError("--prefill-chunk and --kv-memory go with compressing: a saved context is prefilled already")
    if load_context is None:
        chosen, budget = resolve(method or DEFAULT_METHOD, budget, **options)  # before the model loads
        check_asks_later(chosen)
    net, tokenizer = load(model, dtype=dtype, attention=attention)
    if load_context is None:
        context = compress(net, tokenizer, text, method or DEFAULT_METHOD, budget, chat=chat, evict_every=evict_every,
                           kv_bits=kv_bits, prefill_chunk=prefill_chunk,
                           questions=None if question_blind else questions, kv_memory=cap, **options)
    else:
        context = load_saved(load_context, net, tokenizer)
    if save_context is not None:
        context.save(save_context)
    result = context.ask(questions, max_new_tokens, **sampling) if questions else None
    report = context.report
    if as_json:
        summary = report.as_dict()
        del summary["layers"]
        print(json.dumps({"context_tokens": len(context.ids), "prefill_seconds": round(context.prefill_seconds, 3),
                          "answers": [{"question": q, "text": t} for q, t in zip(questions, result.texts)]
                          if result else [], **summary,
                          "layers": [layer.as_dict() for layer in report.layers] if layers else None}))
        return
    for q, t in zip(questions, result.texts if result else []):
        print(f"Q: {q.strip()}\nA: {t.strip()}\n" if len(questions) > 1 else t)
    saved = f", saved to {save_context}" if save_context is not None else ""
    print(f"\n[context of {len(context.ids)} tokens: {report.summary()}{saved}]", file=sys.stderr)
    if layers:
        print(report.table(), file=sys.stderr)


@app.command()
def serve(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    method: str = typer.Option("d2o", help="The method of a request that names none (kv_method)."),
    budget: str = typer.Option("0.2", help="The budget of a request that names none (kv_budget). " + BUDGET_HELP),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    kv_memory: str = typer.Option("512MB", help="KV cache memory cap: 512MB, 2GiB or bytes."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    max_queue: int = typer.Option(64, help="Requests waiting for memory; beyond, HTTP 503."),
    max_tokens: int = typer.Option(256, help="max_tokens of a request that does not say."),
    replicas: int = typer.Option(0, help="N > 0: N replicas behind Ray Serve's proxy (pip install 'd2o\\[ray]')."),
    dtype: str = typer.Option("float32"),
    attention: str = typer.Option("sdpa"),
    device_map: Optional[str] = typer.Option(None, help="accelerate's placement (auto, cuda:1): one device."),
    prefix_cache_memory: str = typer.Option(
        "0", help="Of --kv-memory, the bytes kept for compressed prefixes (a chat's earlier turns, a shared "
                  "document), reused by the requests that begin with them; 0: none."),
    evict_every: int = typer.Option(EVICT_EVERY, help=EVICT_HELP),
    kv_bits: Optional[str] = typer.Option(None, help=KV_BITS_HELP),
    prefill_chunk: Optional[int] = typer.Option(None, help=CHUNK_HELP + " Admission counts that peak."),
    prefill_thread: bool = typer.Option(False, "--prefill-thread", help="Prefill prompts on a thread of their own "
                                        "beside the running requests' decode steps (each half the cores while both "
                                        "run), so that a long prompt does not stop their streams."),
    option: list[str] = typer.Option([], "--option", help="A method option METHOD.NAME=VALUE (repeatable), for "
                                     "every request of that method (kvzip.heads=adaptive)."),
):
    """An OpenAI-compatible server: continuous batching, admission by KV memory (see docs/guides/serving.md)."""
    from d2o.serve.config import ServeConfig

    config = ServeConfig(model=model, method=method, budget=budget, min_tokens=min_tokens,
                         kv_memory=parse_bytes(kv_memory), max_queue=max_queue, max_tokens=max_tokens, dtype=dtype,
                         attention=attention, device_map=device_map,
                         prefix_cache_memory=memory_or_none(prefix_cache_memory), evict_every=evict_every,
                         kv_bits=check_kv_bits(kv_bits), prefill_chunk=prefill_chunk, prefill_thread=prefill_thread,
                         method_options=parse_method_options(option))
    if replicas < 0:
        raise D2OError(f"replicas must be >= 0, got {replicas}")
    config.check()  # before the model loads
    check_port(host, port)
    if replicas:
        from d2o.serve.ray_serve import run_replicas

        run_replicas(config, replicas, host, port)
    else:
        from d2o.serve.app import run

        run(config, host, port)


def check_port(host: str, port: int) -> None:
    """Refuse a port out of range, or one another process listens on, before the model loads."""
    if not 1 <= port <= 65535:
        raise D2OError(f"port {port} must be in 1..65535")
    if not host.strip():  # an unset shell variable, most likely: it would listen on every interface
        raise D2OError("--host is empty: give 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise D2OError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


@app.command()
def methods(every: bool = typer.Option(False, "--all", help="Also the ablations (a part removed or swapped).")):
    """List the compression methods (with --all, their ablations too)."""
    from d2o.methods import REGISTRY

    shown = {name: entry for name, entry in REGISTRY.items() if every or not entry.ablation}
    width = max(len(name) for name in shown)
    for name, entry in shown.items():
        print(f"{name:<{width}}  {entry.summary}")
    if not every:
        print(f"\n{len(REGISTRY) - len(shown)} ablations more: d2o methods --all")


@app.command()
def demo(model: str = typer.Option("smollm2", help=MODEL_HELP), length: int = typer.Option(1500),
         seed: int = typer.Option(0)):
    """Passkey retrieval at ~1,500 tokens: the full cache against d2o and d2o-plus at 20% and 50%."""
    from d2o.demo import run_demo

    quiet()
    run_demo(model, length, seed)


@app.command("eval")
def evaluate(
    task: str = typer.Option(..., help="Task (see `d2o tasks`)."),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    methods: str = typer.Option("full,h2o,snapkv,pyramidkv,streamingllm,d2o", help="Comma-separated methods."),
    budgets: str = typer.Option("0.1,0.2,0.5", help="Comma-separated budgets (ratios, or 128t)."),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    limit: Optional[int] = typer.Option(None, help="Samples (per dataset / per NIAH cell)."),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("out/eval"), help="Results folder (a rerun resumes there)."),
    separate_prefill: bool = typer.Option(False, "--separate-prefill", help="Prefill once per method and budget."),
    dtype: str = typer.Option("float32"),
    attention: str = typer.Option("sdpa"),
    protocol: str = typer.Option("prompt", help="prompt: compress the whole prompt; context: compress the "
                                 "context, then feed the question (tasks with a question)."),
    task_option: list[str] = typer.Option([], "--task-option",
                                          help="A task option NAME=VALUE (repeatable; `d2o tasks` lists them)."),
    option: list[str] = typer.Option([], "--option", help="A method option METHOD.NAME=VALUE (repeatable)."),
    evict_every: int = typer.Option(1, help="Evict in batches: a layer runs up to k-1 tokens over its budget "
                                    "(the methods evict at every step, as their papers, unless told)."),
    kv_bits: Optional[str] = typer.Option(None, help=KV_BITS_HELP),
    prefill_chunk: Optional[int] = typer.Option(None, help=CHUNK_HELP + " Each run prefills its own prompt."),
    question_blind: bool = typer.Option(False, "--question-blind", help=QUESTION_BLIND_HELP),
    ray: Optional[str] = typer.Option(None, help="Spread the samples over Ray workers: local (a private Ray "
                                      "on this machine), auto (the cluster this machine is in) or an address."),
    workers: int = typer.Option(2, help="Ray workers, one model each (one GPU each on a cluster with enough)."),
):
    """Evaluate methods x budgets on a task; writes samples.jsonl, summary.csv/.md and plots to OUT."""
    from d2o.eval.sweep import EvalConfig, check_config, run_eval

    config = EvalConfig(
        task=task, model=model, methods=split_list(methods), budgets=split_list(budgets), limit=limit, seed=seed,
        out=str(out), shared_prefill=not separate_prefill, dtype=dtype, attention=attention, min_tokens=min_tokens,
        protocol=protocol, evict_every=evict_every, kv_bits=check_kv_bits(kv_bits), prefill_chunk=prefill_chunk,
        question_aware=not question_blind, ray=ray, workers=workers,
        task_options=option_texts(task_option, "--task-option"),  # typed by the task
        method_options=parse_method_options(option),
    )
    check_config(config)  # before torch loads
    quiet()
    rows = run_eval(config)
    print((out / "summary.md").read_text())
    print(f"[{len(rows)} rows; files in {out}]", file=sys.stderr)


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                         "help_option_names": []})
def lm_eval(context: typer.Context):
    """lm-evaluation-harness's command line with the model `d2o` registered: `d2o lm-eval --model d2o
    --model_args pretrained=smollm2,method=d2o-plus,budget=0.2 --tasks TASKS` (every argument is lm-eval's)."""
    try:
        import lm_eval.__main__
    except ImportError:
        raise D2OError("d2o lm-eval needs lm-evaluation-harness: pip install 'd2o[lmeval]'") from None
    import d2o.eval.harness  # noqa: F401  (registers the model)

    quiet()
    sys.argv = ["lm-eval", *context.args]
    lm_eval.__main__.cli_evaluate()


@app.command()
def compare(
    results: list[Path] = typer.Argument(..., help="Folders d2o eval wrote (--out); those of one task, protocol "
                                         "and model are also pooled."),
    method: str = typer.Option(..., help="The method compared."),
    against: str = typer.Option(..., help="The method it is compared against (full: the full cache)."),
    against_results: list[Path] = typer.Option(
        [], "--against-results", help="Read --against from these folders, one per RESULTS folder, of the same samples "
        "(the same method run another way: --prefill-chunk, --kv-bits)."),
    confidence: float = typer.Option(0.95, help="The interval's coverage."),
    resamples: int = typer.Option(10_000, help="Bootstrap draws."),
    seed: int = typer.Option(0, help="The bootstrap's seed."),
):
    """Paired differences of two methods per budget, with a bootstrap interval: is a gap more than noise?"""
    from d2o.eval.compare import compare as run_compare
    from d2o.eval.compare import markdown

    comparisons = run_compare(results, method, against, resamples, confidence, seed, against_results or None)
    if against_results:  # the same name, perhaps: say which run each is
        method = f"{method} ({', '.join(dict.fromkeys(path.name for path in results))})"
        against = f"{against} ({', '.join(dict.fromkeys(path.name for path in against_results))})"
    print(markdown(comparisons, method, against, confidence), end="")


@app.command()
def frontier(
    results: list[Path] = typer.Argument(..., help="Folders d2o eval wrote (--out), e.g. one per --kv-bits."),
    plot: Optional[Path] = typer.Option(None, help="Also draw score against KV memory into this PNG."),
):
    """Score against KV memory (share of the full cache's bytes) of every method, bits and budget:
    tokens kept and bits per token compared at equal memory."""
    from d2o.eval.frontier import frontier as run_frontier
    from d2o.eval.frontier import markdown
    from d2o.eval.frontier import plot as draw

    rows = run_frontier(results)
    print(markdown(rows), end="")
    if plot is not None:
        draw(rows, plot)


@app.command()
def tasks():
    """List the evaluation tasks and their options."""
    from dataclasses import fields

    from d2o.eval.tasks import TASKS

    width = max(len(name) for name in TASKS)
    for name, cls in TASKS.items():
        options = ", ".join(f"{f.name}={f.default!r}" for f in fields(cls))
        print(f"{name:<{width}}  {cls.summary}\n{'':<{width}}  options: {options or 'none'}")


def at_least_one(**values) -> None:
    """Each value (a count, or a list of them) at least 1, and no list empty: else one line naming it."""
    for name, value in values.items():
        items = value if isinstance(value, tuple) else (value,)
        if not items:
            raise D2OError(f"no {name} given")
        bad = [item for item in items if item < 1]
        if bad:
            raise D2OError(f"{name} must be at least 1, got {bad[0]}")


def check_out(out: Path, folder: bool = True) -> None:
    """Refuse a results path that cannot be written before the run, not after it: a folder that is a
    file, a file that is a folder, either under a file, or a folder that cannot be created (it is
    created now, as ``eval`` creates its own)."""
    what = "folder" if folder else "file"
    if out.exists() and out.is_dir() != folder:
        raise D2OError(f"results {what} {str(out)!r} is a {'file' if folder else 'folder'}")
    above = next((parent for parent in out.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise D2OError(f"results {what} {str(out)!r} would lie under {str(above)!r}, which is a file")
    try:
        (out if folder else out.parent).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise D2OError(f"cannot create the results {what} {str(out)!r}: {error.strerror or error}") from None


def check_shape(model: str, shape: str | None, positions: int | None) -> None:
    """Refuse options a benchmark's model would silently ignore."""
    if shape is None and positions is not None:
        raise D2OError("--positions goes with --shape (a real model has its own positions)")
    if shape is not None and model != "smollm2":
        raise D2OError(f"give --model or --shape, not both (--model {model} --shape {shape})")
    if positions is not None and positions < 1:
        raise D2OError(f"positions must be at least 1, got {positions}")


def check_device(device: str | None) -> None:
    if device is not None and device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise D2OError(f"device {device!r}: cpu or cuda (cuda:N for another GPU)")


MODEL = typer.Option("smollm2", help=MODEL_HELP)
SHAPE = typer.Option(None, help="Random weights of a shape instead of --model: smollm2, llama-3-8b, tiny.")
POSITIONS = typer.Option(None, help="With --shape: the model's positions (default: as many as the run needs).")
DEVICE = typer.Option(None, help="cpu or cuda (default: cpu).")
DTYPE = typer.Option("float32", help="float32, float16 or bfloat16.")
OUT = typer.Option(Path("out/bench"), help="Folder for the results: Markdown, JSON and PNG.")
METHODS_HELP = "Comma-separated methods; full is transformers' own cache and attention."


def bench_model(model: str, shape: str | None, positions: int, dtype: str, device: str | None,
                methods: tuple[str, ...], budget: Budget):
    """The model of a benchmark and its tokenizer (None for random weights), once the methods, the
    budget and the shape are known to be good."""
    from d2o.bench.models import SHAPES
    from d2o.methods import get_method

    if not methods:
        raise D2OError("no methods given")
    for name in methods:
        if name != "full":
            get_method(name).check_budget(budget)
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise D2OError(f"device {device!r}: torch sees no CUDA device here")
    if shape is not None and shape not in SHAPES:
        raise D2OError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    if shape is not None:
        from d2o.bench.models import random_model

        return random_model(shape, positions, dtype, device), None
    return load(model, dtype=dtype, device=device)


@bench_app.command("decode")
def bench_decode(
    methods: str = typer.Option("full,h2o,snapkv,streamingllm,d2o", help=METHODS_HELP),
    budget: str = typer.Option("0.2", help=BUDGET_HELP),
    lengths: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    batch: str = typer.Option("1", help="Comma-separated batch sizes."),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    steps: int = typer.Option(32, help="Decode steps timed per run."),
    repeats: int = typer.Option(1, help="Runs of --steps steps. Reported: each run's mean step over windows of as "
                                "many steps as the least common multiple of --evict-every (evictions included), "
                                "the median over all windows."),
    evict_every: str = typer.Option("1", help="Comma-separated: evict in batches of k decode steps, each k a run "
                                    "(1: at every step, the committed tables; d2o generate and serve evict every 8)."),
    kv_bits: str = typer.Option("none", help="Comma-separated: store the compressed caches' keys and values at "
                                "8, 4 or 2 bits, each a run (none: the model's dtype)."),
    budget_sized_full: bool = typer.Option(False, help="Also the full cache over the prompt's last tokens, as many "
                                           "as the budget keeps: the least a step costs with a cache of that size."),
    heads: str = typer.Option("even", help="Comma-separated: even, adaptive (each KV head its own count: the methods "
                              "that take it), each a run."),
    model: str = MODEL, shape: Optional[str] = SHAPE, positions: Optional[int] = POSITIONS,
    dtype: str = DTYPE, device: Optional[str] = DEVICE, out: Path = OUT,
):
    """ms per decode step, tokens/s, KV bytes and tensor operations per step of each method against
    the full cache, per context and batch."""
    names, parsed, sizes = (distinct(split_list(methods), "methods"), parse_budgets([budget], min_tokens)[0],
                            split_list(lengths, int))
    batches, every = split_list(batch, int), distinct(tuple(split_list(evict_every, int)), "evict-every values")
    at_least_one(lengths=sizes, batch=batches, steps=steps, repeats=repeats, evict_every=every)
    widths = kv_bits_list(kv_bits)
    ways = distinct(tuple(split_list(heads)), "heads values")
    check_heads(ways)
    check_device(device)
    check_shape(model, shape, positions)
    check_out(out)

    from d2o.bench import plots
    from d2o.bench.decode import bench_decode as run
    from d2o.bench.output import emit

    net, tokenizer = bench_model(model, shape, positions or max(sizes) + steps + 1, dtype, device, names, parsed)
    rows = run(net, tokenizer, names, sizes, batches, parsed, steps, repeats, evict_every=every, kv_bits=widths,
               budget_sized_full=budget_sized_full, heads=ways)
    setting = dict(model=shape or model, dtype=dtype, budget=str(parsed), min_tokens=parsed.min_tokens, steps=steps,
                   repeats=repeats, evict_every=list(every), kv_bits=list(widths), budget_sized_full=budget_sized_full,
                   heads=list(ways))
    window = math.lcm(*every)
    emit(rows, f"Decoding: {shape or model}, {dtype}, budget {parsed.described}, {repeats} x {steps} steps, median of "
         f"the mean step per {window} step{'s' * (window > 1)}", "decode", out, setting)
    plots.decode_plots(rows, out)


@bench_app.command("fit")
def bench_fit(
    kv_memory: str = typer.Option(..., help="The KV cache memory cap, e.g. 256MB or 1GiB."),
    prompt: int = typer.Option(2048, help="Prompt tokens per sequence."),
    generate: int = typer.Option(512, help="Tokens generated per sequence."),
    methods: str = typer.Option("full,h2o,d2o", help=METHODS_HELP),
    budget: str = typer.Option("0.2", help=BUDGET_HELP),
    max_batch: int = typer.Option(FIT_MAX_BATCH, help="No batch grows past this many rows, whatever the cap holds."),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    evict_every: int = typer.Option(1, help=BENCH_EVICT_HELP),
    kv_bits: str = typer.Option("none", help="Comma-separated: the compressed methods also with keys and values "
                                "at 8, 4 or 2 bits, each a row (none: the model's dtype only)."),
    prefill_chunk: Optional[int] = typer.Option(None, help=CHUNK_HELP + " The compressed methods only."),
    model: str = MODEL, shape: Optional[str] = SHAPE, positions: Optional[int] = POSITIONS,
    dtype: str = DTYPE, device: Optional[str] = DEVICE, out: Path = OUT,
):
    """The largest batch each method fits under a KV memory cap, and the tokens/s it reaches there."""

    cap, names, parsed = (parse_bytes(kv_memory), distinct(split_list(methods), "methods"),
                          parse_budgets([budget], min_tokens)[0])
    at_least_one(prompt=prompt, max_batch=max_batch, evict_every=evict_every,
                 **({} if prefill_chunk is None else dict(prefill_chunk=prefill_chunk)))
    widths = kv_bits_list(kv_bits)
    check_fit_generate(generate)
    check_device(device)
    check_shape(model, shape, positions)
    check_out(out)

    from d2o.bench import plots
    from d2o.bench.fit import bench_fit as run
    from d2o.bench.output import emit

    net, tokenizer = bench_model(model, shape, positions or prompt + generate + 1, dtype, device, names, parsed)
    rows = run(net, tokenizer, cap, prompt, generate, names, parsed, next(net.parameters()).element_size(), max_batch,
               evict_every, widths, prefill_chunk)
    stopped = [row["method"] for row in rows if row["batch"] == max_batch]
    if stopped:  # not the cap's measure: said, so that the ratios are not read as the cap's
        typer.echo(f"{', '.join(stopped)}: the batch reached --max-batch {max_batch} rows before the KV cap "
                   f"(the cap may hold more)", err=True)
    setting = dict(model=shape or model, dtype=dtype, kv_memory=cap, prompt=prompt, generate=generate,
                   budget=str(parsed), min_tokens=parsed.min_tokens, max_batch=max_batch, prefill_chunk=prefill_chunk)
    emit(rows, f"Throughput under {kv_memory} of KV cache: {shape or model}, {prompt} + {generate} tokens, budget "
         f"{parsed.described}", "fit", out, setting)
    plots.bars(rows, "decode_tokens_per_s", "decode tokens/s", f"tokens/s under {kv_memory} of KV cache",
               out / "fit.png")


@bench_app.command("prefill")
def bench_prefill(
    lengths: str = typer.Option("1024,2048,4096", help="Comma-separated prompt lengths in tokens."),
    methods: str = typer.Option("d2o", help="Comma-separated methods, timed in turn with plain SDPA."),
    budget: str = typer.Option("0.2", help=BUDGET_HELP),
    repeats: int = typer.Option(1, help="Alternating repeats per length (median reported)."),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    eager: bool = typer.Option(False, "--eager", help="Also time transformers' eager attention."),
    chunks: str = typer.Option("", help="Comma-separated chunk sizes: each method also prefills in chunks of each "
                               "(--prefill-chunk), beside its prompt prefilled whole."),
    model: str = MODEL, shape: Optional[str] = SHAPE, positions: Optional[int] = POSITIONS,
    dtype: str = DTYPE, device: Optional[str] = DEVICE, out: Path = OUT,
):
    """Prefill time of each method over plain SDPA, and the peak memory of each against the S x S matrix."""
    parsed, sizes = parse_budgets([budget], min_tokens)[0], split_list(lengths, int)
    names = distinct(split_list(methods), "methods")
    chunk_sizes = tuple(distinct(split_list(chunks, int), "chunks"))
    at_least_one(lengths=sizes, repeats=repeats, **(dict(chunks=chunk_sizes) if chunk_sizes else {}))
    if "full" in names:
        raise D2OError("full is the stock prefill: plain SDPA is timed in every run already")
    check_device(device)
    check_shape(model, shape, positions)
    check_out(out)

    from d2o.bench import plots
    from d2o.bench.output import emit
    from d2o.bench.prefill import bench_prefill as run

    net, tokenizer = bench_model(model, shape, positions or max(sizes), dtype, device, tuple(names), parsed)
    rows = run(net, tokenizer, sizes, names, parsed, repeats, eager, chunk_sizes)
    setting = dict(model=shape or model, dtype=dtype, methods=names, budget=str(parsed), min_tokens=parsed.min_tokens,
                   repeats=repeats, chunks=chunk_sizes)
    emit(rows, f"Prefill: {shape or model}, {dtype}, {', '.join(names)} at {parsed.described} against SDPA", "prefill",
         out, setting)
    plots.prefill_plot(rows, [*names, *(f"{name}@{chunk}" for name in names for chunk in chunk_sizes)], out)


@bench_app.command("throughput")
def bench_throughput(
    decode: Path = typer.Option(..., help="The decode.json of a `d2o bench decode` run covering the contexts."),
    prompt: int = typer.Option(2048, help="Prompt tokens."),
    generate: int = typer.Option(8192, help="Tokens generated."),
    out: Path = OUT,
):
    """Tokens/s of a long generation, integrated from decode steps measured at several contexts."""
    at_least_one(prompt=prompt, generate=generate)
    check_out(out)

    from d2o.bench import plots
    from d2o.bench.output import emit
    from d2o.bench.throughput import integrate

    if not decode.is_file():
        raise D2OError(f"decode results {str(decode)!r} not found: run `d2o bench decode --out DIR` first")
    try:
        measured = json.loads(decode.read_text())["rows"]
    except (ValueError, KeyError, TypeError) as error:
        raise D2OError(f"{str(decode)!r} is not the decode.json of `d2o bench decode` ({error!r})") from None
    rows = integrate(measured, prompt, generate)
    emit(rows, f"Throughput of {prompt} + {generate} tokens", "throughput", out, dict(prompt=prompt, generate=generate))
    plots.bars(rows, "tokens_per_s", "tokens/s", f"{prompt} + {generate} tokens", out / "throughput.png")


@bench_app.command("serve")
def bench_serve(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    methods: str = typer.Option("full,d2o", help="Comma-separated methods, each served under the same cap."),
    budget: str = typer.Option("0.2", help=BUDGET_HELP),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    kv_memory: str = typer.Option("128MB", help="The KV memory cap of every server: 512MB, 2GiB or bytes."),
    clients: int = typer.Option(8, help="Concurrent clients."),
    requests: int = typer.Option(16, help="Requests in all (each client sends its next when one ends)."),
    prompt_tokens: int = typer.Option(1000, help="Tokens per prompt (different stretches of the essays)."),
    max_tokens: int = typer.Option(64, help="max_tokens of every request."),
    workload: str = typer.Option(
        "prompts", help="prompts (different texts), documents (--documents x --questions each, concurrent), "
                        "chat (one conversation per document, its questions in turns) or mixed (short prompts "
                        "streaming while every fourth request brings --prompt-tokens)."),
    documents: int = typer.Option(4, help="documents and chat: the documents (NIAH haystacks of --prompt-tokens)."),
    questions: int = typer.Option(8, help="documents and chat: questions per document (its needles, 1 to 8)."),
    prefix_cache: str = typer.Option(
        "0", help="Comma-separated --prefix-cache-memory sizes, each run in turn (0: none), e.g. 0,32MB."),
    evict_every: int = typer.Option(1, help=BENCH_EVICT_HELP),
    prefill_chunk: str = typer.Option("0", help="Comma-separated --prefill-chunk sizes, each run in turn (0: whole), "
                                      "e.g. 0,512."),
    prefix_sharing: str = typer.Option("in-place", help="With a prefix cache: requests read a kept document "
                                       "in-place, or each holds a copy (copied); in-place,copied runs both."),
    heads: str = typer.Option("even", help="Comma-separated: even, adaptive (each KV head its own count: the methods "
                              "that take it, served with --option METHOD.heads=adaptive)."),
    prefill_thread: str = typer.Option("off", help="Comma-separated: off (a round prefills, then decodes), on (d2o "
                                       "serve --prefill-thread: prompts prefilled on a thread of their own); off,on "
                                       "runs both."),
    out: Optional[Path] = typer.Option(None, help="Write the rows as JSON to this file."),
):
    """Requests/s, tokens/s, latency and time to first token of a server per method, same KV memory."""
    cap, names, parsed = (parse_bytes(kv_memory), distinct(split_list(methods), "methods"),
                          parse_budgets([budget], min_tokens)[0])
    if min(clients, requests, prompt_tokens, max_tokens, documents, evict_every) < 1:
        raise D2OError("clients, requests, prompt-tokens, max-tokens, documents and evict-every must be at least 1")
    if workload not in SERVE_WORKLOADS:
        raise D2OError(f"workload {workload!r} must be one of {', '.join(SERVE_WORKLOADS)}")
    if not 1 <= questions <= 8:
        raise D2OError(f"questions={questions} must be from 1 to 8 (the built-in needles)")
    prefix_sizes = tuple(memory_or_none(size) for size in split_list(prefix_cache))
    chunks = distinct(split_list(prefill_chunk, int), "prefill-chunk sizes")
    if not chunks or min(chunks) < 0:
        raise D2OError(f"--prefill-chunk {prefill_chunk!r}: chunk sizes >= 1, or 0 for a prefill whole")
    chunks = tuple(chunk or None for chunk in chunks)
    sharing = distinct(split_list(prefix_sharing), "prefix-sharing values")
    if not sharing or not set(sharing) <= {"in-place", "copied"}:
        raise D2OError(f"--prefix-sharing {prefix_sharing!r}: in-place, copied, or both (comma-separated)")
    if any(size >= cap for size in prefix_sizes):
        raise D2OError(f"a --prefix-cache size is part of --kv-memory ({cap:,} bytes) and must be smaller")
    if not names:
        raise D2OError("no methods given")
    ways = distinct(tuple(split_list(heads)), "heads values")
    check_heads(ways)
    threads = distinct(split_list(prefill_thread), "prefill-thread values")
    if not threads or not set(threads) <= {"off", "on"}:
        raise D2OError(f"--prefill-thread {prefill_thread!r}: off, on, or both (comma-separated)")
    if out is not None:
        check_out(out, folder=False)

    from d2o.runtime.generation import resolve

    chosen = [resolve(name, parsed) for name in names]

    from d2o.bench.serve import bench_serve as run
    from d2o.bench.serve import markdown
    from d2o.runtime.memory import plan
    from d2o.runtime.prompts import check_length

    net, tokenizer = load(model)
    check_length(net, prompt_tokens, max_tokens)  # else every request is refused, and the table is NaN
    for (name, (method, method_budget)), chunk in [(named, chunk) for named in zip(names, chosen) for chunk in chunks]:
        need = plan(net.config, method, method_budget, prompt_tokens, max_tokens,
                    next(net.parameters()).element_size(), evict_every=evict_every, prefill_chunk=chunk,
                    question=bool(method.question_tokens)).peak_bytes
        if need > cap:
            raise D2OError(f"--kv-memory {kv_memory} holds not one {prompt_tokens} + {max_tokens}-token request "
                           f"under {name}{f' in chunks of {chunk}' if chunk else ''} (it needs {need:,} bytes)")
    rows = run(net, tokenizer, [(name, budget) for name in names], cap, clients, requests, prompt_tokens, max_tokens,
               min_tokens, workload, documents, questions, prefix_sizes, evict_every, chunks,
               tuple(value == "in-place" for value in sharing), ways, tuple(value == "on" for value in threads))
    print(markdown(rows))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")


@bench_app.command("ask")
def bench_ask(
    methods: str = typer.Option("d2o-novelty,kvzip,d2o,h2o", help=METHODS_HELP),
    budget: str = typer.Option("0.2", help=BUDGET_HELP),
    length: int = typer.Option(1500, help="Tokens of the document (NIAH's haystack)."),
    questions: int = typer.Option(8, help="Needles in the document, each asked by a row of the batch (1-8)."),
    max_tokens: int = typer.Option(16, help="Tokens generated per answer."),
    min_tokens: Optional[int] = typer.Option(None, help=FLOOR_HELP),
    server: bool = typer.Option(False, "--server", help="Also send the questions at once to a d2o serve on the "
                                "kept document and read its /metrics KV gauge while they run."),
    heads: str = typer.Option("even", help="Comma-separated: even, adaptive (each KV head its own count: the methods "
                              "that take it), each a row."),
    model: str = MODEL, dtype: str = DTYPE, device: Optional[str] = DEVICE, out: Path = OUT,
):
    """KV bytes and decode time of many questions on one compressed document, answered as one batch:
    its keys and values read in place by every row (shared) against copied into each."""
    names, parsed = distinct(split_list(methods), "methods"), parse_budgets([budget], min_tokens)[0]
    at_least_one(length=length, questions=questions, max_tokens=max_tokens)
    if questions > 8:
        raise D2OError(f"--questions {questions}: NIAH has 8 needles")
    if "full" in names:
        raise D2OError("--methods: 'full' compresses nothing; name methods that do")
    ways = distinct(tuple(split_list(heads)), "heads values")
    check_heads(ways)
    check_device(device)
    check_out(out)

    from d2o.bench.ask import bench_ask as run
    from d2o.bench.output import emit

    net, tokenizer = bench_model(model, None, 0, dtype, device, names, parsed)
    rows = run(net, tokenizer, list(names), parsed, length, questions, max_tokens, server, ways)
    setting = dict(model=model, dtype=dtype, budget=str(parsed), length=length, questions=questions,
                   max_tokens=max_tokens, server=server, heads=list(ways))
    emit(rows, f"{questions} questions on one compressed document of {length} tokens: {model}, budget "
         f"{parsed.described}", "ask", out, setting)


@bench_app.command("soak")
def bench_soak(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    requests: int = typer.Option(500, help="Requests in all: chats, streams, questions on documents, cancellations "
                                           "and bad requests, drawn by --seed."),
    clients: int = typer.Option(16, help="Concurrent clients."),
    kv_memory: str = typer.Option("64MB", help="The server's KV memory cap: 512MB, 2GiB or bytes."),
    prefix_cache_memory: str = typer.Option("16MB", help="Of --kv-memory, for kept compressed documents."),
    prefill_chunk: int = typer.Option(256, help="The server prefills prompts this many tokens at a time (0: whole)."),
    prefill_thread: bool = typer.Option(False, "--prefill-thread", help="The server prefills on a thread of its "
                                        "own (d2o serve --prefill-thread)."),
    max_tokens: int = typer.Option(8, help="max_tokens of every answered request."),
    seed: int = typer.Option(0, help="Draws the requests."),
    timeout: float = typer.Option(300.0, help="Seconds a request may take before it counts as hung."),
    out: Optional[Path] = typer.Option(None, help="Write the report as JSON to this file."),
):
    """A live server under many mixed requests: no 5xx, no hang, KV bytes never above the cap, idle
    again at the end, every greedy answer the library's. Exit code 1 when a check fails."""
    if min(requests, clients, max_tokens) < 1 or prefill_chunk < 0 or not timeout > 0:
        raise D2OError("requests, clients and max-tokens must be at least 1, prefill-chunk >= 0, timeout > 0")
    if out is not None:
        check_out(out, folder=False)

    from d2o.bench.soak import soak, soak_config

    config = soak_config(model, requests, parse_bytes(kv_memory), memory_or_none(prefix_cache_memory),
                         prefill_chunk or None, prefill_thread)  # its options checked before the model loads
    net, tokenizer = load(model)
    report = soak(net, tokenizer, config, requests, clients, max_tokens, seed, timeout)
    print(json.dumps(report, indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if not report["ok"]:
        raise typer.Exit(1)


def check_heads(ways: tuple[str, ...]) -> None:
    for way in ways:
        if way not in HEADS:
            raise D2OError(f"--heads {way!r} must be one of {', '.join(HEADS)}")


def kv_bits_list(text: str) -> tuple[int | None, ...]:
    """A bench's comma-separated ``--kv-bits`` (none: the model's dtype), each given once."""
    return distinct(tuple(check_kv_bits(bits) for bits in split_list(text)), "kv-bits values")


def memory_or_none(text: str) -> int:
    """A memory size, or 0 for none."""
    return 0 if text.strip() == "0" else parse_bytes(text)


def quiet() -> None:
    """No progress bars of transformers on the terminal (an error stays one line)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load(model: str, **options):
    """``d2o.load_model``, quietly."""
    from d2o.models import load_model

    quiet()
    return load_model(model, **options)


def main() -> None:
    """Entry point: a D2OError becomes one line on stderr and exit code 2."""
    try:
        app()
    except D2OError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
