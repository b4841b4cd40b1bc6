"""Score against KV memory: every (method, bits, budget) of several ``d2o eval`` folders at the
share of the full cache's bytes it held, so that tokens kept and bits per token are compared at
equal memory.

A run's memory is its cache's K/V bytes at the end (packed levels, steps, zero points and the
residual when quantized) over what the stock cache holds in the model's dtype, averaged over its
samples. The points that no other point of the same task matches with less memory, or beats with
as little, form the frontier (``best``): the least memory each score takes.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import fmean

from d2o.errors import D2OError
from d2o.eval.compare import read_folder
from d2o.eval.sweep import recorded_identity


def frontier(paths: list[Path]) -> list[dict]:
    """One row per task, protocol, method, bits and budget of ``paths`` (``d2o eval`` folders): its
    samples, mean score and mean share of the full cache's bytes, and whether it is on the frontier."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    higher = {}
    for path in paths:
        folder = read_folder(path)
        bits = recorded_identity(path / "config.json").get("kv_bits")
        task, protocol, _ = folder.group
        higher[(task, protocol)] = folder.higher_is_better
        for line in folder.lines:
            if "kv_bytes_full" not in line:
                raise D2OError(f"{path}: its samples record no kv_bytes_full (written by an older d2o): run it again")
            runs[(task, protocol, line["method"], bits, line["budget"])].append(line)
    rows = []
    for (task, protocol, method, bits, budget), lines in runs.items():
        rows.append({"task": task, "protocol": protocol, "method": method, "kv_bits": bits or "-", "budget": budget,
                     "n": len(lines), "score": round(fmean(line["score"] for line in lines), 3),
                     "kv_memory": round(fmean(line["kv_bytes"] / line["kv_bytes_full"] for line in lines), 4)})
    rows.sort(key=lambda row: (row["task"], row["protocol"], row["kv_memory"]))
    for row in rows:
        sign = 1 if higher[(row["task"], row["protocol"])] else -1
        row["best"] = not any(
            other["task"] == row["task"] and other["protocol"] == row["protocol"]
            and other["kv_memory"] <= row["kv_memory"] and sign * other["score"] >= sign * row["score"]
            and (other["kv_memory"] < row["kv_memory"] or sign * other["score"] > sign * row["score"])
            for other in rows)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| task | protocol | KV memory | method | bits | budget | n | score | frontier |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['task']} | {row['protocol']} | {row['kv_memory']:.1%} | {row['method']} | "
                     f"{row['kv_bits']} | {row['budget']} | {row['n']} | {row['score']:.3f} | "
                     f"{'yes' if row['best'] else ''} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Score against KV memory, one panel per task and protocol, one line per method and bits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((row["task"], row["protocol"]) for row in rows))
    colors = {method: f"C{i % 10}" for i, method in enumerate(dict.fromkeys(row["method"] for row in rows))}
    markers = {"-": "o", 8: "s", 4: "^", 2: "v"}  # the bits, by the marker; the method, by the colour
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (task, protocol) in zip(axes[0], panels):
        mine = [row for row in rows if (row["task"], row["protocol"]) == (task, protocol)]
        for method, bits in dict.fromkeys((row["method"], row["kv_bits"]) for row in mine):
            points = sorted((row["kv_memory"], row["score"]) for row in mine
                            if (row["method"], row["kv_bits"]) == (method, bits))
            axis.plot([100 * x for x, _ in points], [y for _, y in points], color=colors[method],
                      marker=markers.get(bits, "x"), linestyle="-" if bits == "-" else ":",
                      label=f"{method}, {'float' if bits == '-' else f'{bits} bits'}")
        axis.set_xscale("log")
        axis.set_xlabel("KV memory, % of the full cache's bytes (log)")
        axis.set_ylabel("score")
        axis.set_title(f"{task}, {protocol}")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
