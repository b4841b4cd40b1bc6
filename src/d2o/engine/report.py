"""What a compressed cache holds, per layer and in total, against the full cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from d2o.budget import UNLIMITED


@dataclass
class LayerReport:
    """What one layer holds after a run (per row of the batch, except bytes)."""

    layer: int
    window: int | None  # a sliding-window layer's window (it keeps the newest window - 1 tokens); None: global
    budget: list[int | None]  # None: not compressed (not yet allocated, an exempt or a sliding-window layer)
    kept: list[int]
    full: list[int]  # what the stock cache would hold: real tokens seen, or a sliding window's
    merged: list[int]
    floor: list[bool]  # the floor under a ratio budget, not the ratio's share, set the budget
    kept_per_head: list[list[int]]  # tokens each stored KV head holds (they differ under heads=adaptive)
    kv_bytes: int
    kv_bytes_full: int
    state_bytes: int  # token indices and method state kept per slot, beside the keys and values
    method: dict[str, list[Any]] = field(default_factory=dict)  # the method's own diagnostics, per row
    # Keys and values stored quantized: kv_bytes by part (packed levels, steps and zero points, the
    # residual's full-precision tokens); empty when stored in the model's dtype.
    kv_parts: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


PER_ROW = ("budget", "kept", "full", "merged", "floor", "kept_per_head")
BYTES = ("kv_bytes", "kv_bytes_full", "state_bytes")


@dataclass
class CacheReport:
    """Per-layer and total memory of a compressed cache, against the full cache."""

    method: str
    budget: str | None  # None: the method keeps everything (no budget held it)
    min_tokens: int | None  # the floor under a ratio budget (None: a token budget, or no budget)
    layers: list[LayerReport]

    @classmethod
    def concat(cls, reports: list[CacheReport]) -> CacheReport:
        """One report for the rows of several (rows of one batch, reported as each finished)."""
        first = reports[0]
        layers = []
        for parts in zip(*(report.layers for report in reports)):
            merged = {name: [v for part in parts for v in part.method[name]] for name in parts[0].method}
            layers.append(LayerReport(
                layer=parts[0].layer,
                window=parts[0].window,
                **{name: [v for part in parts for v in getattr(part, name)] for name in PER_ROW},
                **{name: sum(getattr(part, name) for part in parts) for name in BYTES},
                method=merged,
                kv_parts={name: sum(part.kv_parts[name] for part in parts) for name in parts[0].kv_parts},
            ))
        return cls(method=first.method, budget=first.budget, min_tokens=first.min_tokens, layers=layers)

    kv_tokens_kept = property(lambda report: sum(sum(layer.kept) for layer in report.layers))
    kv_tokens_full = property(lambda report: sum(sum(layer.full) for layer in report.layers))
    kv_bytes = property(lambda report: sum(layer.kv_bytes for layer in report.layers))
    kv_bytes_full = property(lambda report: sum(layer.kv_bytes_full for layer in report.layers))
    state_bytes = property(lambda report: sum(layer.state_bytes for layer in report.layers))

    kv_parts = property(lambda report: {name: sum(layer.kv_parts[name] for layer in report.layers)
                                        for name in (report.layers[0].kv_parts if report.layers else {})},
                        doc="kv_bytes by part, when keys and values are stored quantized (else empty).")
    floor_layers = property(lambda report: sum(bool(layer.floor[0]) for layer in report.layers if layer.floor),
                            doc="Layers of the first row whose budget the floor set.")
    layer_budgets = property(lambda report: [layer.budget[0] if layer.budget else None for layer in report.layers],
                             doc="Per-layer budget of the first row (the only row for a single prompt).")

    def as_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in (
            "method", "budget", "min_tokens", "floor_layers", "kv_tokens_kept", "kv_tokens_full", "kv_bytes",
            "kv_bytes_full", "state_bytes", "kv_parts", "layer_budgets", "global_layers")},
            "layers": [layer.as_dict() for layer in self.layers]}

    global_layers = property(lambda report: [layer.layer for layer in report.layers if layer.window is None],
                             doc="The layers that attend to every token (those a budget compresses).")

    def summary(self) -> str:
        """One line: what was held, against the full cache."""
        held = self.method if self.budget is None else f"{self.method} at {self.budget}"
        line = (f"{held}: {self.kv_tokens_kept} of {self.kv_tokens_full} KV tokens, "
                f"{self.kv_bytes / 2**20:.2f} of {self.kv_bytes_full / 2**20:.2f} MiB "
                f"(+{self.state_bytes / 2**20:.2f} MiB of token indices and scores)")
        if self.kv_parts:
            line += " - quantized: " + ", ".join(f"{name} {count / 2**20:.2f}" for name, count in self.kv_parts.items())
        if len(self.global_layers) < len(self.layers):
            line += f"; global layers {', '.join(map(str, self.global_layers))}, the others slide"
        if self.floor_layers:
            line += f"; the {self.min_tokens}-token floor set {self.floor_layers} of {len(self.layers)} layers"
        return line

    def table(self) -> str:
        """A plain-text per-layer table (first row of the batch), with the method's diagnostics."""
        lines = [f"{'layer':>5} {'budget':>7} {'kept':>6} {'full':>6} {'merged':>7} {'KV bytes':>10}  method"]
        for layer in self.layers:
            budget = layer.budget[0] if layer.budget and layer.budget[0] is not None else "-"
            if layer.window is not None:
                budget = f"w{layer.window}"
            details = "  ".join(f"{name} {_brief(values[0])}" for name, values in layer.method.items() if values)
            if len(set(layer.kept_per_head[0])) > 1:
                details = f"heads {'/'.join(map(str, layer.kept_per_head[0]))}  {details}".rstrip()
            lines.append(f"{layer.layer:>5} {budget!s:>7} {layer.kept[0]:>6} {layer.full[0]:>6} "
                         f"{layer.merged[0]:>7} {layer.kv_bytes:>10}  {details}")
        lines.append(f"total: {self.kv_tokens_kept} of {self.kv_tokens_full} KV tokens, {self.kv_bytes} of "
                     f"{self.kv_bytes_full} bytes ({self.kv_bytes / max(self.kv_bytes_full, 1):.1%})")
        return "\n".join(lines)


