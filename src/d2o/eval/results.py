"""Results on disk: samples.jsonl (append-only), summary.csv and summary.md (rewritten whole)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from d2o.budget import Budget
from d2o.errors import D2OError

FULL_BUDGET = str(Budget(ratio=1.0))  # the label of the full cache's runs
# A sub-task the full cache scores below this says nothing about compression (a small model fails
# some of RULER's tasks outright); averages are also given without such sub-tasks.
ABLE = 0.3


class SampleStore:
    """``samples.jsonl``: one line per sample x method x budget, appended and flushed at once."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        lines = []
        with self.path.open(encoding="utf-8") as stream:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    raise D2OError(f"{self.path}:{number}: not valid JSON (a run was cut off mid-line? "
                                   f"delete that line to resume)") from None
        return lines

    def keys(self) -> set[tuple[str, str, str]]:
        return {(line["sample_id"], line["method"], line["budget"]) for line in self.read()}

    def append(self, line: dict) -> None:
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


def result_line(task, sample, outcome) -> dict:
    """The line ``samples.jsonl`` keeps for one run of one sample (the one place it is built)."""
    report = outcome.report
    return {
        "task": task.name, "subtask": sample.meta.get("subtask"), "sample_id": sample.id,
        "method": outcome.run.method, "budget": str(outcome.run.budget), "prediction": outcome.prediction,
        "gold": sample.gold, "score": outcome.scores[task.metrics[0]], "scores": outcome.scores, **outcome.extra,
        "kv_tokens_kept": report.kv_tokens_kept, "kv_tokens_full": report.kv_tokens_full,
        "kv_bytes": report.kv_bytes, "kv_bytes_full": report.kv_bytes_full, "layer_budgets": report.layer_budgets,
        "seconds": round(outcome.seconds, 3),
        "prefill_seconds": None if outcome.prefill_seconds is None else round(outcome.prefill_seconds, 3),
        "meta": {k: v for k, v in sample.meta.items() if k != "all_classes"},
    }


def task_label(line: dict) -> str:
    return f"{line['task']}/{line['subtask']}" if line.get("subtask") else line["task"]


def of_this_run(lines: list[dict], task, sample_ids: set[str], runs) -> list[dict]:
    """The lines of this run's samples and (method, budget) runs. A folder also keeps what earlier
    runs of its configuration computed (more samples, other methods or budgets): summarised with
    them, a cell would mix sample sets."""
    wanted = {(run.method, str(run.budget)) for run in runs}
    return [line for line in lines if line["task"] == task.name and line["sample_id"] in sample_ids
            and (line["method"], line["budget"]) in wanted]


