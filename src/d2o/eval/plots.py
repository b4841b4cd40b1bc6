"""PNG plots of a sweep: score vs budget, NIAH heatmaps, D2O's layer budgets, perplexity curves."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import fmean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from d2o.eval.results import FULL_BUDGET, budget_order  # noqa: E402


def write_plots(out: Path, lines: list[dict], rows: list[dict], task) -> list[Path]:
    written = [score_vs_budget(out, rows, task)]
    if task.name == "niah":
        written += niah_heatmaps(out, lines)
    if task.name == "perplexity":
        written += perplexity_curves(out, lines, task.window)
    written += layer_budgets(out, lines)
    return [path for path in written if path is not None]


def score_vs_budget(out: Path, rows: list[dict], task) -> Path | None:
    labels = sorted({r["task"] for r in rows})
    labels = [label for label in labels if "(" in label] or labels  # a task of sub-tasks: its averages
    if not rows:
        return None
    figure, axes = plt.subplots(1, len(labels), figsize=(5.5 * len(labels), 4), squeeze=False)
    for axis, label in zip(axes[0], labels):
        mine = [r for r in rows if r["task"] == label]
        budgets = sorted({r["budget"] for r in mine if r["method"] != "full"}, key=budget_order)
        for method in dict.fromkeys(r["method"] for r in mine):
            points = {r["budget"]: r["score"] for r in mine if r["method"] == method}
            if method == "full":
                axis.axhline(points[FULL_BUDGET], color="black", linestyle="--", label="full")
                continue
            xs = [i for i, b in enumerate(budgets) if b in points]
            axis.plot(xs, [points[budgets[i]] for i in xs], marker="o", label=method)
        axis.set_xticks(range(len(budgets)), budgets)
        axis.set_xlabel("KV budget")
        axis.set_ylabel(task.metrics[0])
        axis.set_title(label)
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    return _save(figure, out / "score_vs_budget.png")


def niah_heatmaps(out: Path, lines: list[dict]) -> list[Path]:
    cells: dict[tuple, list[float]] = defaultdict(list)
    for line in lines:
        cells[(line["budget"], line["method"], line["meta"]["depth"], line["meta"]["length"])].append(line["score"])
    depths = sorted({key[2] for key in cells})
    lengths = sorted({key[3] for key in cells})
    paths = []
    for budget in sorted({key[0] for key in cells if key[1] != "full"}, key=budget_order):
        methods = list(dict.fromkeys(key[1] for key in cells if key[0] in (budget, FULL_BUDGET)))
        columns = min(5, len(methods))
        rows = -(-len(methods) // columns)
        figure, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.8 * rows), squeeze=False)
        for axis in axes.flat[len(methods):]:
            axis.axis("off")
        for axis, method in zip(axes.flat, methods):
            use = FULL_BUDGET if method == "full" else budget
            grid = [[fmean(cells.get((use, method, d, n), [float("nan")])) for n in lengths] for d in depths]
            axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            axis.set_xticks(range(len(lengths)), lengths, fontsize=7)
            axis.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            axis.set_title(method, fontsize=9)
            axis.set_xlabel("tokens", fontsize=8)
        for row in axes:
            row[0].set_ylabel("needle depth")
        figure.suptitle(f"needle in a haystack, budget {budget}")
        paths.append(_save(figure, out / f"niah_heatmap_{budget}.png"))
    return paths


def layer_budgets(out: Path, lines: list[dict]) -> list[Path]:
    """Each layer's budget over the mean layer budget, averaged over samples, for the D2O family."""
    series: dict[tuple, list[list[float]]] = defaultdict(list)
    for line in lines:
        budgets = line.get("layer_budgets") or []
        if line["method"].startswith("d2o") and budgets and all(b is not None for b in budgets):
            mean = fmean(budgets)
            series[(line["method"], line["budget"])].append([b / mean for b in budgets])
    if not series:
        return []
    figure, axis = plt.subplots(figsize=(7, 4))
    for (method, budget), runs in sorted(series.items(), key=lambda item: (item[0][0], budget_order(item[0][1]))):
        axis.plot([fmean(values) for values in zip(*runs)], marker=".", label=f"{method} @ {budget}")
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("layer")
    axis.set_ylabel("budget / mean layer budget")
    axis.set_title("D2O layer budgets (inverse-variance allocation)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return [_save(figure, out / "d2o_layer_budgets.png")]


def perplexity_curves(out: Path, lines: list[dict], window: int) -> list[Path]:
    """Per budget, each method's perplexity per ``window`` of predicted tokens, at the window's end."""
    paths = []
    full = next((line for line in lines if line["method"] == "full"), None)
    for budget in sorted({line["budget"] for line in lines if line["method"] != "full"}, key=budget_order):
        figure, axis = plt.subplots(figsize=(7, 4))
        chosen = [line for line in lines if line["budget"] == budget and line["method"] != "full"]
        for line in ([full] if full else []) + chosen:
            style = {"color": "black", "linestyle": "--"} if line["method"] == "full" else {}
            axis.plot(window_ends(len(line["curve"]), window, line["meta"]["tokens"]), line["curve"],
                      label=line["method"], **style)
        axis.set_xlabel("position (tokens)")
        axis.set_ylabel("perplexity of the window")
        axis.set_yscale("log")
        axis.set_title(f"perplexity along the text, budget {budget}")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        paths.append(_save(figure, out / f"perplexity_curve_{budget}.png"))
    return paths


def window_ends(points: int, window: int, tokens: int) -> list[int]:
    """The tokens read when each of ``points`` windows of ``window`` predicted tokens ends (every
    token after the first of ``tokens`` is predicted; the last window may be short)."""
    return [min((i + 1) * window, tokens - 1) + 1 for i in range(points)]


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