def _brief(value) -> str:
    if isinstance(value, list):
        shown = " ".join(_brief(v) for v in value[:3])
        return shown + (" ..." if len(value) > 3 else "")
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def report_of(cache, rows: list[int] | None = None) -> CacheReport:
    """What ``cache``'s layers hold, for ``rows`` of the batch (all of them by default); a row's
    bytes are its share of the layer's tensors."""
    layers = []
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        batch = layer.token_index.shape[0]
        picked = list(range(batch)) if rows is None else list(rows)

        def pick(values: list) -> list:
            return [values[row] for row in picked]

        # What a plain cache would hold: the model's own KV heads, never repeated.
        heads = cache.facts.config.num_key_value_heads
        bytes_per_token = heads * (layer.key_dim + layer.value_dim) * layer.dtype.itemsize
        budget = [None] * batch if layer.budget is None else [
            None if b == UNLIMITED else b for b in cache.schedule.limit(layer.budget, layer.real_seen).tolist()]
        # What the stock cache holds: every fed token (padding included), or its window.
        full, stock = layer.real_seen, layer.seen
        if layer.window is not None:
            full, stock = full.clamp_max(layer.window - 1), min(stock, layer.window - 1)
        layers.append(LayerReport(
            layer=layer.layer_idx, window=layer.window, budget=pick(budget), kept=pick(layer.n_kept.tolist()),
            full=pick(full.tolist()), merged=pick(layer.merged.tolist()),
            floor=pick(cache.schedule.floor_decides(layer).tolist()),
            kept_per_head=pick(layer.head_counts().tolist()),
            kv_bytes=layer.nbytes * len(picked) // batch, state_bytes=layer.state_nbytes * len(picked) // batch,
            kv_bytes_full=stock * len(picked) * bytes_per_token,
            method={name: pick(values) for name, values in cache.policy.report(layer.view).items()},
            kv_parts={name: count * len(picked) // batch for name, count in layer.nbytes_parts.items()},
        ))
    held = not cache.policy.keeps_everything
    return CacheReport(method=cache.policy.name, budget=str(cache.budget) if held else None,
                       min_tokens=cache.budget.min_tokens if held and cache.budget.ratio is not None else None,
                       layers=layers)
