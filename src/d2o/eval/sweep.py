"""`d2o eval`: a task x methods x budgets sweep, one prefill per sample, resumable.

Each sample's prompt is prefilled once under a cache that records what every method observes
(``SharedPrefill``); each method and budget then compresses its own fork of that prefill and
decodes greedily. Results go line by line to ``samples.jsonl`` (a rerun skips what is there),
then to ``summary.csv``, ``summary.md`` and plots.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.engine.sharing import SharedPrefill
from d2o.errors import D2OError
from d2o.eval import results
from d2o.eval.tasks import get_task
from d2o.eval.tasks.base import Sample, Task
from d2o.eval.tasks.perplexity import Perplexity
from d2o.generation import check_length
from d2o.methods import get_method

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
    task_options: dict = field(default_factory=dict)
    method_options: dict = field(default_factory=dict)  # {method: {option: value}}

    def identity(self, task: Task) -> dict:
        """What must match for a rerun to resume into the same folder (methods, budgets and the
        limit may grow)."""
        return {"task": self.task, "task_settings": task.settings(), "model": self.model, "seed": self.seed,
                "dtype": self.dtype, "attention": self.attention, "method_options": self.method_options}


def run_eval(config: EvalConfig, progress: bool = True) -> list[dict]:
    """Run (or resume) the sweep; returns the summary rows."""
    from d2o.models import load_model

    task = get_task(config.task, **config.task_options)
    methods = {name: get_method(name, **config.method_options.get(name, {})) for name in config.methods}
    budgets = [Budget.parse(b) for b in config.budgets]
    out = Path(config.out)
    claim_folder(out, config, task)
    model, tokenizer = load_model(config.model, dtype=config.dtype, attention=config.attention)
    store = results.SampleStore(out / "samples.jsonl")
    if isinstance(task, Perplexity):
        run_perplexity(task, model, tokenizer, methods, budgets, store, progress)
    else:
        run_generation(task, config, model, tokenizer, methods, budgets, store, progress)
    rows = results.summarize(store.read(), task, config)
    results.write_summaries(out, rows, task, config)
    from d2o.eval import plots

    plots.write_plots(out, store.read(), rows, task)
    return rows


def claim_folder(out: Path, config: EvalConfig, task: Task) -> None:
    """Record the configuration, or check that a resumed folder holds the same one."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    identity = json.loads(json.dumps(config.identity(task)))  # tuples as lists, like the file
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded.get("identity") != identity:
            differing = sorted(k for k in identity if recorded.get("identity", {}).get(k) != identity[k])
            raise D2OError(f"{out} holds results of another configuration (differs in: {', '.join(differing)}); "
                           f"choose another --out")
    path.write_text(json.dumps({"identity": identity, "last_run": asdict(config)}, indent=1, default=str))


def runs_of(methods: dict, budgets: list[Budget]) -> list[tuple[str, Budget]]:
    """(method, budget) pairs; the full cache runs once, at budget 1.0."""
    pairs = []
    for name in methods:
        pairs += [(name, Budget(ratio=1.0))] if name == FULL else [(name, b) for b in budgets]
    return pairs


def run_generation(task, config, model, tokenizer, methods, budgets, store, progress) -> None:
    samples = task.samples(tokenizer, config.limit, config.seed)
    encoded = {}
    for sample in samples:  # every prompt is checked before anything runs
        ids = tokenizer(sample.prompt, return_tensors="pt", add_special_tokens=sample.special_tokens).input_ids
        try:
            check_length(model, ids.shape[1], sample.max_new_tokens)
        except D2OError as error:
            raise D2OError(f"sample {sample.id}: {error}") from None
        encoded[sample.id] = ids
    done = store.keys()
    pairs = runs_of(methods, budgets)
    device = next(model.parameters()).device
    for sample in tqdm(samples, desc=f"{task.name}", disable=not progress, unit="sample"):
        todo = [(name, budget) for name, budget in pairs if (sample.id, name, str(budget)) not in done]
        if not todo:
            continue
        ids = encoded[sample.id].to(device)
        for line in answer_sample(task, sample, ids, model, tokenizer, methods, todo, config.shared_prefill):
            store.append(line)


