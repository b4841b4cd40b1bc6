"""Benchmarks: speed and memory, measured side by side in one run (ratios, not absolute claims)."""

from __future__ import annotations

from d2o.errors import D2OError

WARM_UP_TOKENS = 128  # the prompt run once per variant before a benchmark measures any
FIT_MAX_BATCH = 256  # bench fit's default cap on rows (here, where the command line reads it without torch)
SERVE_WORKLOADS = ("prompts", "documents", "chat", "mixed")  # bench serve's (here too, for the same reason)


def check_fit_generate(generate: int) -> None:
    """``bench fit`` times decoding from the second generated token, so it needs two. Here, where
    torch is not imported, so that the command refuses before loading it."""
    if generate < 2:
        raise D2OError(f"generate must be at least 2, got {generate}: the first token comes from the prefill, and "
                       f"decoding is timed from the second")
