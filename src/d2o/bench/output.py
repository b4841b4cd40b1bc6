"""Benchmark results: a Markdown table on the terminal, and Markdown + JSON (+ plots) in a folder."""

from __future__ import annotations

import json
from pathlib import Path


def markdown(rows: list[dict], title: str) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(column)) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def emit(rows: list[dict], title: str, name: str, out: Path | None, setting: dict) -> str:
    """Print the table; with ``out``, also write ``{name}.md`` and ``{name}.json`` (rows and the
    setting that produced them). Returns the Markdown."""
    text = markdown(rows, title)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.md").write_text(text)
        (out / f"{name}.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    return text
