"""`d2o eval`: a task x methods x budgets sweep, one prefill per sample, resumable.

Every sample runs under every (method, budget) through its task's ``run`` (by default one shared
prefill forked per run, then greedy decoding; see ``runner``). Results go line by line to
``samples.jsonl`` (a rerun skips what is there), then to ``summary.csv``, ``summary.md`` and plots.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from d2o.budget import MIN_TOKENS, Budget, parse_budgets
from d2o.errors import D2OError
from d2o.eval.tasks import get_task
from d2o.eval.tasks.base import Task
from d2o.options import check_kv_bits, check_prefill_chunk, distinct

FULL = "full"


@dataclass
class EvalConfig:
    """Everything that defines a sweep (also what ``DIR/config.json`` records)."""

    task: str
    model: str = "smollm2"
    methods: tuple[str, ...] = ("full", "h2o", "snapkv", "pyramidkv", "streamingllm", "d2o")
    budgets: tuple[str, ...] = ("0.1", "0.2", "0.5")
    limit: int | None = None
    seed: int = 0
    out: str = "out/eval"
    shared_prefill: bool = True
    dtype: str = "float32"
    attention: str = "sdpa"
    protocol: str = "prompt"  # or "context": the question is fed after the context was compressed
    min_tokens: int | None = None  # the floor under ratio budgets (None: the library's default)
    task_options: dict = field(default_factory=dict)
    method_options: dict = field(default_factory=dict)  # {method: {option: value}}
    evict_every: int = 1  # evict in batches of decode steps (CompressedCache's)
    kv_bits: int | None = None  # keys and values stored at 8, 4 or 2 bits (None: the model's dtype)
    prefill_chunk: int | None = None  # each prompt prefilled this many tokens at a time (None: whole)
    question_aware: bool = True  # in chunks: the methods that score with the question see the prompt's tail after each
    ray: str | None = None  # spread the samples over Ray workers: "local", "auto" or a cluster's address
    workers: int = 2  # Ray workers, one model each (one GPU each where the cluster has GPUs)

    def identity(self, task: Task) -> dict:
        """What must match for a rerun to resume into the same folder (methods, budgets and the
        limit may grow)."""
        identity = {"task": self.task, "task_settings": task.settings(), "model": self.model, "seed": self.seed,
                    "dtype": self.dtype, "attention": self.attention, "method_options": self.method_options,
                    "min_tokens": MIN_TOKENS if self.min_tokens is None else self.min_tokens, "protocol": self.protocol}
        if self.evict_every != 1:  # (folders of eviction at every step record none)
            identity["evict_every"] = self.evict_every
        if self.kv_bits is not None:
            identity["kv_bits"] = self.kv_bits
        if self.prefill_chunk is not None:
            identity["prefill_chunk"] = self.prefill_chunk
        if not self.question_aware:
            identity["question_aware"] = False
        return identity


def check_config(config: EvalConfig) -> tuple[Task, list[Budget]]:
    """Everything that can be checked without torch: the task and its options, the methods, the
    budgets, the limit, the output folder."""
    task = get_task(config.task, **config.task_options)
    task.check_protocol(config.protocol)
    if config.limit is not None and config.limit < 1:
        raise D2OError(f"limit must be at least 1, got {config.limit}")
    if config.evict_every < 1:
        raise D2OError(f"evict_every must be at least 1, got {config.evict_every}")
    check_prefill_chunk(config.prefill_chunk)
    if not config.question_aware and config.prefill_chunk is None:
        raise D2OError("question-blind goes with a prefill in chunks: a prompt prefilled whole holds its question")
    if config.ray is not None and config.workers < 1:
        raise D2OError(f"workers must be at least 1, got {config.workers}")
    check_kv_bits(config.kv_bits)
    for what, names in (("methods", config.methods), ("budgets", config.budgets)):
        if not names:
            raise D2OError(f"no {what} given")
    distinct(tuple(config.methods), "methods")  # budgets: once parsed, below
    stray = sorted(set(config.method_options) - set(config.methods))
    if stray:
        raise D2OError(f"options for {', '.join(stray)}, which is not among the methods: {', '.join(config.methods)}")
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise D2OError(f"results folder {str(out)!r} is a file")
    for name in ("samples.jsonl", "summary.csv", "summary.md", "config.json"):  # written into it
        if (out / name).is_dir():
            raise D2OError(f"results file {str(out / name)!r} is a folder")
    budgets = parse_budgets(config.budgets, config.min_tokens)
    distinct(tuple(map(str, budgets)), "budgets")  # 0.5 and 0.50 are one budget: its rows would count twice
    return task, budgets


def run_eval(config: EvalConfig, progress: bool = True) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows."""
    from tqdm import tqdm

    from d2o.eval import plots, results
    from d2o.runtime.prompts import check_length

    task, budgets = check_config(config)
    methods = sweep_methods(config, budgets)
    out = Path(config.out)
    check_folder(out, config, task)  # another configuration's folder: refused before the model loads
    if config.ray:  # the workers load the model; here its tokenizer and positions are enough
        from d2o.models import load_tokenizer

        tokenizer, model = load_tokenizer(config.model)  # (its config: what check_length reads)
    else:
        from d2o.models import load_model

        model, tokenizer = load_model(config.model, dtype=config.dtype, attention=config.attention)
    store = results.SampleStore(out / "samples.jsonl")
    samples = task.samples(tokenizer, config.limit, config.seed)
    encoded = {}
    for sample in samples:  # every prompt is checked before anything runs
        encoded[sample.id] = task.encode(sample, tokenizer, config.protocol)
        try:
            check_length(model, sum(map(len, encoded[sample.id])), sample.max_new_tokens)
        except D2OError as error:
            raise D2OError(f"sample {sample.id}: {error}") from None
    record_config(out, config, task)  # only once every sample is known to run
    runs = runs_of(methods, budgets)
    done = store.keys()
    jobs = []  # (samples sharing a context, its token ids, each sample's question, each sample's runs to do)
    for group in shared_contexts(samples, encoded, config.protocol):
        todos = [[run for run in runs if (sample.id, run.method, str(run.budget)) not in done] for sample in group]
        jobs.append((group, encoded[group[0].id][0], [encoded[s.id][1] for s in group], todos))
    bar = tqdm(total=len(samples), desc=task.name, disable=not progress, unit="sample")
    bar.update(sum(len(group) for group, *_, todos in jobs if not any(todos)))
    jobs = [job for job in jobs if any(job[3])]
    if config.ray:
        from d2o.eval.distributed import run_on_ray

        for group, lines in run_on_ray(config, jobs, task_and_methods):
            for line in lines:
                store.append(line)
            bar.update(len(group))
    else:
        from d2o.eval.runner import Runner

        runner = Runner.of(model, tokenizer, methods, config)
        for group, ids, questions, todos in jobs:
            for sample, outcome in task.run(runner, group, ids, questions, todos):
                store.append(results.result_line(task, sample, outcome))
            bar.update(len(group))
    bar.close()
    lines = results.of_this_run(store.read(), task, {sample.id for sample in samples}, runs)
    rows = results.summarize(lines, config)
    results.write_summaries(out, rows, task, config)
    plots.write_plots(out, lines, rows, task)
    return rows