def answer_sample(task, sample: Sample, ids, model, tokenizer, methods, todo, shared: bool) -> list[dict]:
    """Every (method, budget) of ``todo`` on one sample; one prefill shared where methods allow."""
    lines = []
    shareable = [name for name in dict.fromkeys(n for n, _ in todo) if not methods[name].repeats_kv_heads]
    prefill = None
    if shared and shareable:
        start = time.perf_counter()
        prefill = SharedPrefill(model, [methods[name] for name in shareable])
        logits = _forward(model, ids, prefill.cache)
        prefill_seconds = time.perf_counter() - start
    for name, budget in todo:
        start = time.perf_counter()
        if prefill is not None and name in shareable:
            cache, first, own_prefill = prefill.fork(shareable.index(name), budget), logits, prefill_seconds
        else:
            cache = CompressedCache(model, methods[name], budget)
            first = _forward(model, ids, cache)
            own_prefill = time.perf_counter() - start
        text = greedy_answer(model, tokenizer, cache, first, sample)
        seconds = time.perf_counter() - start
        scores = task.score(text, sample)
        report = cache.report()
        lines.append({
            "task": task.name, "subtask": sample.meta.get("subtask"), "sample_id": sample.id, "method": name,
            "budget": str(budget), "prediction": text, "gold": sample.gold, "score": scores[task.metrics[0]],
            "scores": scores, "kv_tokens_kept": report.kv_tokens_kept, "kv_tokens_full": report.kv_tokens_full,
            "kv_bytes": report.kv_bytes, "layer_budgets": report.layer_budgets, "seconds": round(seconds, 3),
            "prefill_seconds": round(own_prefill, 3),
            "meta": {k: v for k, v in sample.meta.items() if k != "all_classes"},
        })
    return lines


def _forward(model, ids, cache) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, logits_to_keep=1).logits[0, -1]


def greedy_answer(model, tokenizer, cache, logits: torch.Tensor, sample: Sample) -> str:
    """Greedy decoding from the prefill's last logits until EOS, a stop string or the length."""
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    device = logits.device
    tokens: list[int] = []
    with torch.inference_mode():
        for step in range(sample.max_new_tokens):
            token = int(logits.argmax())
            if token in stops:
                break
            tokens.append(token)
            # Stop strings end an answer once it has begun: a leading newline is not an answer.
            begun = tokenizer.decode(tokens, skip_special_tokens=True).lstrip()
            if any(stop in begun for stop in sample.stop):
                break
            if step + 1 < sample.max_new_tokens:
                logits = model(input_ids=torch.tensor([[token]], device=device), cache=cache,
                               logits_to_keep=1).logits[0, -1]
    text = tokenizer.decode(tokens, skip_special_tokens=True).lstrip()
    for stop in sample.stop:
        text = text.split(stop)[0]
    return text.strip()


def run_perplexity(task: Perplexity, model, tokenizer, methods, budgets, store, progress) -> None:
    tokens = task.tokens(tokenizer)
    check_length(model, tokens.shape[1])
    sample_id = f"perplexity-{task.length}"
    done = store.keys()
    todo = [(n, b) for n, b in runs_of(methods, budgets) if (sample_id, n, str(b)) not in done]
    for name, budget in tqdm(todo, desc="perplexity", disable=not progress, unit="run"):
        start = time.perf_counter()
        result = task.evaluate(model, tokens, methods[name], budget)
        report = result["report"]
        store.append({
            "task": task.name, "subtask": None, "sample_id": sample_id, "method": name, "budget": str(budget),
            "prediction": None, "gold": None, "score": result["perplexity"],
            "scores": {"perplexity": result["perplexity"]}, "curve": result["curve"],
            "kv_tokens_kept": report.kv_tokens_kept, "kv_tokens_full": report.kv_tokens_full,
            "kv_bytes": report.kv_bytes, "layer_budgets": report.layer_budgets,
            "seconds": round(time.perf_counter() - start, 3), "prefill_seconds": None, "meta": {"tokens": task.length},
        })
