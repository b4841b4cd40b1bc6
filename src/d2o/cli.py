"""The d2o command line (thin: parses options, calls the library, prints)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from d2o.errors import D2OError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Long-context inference under a KV-cache budget.")
bench_app = typer.Typer(no_args_is_help=True, help="Speed and memory, measured side by side in one run.")
app.add_typer(bench_app, name="bench")


def parse_options(pairs: list[str]) -> dict:
    """``--option split=3:1 --option alpha=0.3`` -> {"split": (3, 1), "alpha": 0.3}."""
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise D2OError(f"--option {pair!r}: expected NAME=VALUE")
        options[name.strip().replace("-", "_")] = parse_value(text.strip())
    return options


def parse_value(text: str):
    if ":" in text or "," in text:
        return tuple(parse_value(part) for part in text.replace(":", ",").split(",") if part)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    model: str = typer.Option("smollm2", help="'smollm2' (embedded) or a local model folder."),
    method: str = typer.Option("d2o", help="Compression method (see `d2o methods`)."),
    budget: str = typer.Option("0.2", help="KV budget: a ratio of the prompt (0.2) or tokens per layer (128t)."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    sample: bool = typer.Option(False, "--sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(1.0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    attention: str = typer.Option("sdpa", help="Kernel for the attention output: sdpa or eager."),
    dtype: str = typer.Option("float32", help="float32, float16 or bfloat16."),
    option: list[str] = typer.Option([], "--option", help="A method option NAME=VALUE (repeatable)."),
    layers: bool = typer.Option(False, "--layers", help="Print the per-layer cache table."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Generate under a KV budget and report what the cache held."""
    from d2o.data import read_text_file
    from d2o.generation import generate as run
    from d2o.methods import get_method
    from d2o.models import load_model

    if (prompt is None) == (prompt_file is None):
        raise D2OError("give exactly one of --prompt and --prompt-file")
    text = prompt if prompt is not None else read_text_file(prompt_file)
    chosen = get_method(method, **parse_options(option))  # bad method or option: fail before loading
    net, tokenizer = load_model(model, dtype=dtype, attention=attention)
    result = run(net, tokenizer, text, chosen, budget, max_new_tokens=max_new_tokens, chat=chat,
                 do_sample=sample, temperature=temperature, top_p=top_p, seed=seed)
    report = result.report
    if as_json:
        summary = report.as_dict()
        del summary["layers"]
        print(json.dumps({"text": result.texts[0], "prompt_tokens": result.prompt_tokens[0],
                          "seconds": round(result.seconds, 3), **summary,
                          "layers": [layer.as_dict() for layer in report.layers] if layers else None}))
        return
    print(result.texts[0])
    print(f"\n[{method} at {report.budget}: {report.kv_tokens_kept} of {report.kv_tokens_full} KV tokens, "
          f"{report.kv_bytes / 2**20:.2f} of {report.kv_bytes_full / 2**20:.2f} MiB, {result.seconds:.1f} s]",
          file=sys.stderr)
    if layers:
        print(report.table(), file=sys.stderr)


@app.command()
def methods():
    """List the compression methods."""
    from d2o.methods import REGISTRY

    width = max(len(name) for name in REGISTRY)
    for name, entry in REGISTRY.items():
        print(f"{name:<{width}}  {entry.summary}")


@app.command()
def demo(model: str = typer.Option("smollm2"), length: int = typer.Option(1500), seed: int = typer.Option(0)):
    """Passkey retrieval at ~1,500 tokens: full cache against D2O at 20% and 50%."""
    from d2o.demo import run_demo

    run_demo(model, length, seed)