def task_and_methods(config: EvalConfig) -> tuple[Task, dict]:
    """The sweep's task and methods (what a Ray worker builds from the configuration)."""
    task, budgets = check_config(config)
    return task, sweep_methods(config, budgets)


def sweep_methods(config: EvalConfig, budgets: list[Budget]) -> dict:
    """The sweep's method objects by name, each checked against every budget and the protocol."""
    from d2o.methods import get_method

    methods = {name: get_method(name, **config.method_options.get(name, {})) for name in config.methods}
    late = [name for name, method in methods.items() if method.compress_after_forward > 1]
    if config.prefill_chunk is not None and late:
        raise D2OError(f"{', '.join(late)} first compress(es) after the first decode step: it cannot compress a "
                       f"prompt in chunks (--prefill-chunk); run it in a sweep without")
    if config.protocol == "context" and late:  # its first compression would come after the question's pass
        raise D2OError(f"{', '.join(late)} first compress(es) after the first decode step, which under --protocol "
                       f"context is the question's pass: compression would see the question; run it under "
                       f"--protocol prompt")
    for method in methods.values():
        for budget in budgets:
            method.check_budget(budget)
    return methods


def shared_contexts(samples: list, encoded: dict, protocol: str) -> list[list]:
    """The samples in groups that compress the same tokens: under ``--protocol context``, the
    consecutive samples of one context (each with its own question); else one sample each."""
    groups: list[list] = []
    for sample in samples:
        if (protocol == "context" and groups and encoded[sample.id][1]
                and encoded[groups[-1][0].id][0] == encoded[sample.id][0]):
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def runs_of(methods: dict, budgets: list[Budget]) -> list:
    """(method, budget) runs; the full cache runs once, at budget 1."""
    from d2o.eval.runner import Run

    runs = []
    for name in methods:
        runs += [Run(name, Budget(ratio=1.0))] if name == FULL else [Run(name, budget) for budget in budgets]
    return runs


def check_folder(out: Path, config: EvalConfig, task: Task) -> None:
    """Create the results folder, or check that a resumed one holds the same configuration."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise D2OError(f"cannot create the results folder {str(out)!r}: {error.strerror or error}") from None
    path = out / "config.json"
    if path.exists():
        recorded = recorded_identity(path)
        identity = _identity(config, task)
        if isinstance(recorded.get("task_settings"), dict):  # a task option added since: the folder ran its default
            recorded["task_settings"] = {**task_defaults(task), **recorded["task_settings"]}
        if recorded != identity:
            differing = sorted(k for k in identity if recorded.get(k) != identity[k])
            raise D2OError(f"{out} holds results of another configuration (differs in: {', '.join(differing)}); "
                           f"choose another --out")


def recorded_identity(path: Path) -> dict:
    """The identity a results folder's config.json records; a file that holds none is refused."""
    try:
        identity = json.loads(path.read_text(encoding="utf-8"))["identity"]
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, not JSON (ValueError), no identity
        identity = None
    if not isinstance(identity, dict):
        raise D2OError(f"{path} is not a configuration that d2o eval wrote: choose another --out, or delete it "
                       f"if the results there are of this configuration")
    return identity


def task_defaults(task: Task) -> dict:
    """The task's options at their defaults, as its settings are recorded."""
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(task)
                if f.default is not MISSING or f.default_factory is not MISSING}
    return json.loads(json.dumps(defaults))


def record_config(out: Path, config: EvalConfig, task: Task) -> None:
    (out / "config.json").write_text(json.dumps({"identity": _identity(config, task), "last_run": asdict(config)},
                                                indent=1, default=str))


def _identity(config: EvalConfig, task: Task) -> dict:
    return json.loads(json.dumps(config.identity(task)))  # tuples as lists, like the file
