"""Benchmarks: speed and memory, measured side by side in one run (ratios, not absolute claims)."""
