"""Throughput of a long generation from decode steps measured at a few context lengths.

Generating G tokens after a P-token prompt takes the sum of G step times; a step's time depends
on what the cache holds, which grows with the context for the full cache and stays at the
budget for an evicting method (held to a token budget, it holds the same whatever the prompt).
``bench decode`` measures steps at several contexts; this integrates them over P..P+G
(piecewise linear between measured contexts) into tokens/s per method and batch, and reads the
KV memory (and the peak, where measured) at the last step's context the same way: a method that
stops evicting after its prefill, like the full cache, grows by every generated token.
"""

from __future__ import annotations

from d2o.errors import D2OError

NUMBERS = ("length", "batch", "ms_per_step", "kv_mib")  # what a row of ``bench decode`` measures, besides its method


def integrate(rows: list[dict], prompt: int, generate: int) -> list[dict]:
    """Tokens/s of ``generate`` tokens after ``prompt`` per (method, batch), from ``bench decode``
    rows measured at contexts covering [prompt, prompt + generate]."""
    if not isinstance(rows, list) or not rows:
        raise D2OError("no rows of `d2o bench decode` to integrate")
    for row in rows:
        if not isinstance(row, dict):
            raise D2OError(f"a row that `d2o bench decode` did not write: {row!r}")
        bad = [key for key in ("method", "budget") if not isinstance(row.get(key), str)]
        bad += [key for key in NUMBERS if not _positive(row.get(key))]
        bad += ["peak_mib"] if "peak_mib" in row and not _positive(row["peak_mib"]) else []
        if bad:
            raise D2OError(f"a row that `d2o bench decode` did not write: {', '.join(bad)} missing, not a number "
                           f"or not positive (method and budget: text)")
    cells: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        cells.setdefault((row["method"], row["budget"], row["batch"]), {})[row["length"]] = row
    out = []
    for (method, budget, batch), by_length in cells.items():
        lengths = sorted(by_length)
        if lengths[0] > prompt or lengths[-1] < prompt + generate - 1:
            raise D2OError(f"{method} at batch {batch}: contexts {lengths[0]}..{lengths[-1]} do not cover "
                           f"{prompt}..{prompt + generate - 1}")
        seconds = sum(_at(by_length, lengths, prompt + step, "ms_per_step") for step in range(generate)) / 1000
        end = prompt + generate - 1  # the context of the last step
        row = {"method": method, "budget": budget, "batch": batch, "prompt": prompt, "generate": generate,
               "seconds": round(seconds, 2), "tokens_per_s": round(batch * generate / seconds, 1),
               "kv_mib_at_end": round(_at(by_length, lengths, end, "kv_mib"), 3)}
        if all("peak_mib" in measured for measured in by_length.values()):
            row["peak_mib"] = round(_at(by_length, lengths, end, "peak_mib"), 1)
        out.append(row)
    full = {row["batch"]: row for row in out if row["method"] == "full"}
    for row in out:
        if row["batch"] in full:
            row["vs_full_same_batch"] = round(row["tokens_per_s"] / full[row["batch"]]["tokens_per_s"], 2)
    return out


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0  # NaN is not > 0


def _at(by_length: dict[int, dict], lengths: list[int], context: int, key: str) -> float:
    """``key`` at ``context``, linear between the measured contexts around it."""
    for low, high in zip(lengths, lengths[1:]):
        if low <= context <= high:
            weight = (context - low) / (high - low)
            return (1 - weight) * by_length[low][key] + weight * by_length[high][key]
    return by_length[lengths[-1]][key]