@app.command("eval")
def evaluate(
    task: str = typer.Option(..., help="Task (see `d2o tasks`)."),
    model: str = typer.Option("smollm2"),
    methods: str = typer.Option("full,h2o,snapkv,pyramidkv,streamingllm,d2o", help="Comma-separated methods."),
    budgets: str = typer.Option("0.1,0.2,0.5", help="Comma-separated budgets (ratios, or 128t)."),
    limit: Optional[int] = typer.Option(None, help="Samples (per dataset / per NIAH cell)."),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("out/eval"), help="Results folder (a rerun resumes there)."),
    separate_prefill: bool = typer.Option(False, "--separate-prefill", help="Prefill once per method and budget."),
    dtype: str = typer.Option("float32"),
    attention: str = typer.Option("sdpa"),
    length: Optional[int] = typer.Option(None, help="passkey/squad/coqa/perplexity: prompt or text tokens."),
    lengths: Optional[str] = typer.Option(None, help="niah: haystack lengths, e.g. 500,1000,2000."),
    depths: Optional[str] = typer.Option(None, help="niah: needle depths in [0, 1], e.g. 0,0.25,0.5,0.75,1."),
    haystack: Optional[Path] = typer.Option(None, help="passkey/niah: a text file as filler."),
    needle: Optional[str] = typer.Option(None), question: Optional[str] = typer.Option(None),
    answer_prefix: Optional[str] = typer.Option(None), fact: Optional[str] = typer.Option(None),
    text: Optional[Path] = typer.Option(None, help="perplexity: a text file instead of the essays."),
    chunk: Optional[int] = typer.Option(None, help="perplexity: tokens fed per forward pass."),
    data_dir: Optional[Path] = typer.Option(None, help="longbench: folder of {dataset}.jsonl files."),
    datasets: Optional[str] = typer.Option(None, help="longbench: comma-separated datasets."),
    max_length: Optional[int] = typer.Option(None, help="longbench: prompt tokens after truncation."),
    shots: Optional[int] = typer.Option(None, help="gsm8k: worked examples."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="squad/coqa: use the chat template."),
    option: list[str] = typer.Option([], "--option", help="A method option METHOD.NAME=VALUE (repeatable)."),
):
    """Evaluate methods x budgets on a task; writes samples.jsonl, summary.csv/.md and plots to OUT."""
    from d2o.eval.sweep import EvalConfig, run_eval

    task_options = dict(
        length=length, lengths=split_list(lengths, int), depths=split_list(depths, float),
        haystack=str(haystack) if haystack else None, needle=needle, question=question,
        answer_prefix=answer_prefix, fact=fact, text=str(text) if text else None, chunk=chunk,
        data_dir=str(data_dir) if data_dir else None, datasets=split_list(datasets), max_length=max_length,
        shots=shots, chat=chat,
    )
    method_options: dict = {}
    for pair in option:
        target, dot, rest = pair.partition(".")
        if not dot:
            raise D2OError(f"--option {pair!r}: expected METHOD.NAME=VALUE")
        method_options.setdefault(target, {}).update(parse_options([rest]))
    config = EvalConfig(
        task=task, model=model, methods=split_list(methods), budgets=split_list(budgets), limit=limit, seed=seed,
        out=str(out),
        shared_prefill=not separate_prefill, dtype=dtype, attention=attention,
        task_options={k: v for k, v in task_options.items() if v is not None}, method_options=method_options,
    )
    rows = run_eval(config)
    print((out / "summary.md").read_text())
    print(f"[{len(rows)} rows; files in {out}]", file=sys.stderr)


@app.command()
def tasks():
    """List the evaluation tasks."""
    from d2o.eval.tasks import TASKS

    width = max(len(name) for name in TASKS)
    for name, cls in TASKS.items():
        print(f"{name:<{width}}  {cls.summary}")


@bench_app.command("prefill")
def bench_prefill(
    model: str = typer.Option("smollm2"),
    lengths: str = typer.Option("1024,2048,4096", help="Comma-separated prompt lengths in tokens."),
    method: str = typer.Option("d2o"),
    budget: float = typer.Option(0.2),
    repeats: int = typer.Option(1, help="Alternating repeats per length (median reported)."),
    eager: bool = typer.Option(False, "--eager", help="Also time eager attention (slow at 4K)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Prefill time of METHOD over plain SDPA, and the statistics' peak extra memory."""
    from d2o.bench.prefill import bench_prefill as run
    from d2o.models import load_model

    net, tokenizer = load_model(model)
    print_rows(run(net, tokenizer, split_list(lengths, int), method, budget, repeats, eager), as_json)


@bench_app.command("decode")
def bench_decode(
    model: str = typer.Option("smollm2"),
    lengths: str = typer.Option("1024,4096", help="Comma-separated prompt lengths in tokens."),
    method: str = typer.Option("d2o"),
    budget: float = typer.Option(0.2),
    steps: int = typer.Option(32, help="Decoded tokens timed per run."),
    repeats: int = typer.Option(1, help="Alternating repeats per length (median reported)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Milliseconds per decoded token of METHOD against the full cache, and the KV bytes each holds."""
    from d2o.bench.decode import bench_decode as run
    from d2o.models import load_model

    net, tokenizer = load_model(model)
    print_rows(run(net, tokenizer, split_list(lengths, int), method, budget, steps, repeats), as_json)


def split_list(text: str | None, kind=str) -> tuple | None:
    """``"500,1000"`` -> (500, 1000); None stays None."""
    return None if text is None else tuple(kind(v.strip()) for v in text.split(",") if v.strip())


def print_rows(rows: list[dict], as_json: bool) -> None:
    print(json.dumps(rows, indent=1) if as_json else "\n".join(map(str, rows)))


def main() -> None:
    """Entry point: a D2OError becomes one line on stderr and exit code 2."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        app()
    except D2OError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