def summarize(lines: list[dict], config) -> list[dict]:
    """Mean main score per (task label, method, budget) of ``lines`` (``of_this_run``'s), and for a
    task of sub-tasks the averages over them (``averages``)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in lines:
        groups[(task_label(line), line["method"], line["budget"])].append(line)
    order = {name: i for i, name in enumerate(config.methods)}
    rows = [
        {"task": label, "method": method, "budget": budget, "score": round(fmean(run["score"] for run in group), 4),
         "n": len(group), "kv_share": round(fmean(run["kv_tokens_kept"] / run["kv_tokens_full"] for run in group), 3)}
        for (label, method, budget), group in groups.items()
    ]
    rows += averages(rows)
    return sorted(rows, key=lambda r: (r["task"], order[r["method"]], budget_order(r["budget"])))


def averages(rows: list[dict]) -> list[dict]:
    """For a task of sub-tasks (RULER's, LongBench's datasets), each run's mean over its sub-tasks
    (``TASK (average)``, as RULER and kvpress's leaderboard report it) and, where the full cache
    scores some below ``ABLE``, its mean over the others (``TASK (average, full >= 0.3)``). A run
    missing a sub-task has none."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if "/" in row["task"]:
            by_task[row["task"].split("/")[0]].append(row)
    averaged = []
    for task, group in by_task.items():
        labels = sorted({row["task"] for row in group})
        weak = weak_subtasks(group)
        able = [label for label in labels if label not in weak]
        kinds = [("average", labels)]
        if weak and able:  # (with the full cache in the sweep)
            kinds.append((f"average, full >= {ABLE:g}", able))
        runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
        for row in group:
            runs[(row["method"], row["budget"])][row["task"]] = row
        for (method, budget), cells in runs.items():
            for name, wanted in kinds:
                if any(label not in cells for label in wanted):
                    continue
                chosen = [cells[label] for label in wanted]
                averaged.append({"task": f"{task} ({name})", "method": method, "budget": budget,
                                 "score": round(fmean(row["score"] for row in chosen), 4),
                                 "n": sum(row["n"] for row in chosen),
                                 "kv_share": round(fmean(row["kv_share"] for row in chosen), 3)})
    return averaged


def weak_subtasks(rows: list[dict]) -> set[str]:
    """The task labels of ``rows`` whose full-cache score is below ``ABLE``, or that the full
    cache did not run while it ran others (none when the sweep has no full cache)."""
    full = {row["task"]: row["score"] for row in rows if row["method"] == "full"}
    if not full:
        return set()
    return {row["task"] for row in rows if full.get(row["task"], 0.0) < ABLE}


def budget_order(budget: str):
    return (0, float(budget)) if not budget.endswith("t") else (1, float(budget[:-1]))


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def write_summaries(out: Path, rows: list[dict], task, config) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["task", "method", "budget", "score", "n"], lineterminator="\n",
                            extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    _atomic_write(out / "summary.csv", buffer.getvalue())
    _atomic_write(out / "summary.md", markdown_table(rows, task, config))


def markdown_table(rows: list[dict], task, config) -> str:
    """Per task label: the scores, then the share of the full cache's KV tokens each run held at
    its end; methods as rows, budgets as columns (the full cache in every column). A task of
    sub-tasks has one table instead: a row per run, a column per sub-task and its averages."""
    budgets = sorted({r["budget"] for r in rows if r["method"] != "full"}, key=budget_order) or [FULL_BUDGET]
    direction = "higher is better" if task.higher_is_better else "lower is better"
    parts = [f"Model `{config.model}`, seed {config.seed}; score: {task.metrics[0]} ({direction}), "
             f"mean over n samples.\n"]
    labels = sorted({r["task"] for r in rows})
    if any("/" in label for label in labels):
        parts.append(_subtask_table(rows, labels, config))
    for label in labels:
        if "/" in label or "(" in label:
            continue
        table = {(r["method"], r["budget"]): r for r in rows if r["task"] == label}
        methods = [m for m in config.methods if any(key[0] == m for key in table)]
        for title, field, digits in ((label, "score", 3), (f"{label}: KV tokens held at the end / full cache",
                                                            "kv_share", 2)):
            parts.append(f"### {title}\n")
            parts.append("| method | " + " | ".join(f"budget {b}" for b in budgets) + " | n |")
            parts.append("|---|" + "---|" * (len(budgets) + 1))
            for method in methods:
                cells, counts = [], set()
                for budget in budgets:
                    row = table.get((method, FULL_BUDGET if method == "full" else budget))
                    cells.append(f"{row[field]:.{digits}f}" if row else "")
                    if row:
                        counts.add(row["n"])
                parts.append(f"| {method} | " + " | ".join(cells) + f" | {'/'.join(map(str, sorted(counts)))} |")
            parts.append("")
    return "\n".join(parts) + "\n"


def _subtask_table(rows: list[dict], labels: list[str], config) -> str:
    """One row per (method, budget), one column per sub-task, then the averages; a sub-task the
    full cache scores below ``ABLE`` is marked."""
    subtasks = [label for label in labels if "/" in label]
    summaries = [label for label in labels if "(" in label]
    weak = weak_subtasks([r for r in rows if r["task"] in subtasks])
    cells = {(r["task"], r["method"], r["budget"]): r for r in rows}
    runs = sorted({(r["method"], r["budget"]) for r in rows},
                  key=lambda run: (config.methods.index(run[0]), budget_order(run[1])))
    names = [label.split("/", 1)[1] + (" *" if label in weak else "") for label in subtasks]
    names += [label[label.index("(") + 1:-1] for label in summaries]
    lines = ["### " + subtasks[0].split("/")[0] + ": score per task\n",
             "| method | budget | " + " | ".join(names) + " | KV held / full | n per task |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for method, budget in runs:
        row = [cells.get((label, method, budget)) for label in subtasks + summaries]
        held = [r["kv_share"] for r in row[:len(subtasks)] if r]
        counts = sorted({r["n"] for r in row[:len(subtasks)] if r})
        lines.append(f"| {method} | {budget} | " + " | ".join(f"{r['score']:.3f}" if r else "" for r in row)
                     + f" | {fmean(held):.2f} | {'/'.join(map(str, counts))} |")
    if weak:
        lines.append(f"\n\\* the full cache scores below {ABLE:g}: says nothing about compression "
                     f"(left out of \"average, full >= {ABLE:g}\").")
    return "\n".join(lines) + "\n"
