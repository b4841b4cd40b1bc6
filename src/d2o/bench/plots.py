"""PNG plots of the benchmarks: time and throughput against context and batch, memory against length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _by_method(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["method"], []).append(row)
    return groups


def decode_plots(rows: list[dict], out: Path) -> list[Path]:
    """ms per step against context (smallest batch), tokens/s against batch (longest context)."""
    smallest, longest = min(r["batch"] for r in rows), max(r["length"] for r in rows)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, group in _by_method(rows).items():
        at_batch = sorted((r for r in group if r["batch"] == smallest), key=lambda r: r["length"])
        left.plot([r["length"] for r in at_batch], [r["ms_per_step"] for r in at_batch], marker="o", label=method)
        at_length = sorted((r for r in group if r["length"] == longest), key=lambda r: r["batch"])
        right.plot([r["batch"] for r in at_length], [r["tokens_per_s"] for r in at_length], marker="o", label=method)
    left.set(xlabel="context (tokens)", ylabel="ms per decode step", title=f"decode step time, batch {smallest}")
    right.set(xlabel="batch", ylabel="tokens/s", title=f"decode throughput at {longest} tokens")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return [_save(figure, out / "decode.png")]


def bars(rows: list[dict], value: str, label: str, title: str, path: Path) -> Path:
    """One bar per row (method, and batch when several), labelled with its batch."""
    figure, axis = plt.subplots(figsize=(7, 4))
    names = [f"{r['method']}\nbatch {r['batch']}" for r in rows]
    axis.bar(names, [r[value] for r in rows], color="tab:blue")
    axis.set(ylabel=label, title=title)
    axis.grid(alpha=0.3, axis="y")
    return _save(figure, path)


def prefill_plot(rows: list[dict], methods: list[str], out: Path) -> Path:
    """Peak memory against length (lines), and the S x S attention matrix of one layer beside it."""
    lengths = [r["length"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(lengths, [r["sdpa_peak_mib"] for r in rows], marker="o", label="prefill, plain SDPA")
    for method in methods:
        left.plot(lengths, [r[f"{method}_peak_mib"] for r in rows], marker="o", label=f"prefill, {method}")
        right.plot(lengths, [r[f"{method}_over_sdpa"] for r in rows], marker="o", label=method)
    left.plot(lengths, [r["stats_peak_mib"] for r in rows], marker="o", label="statistics of one layer")
    left.plot(lengths, [r["attention_matrix_mib"] for r in rows], linestyle="--", color="black",
              label="S x S attention of one layer (never built)")
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="peak extra memory (MiB)",
             title="memory against length")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(xscale="log", xlabel="prompt tokens", ylabel="method prefill / SDPA prefill", title="time")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return _save(figure, out / "prefill.png")
