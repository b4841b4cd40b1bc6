"""Layer-level allocation: how a total KV budget is shared among layers.

An allocation gives each layer a non-negative weight (per row of the batch); ``conserve`` turns
weights into integer budgets proportional to them, clamped to [lower, upper] with what a clamp
cuts off redistributed to the unclamped layers, so the total is met exactly and every method is
compared at the same memory. Strategies: uniform (H2O, SnapKV...), pyramid (PyramidKV),
exponential decay over depth, and D2O's inverse-variance softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from d2o.engine.api import CacheView
from d2o.errors import D2OError


class Allocation:
    """Base: equal weights. Subclasses override ``layer_weights``."""

    def weights(self, cache: CacheView, layers: list[int], totals: torch.Tensor, method) -> torch.Tensor:
        """(B, len(layers)) non-negative weights of the compressed ``layers``, which share
        ``totals`` (B,) tokens under ``method``."""
        batch = cache.layers[0].real_seen.shape[0]
        return self.layer_weights(len(layers)).double().expand(batch, -1)

    def layer_weights(self, n_layers: int) -> torch.Tensor:
        return torch.ones(n_layers)

    def lower(self, prompt_tokens: int) -> int:
        """Smallest budget of a layer for a prompt of ``prompt_tokens`` (the method's own minimum aside)."""
        return 0


@dataclass
class Uniform(Allocation):
    """The same budget in every layer."""


@dataclass
class Pyramid(Allocation):
    """PyramidKV (Cai et al. 2024): budgets fall linearly with depth, keeping the mean.

    The deepest layer gets ``1/beta`` of the mean and the first ``2 - 1/beta`` (beta = 20 in the paper).
    """

    beta: float = 20.0

    def __post_init__(self):
        if self.beta < 1:
            raise D2OError(f"beta={self.beta!r} must be >= 1 (the deepest layer gets 1/beta of the mean)")

    def layer_weights(self, n_layers: int) -> torch.Tensor:
        low = 1.0 / self.beta
        return torch.linspace(2.0 - low, low, n_layers) if n_layers > 1 else torch.ones(1)


@dataclass
class ExponentialDecay(Allocation):
    """Budgets proportional to exp(-rate * depth), depth from 0 (first layer) to 1 (last)."""

    rate: float = 2.0

    def __post_init__(self):
        if self.rate < 0:
            raise D2OError(f"rate={self.rate!r} must be >= 0")

    def layer_weights(self, n_layers: int) -> torch.Tensor:
        return torch.exp(-self.rate * torch.linspace(0.0, 1.0, n_layers))


@dataclass
class InverseVariance(Allocation):
    """D2O's layer level: weights softmax(-F_l), F_l the layer's attention density statistic.

    Per query head h, v_h is the variance over the prompt's tokens of the attention they received
    (column mass); v is min-max normalised over the layer's heads and F_l is its mean, in [0, 1).
    Dense layers (low F) get more cache. Reads the ``mass`` slot state that attention-accumulating
    methods keep; ``r_min`` is the smallest share of the prompt a layer keeps.
    """

    r_min: float = 0.01

    def __post_init__(self):
        if not 0.0 <= self.r_min < 1.0:
            raise D2OError(f"r_min={self.r_min!r} must be in [0, 1)")

    def weights(self, cache: CacheView, layers: list[int], totals: torch.Tensor, method) -> torch.Tensor:
        density = torch.stack([layer_density(cache.layers[i]) for i in layers], dim=-1)
        return torch.softmax(-density.double(), dim=-1)

    def lower(self, prompt_tokens: int) -> int:
        return math.floor(self.r_min * prompt_tokens)


@dataclass
class ScoreShare(Allocation):
    """KVzip's: one threshold over every layer's scores. Each layer's weight is how many of the
    row's ``totals x kv_heads`` highest (token, KV head) scores of the method are its own, so a
    layer whose tokens score high keeps more. KVzip lets each KV head keep its own count; here the
    KV heads of a layer share the layer's count evenly, or by ``head_counts`` (``heads=adaptive``)."""

    def weights(self, cache: CacheView, layers: list[int], totals: torch.Tensor, method) -> torch.Tensor:
        held = [method.score(cache.layers[i]).float().masked_fill(~cache.layers[i].valid, -math.inf) for i in layers]
        width = max(scores.shape[-1] for scores in held)  # layers a prefill in chunks compressed differ
        scores = torch.stack([F.pad(part, (0, width - part.shape[-1]), value=-math.inf) for part in held], dim=1)
        batch, n_layers = scores.shape[:2]  # (B, L, G, N)
        per_layer = scores[0, 0].numel()
        counts = torch.zeros((batch, n_layers), dtype=torch.float64)
        for row, total in enumerate(totals.tolist()):
            kept = min(max(int(total), 0) * scores.shape[2], int(torch.isfinite(scores[row]).sum()))
            top = scores[row].flatten().topk(kept).indices
            counts[row] = torch.bincount(top // per_layer, minlength=n_layers).double().cpu()
        return counts


def head_counts(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
                floor: float) -> torch.Tensor:
    """AdaKV's allocation within a layer (Feng et al., "Ada-KV", arXiv 2407.11550): of each row's
    ``target x G`` (token, KV head) pairs, every KV head first keeps its ``floor x target`` best (the
    safeguard), and the rest go to the best scores over all the layer's heads, protected slots
    first. ``scores``, ``protected``, ``valid`` (B, G, N); ``target`` (B,). Returns (B, G) counts
    summing to ``target x G``, none above a head's valid slots."""
    batch, heads, n_slots = scores.shape
    ranked = scores.float().masked_fill(protected, math.inf).masked_fill(~valid, -math.inf)
    ordered = ranked.sort(dim=-1, descending=True).values
    minimum = torch.minimum((target * floor).floor().long()[:, None], valid.sum(-1))  # (B, G)
    rest = ordered.masked_fill(torch.arange(n_slots, device=scores.device) < minimum[..., None], -math.inf)
    left = (target * heads - minimum.sum(-1)).clamp_min(0)  # (B,)
    width = min(int(left.max()), heads * n_slots)
    if width == 0:
        return minimum
    best = rest.flatten(1).topk(width, dim=-1)
    chosen = (torch.arange(width, device=scores.device) < left[:, None]) & (best.values > -math.inf)
    return minimum.scatter_add(1, best.indices // n_slots, chosen.long())


def allocation_named(name: str) -> Allocation:
    """An allocation strategy by name: uniform, pyramid, expdecay, variance (D2O's) or scores (KVzip's)."""
    strategies = {"uniform": Uniform, "pyramid": Pyramid, "expdecay": ExponentialDecay, "variance": InverseVariance,
                  "scores": ScoreShare}
    if name not in strategies:
        raise D2OError(f"allocation={name!r} must be one of {', '.join(strategies)}")
    return strategies[name]()


def layer_density(layer, mass: torch.Tensor | None = None) -> torch.Tensor:
    """F_l per row (B,): mean over query heads of the min-max normalised variance of column mass
    (the layer's slot state ``mass``, or ``mass`` if given)."""
    mass = layer.slot_state.get("mass") if mass is None else mass
    if mass is None:
        raise D2OError("inverse-variance allocation needs a method that accumulates attention (h2o, d2o, cam)")
    valid = layer.valid[..., None].to(mass.dtype)  # (B, G, N, 1)
    count = valid.sum(2).clamp_min(2)
    mean = (mass * valid).sum(2) / count
    variance = (((mass - mean[:, :, None]) * valid) ** 2).sum(2) / (count - 1)  # (B, G, group)
    variance = variance.flatten(1)  # (B, H)
    low, high = variance.amin(-1, keepdim=True), variance.amax(-1, keepdim=True)
    return ((variance - low) / (high - low + 1e-6)).mean(-1)


def conserve(weights: torch.Tensor, total: int, lower: int, upper: int | None) -> list[int]:
    """Integer budgets proportional to ``weights`` within [lower, upper], summing to ``total``.

    The shares are clamp(scale * weight, lower, upper) with the one ``scale`` that makes them sum
    to ``total`` (found by bisection: the sum grows with the scale), so what a clamp cuts off goes
    to the unclamped layers in proportion; largest-remainder rounding then meets ``total`` exactly.
    """
    n = len(weights)
    weights = weights.double().clamp_min(0)
    if not weights.sum() > 0:
        weights = torch.ones_like(weights)
    # A zero weight would never grow; a tiny one lets such a layer take what the others cannot hold.
    weights = weights.clamp_min(weights.max().item() * 1e-9)
    if total < n * lower or (upper is not None and total > n * upper):
        raise D2OError(f"cannot share {total} tokens among {n} layers with {lower} to {upper} each")
    ceiling = float("inf") if upper is None else float(upper)

    def shares(scale: float) -> torch.Tensor:
        return (weights * scale).clamp(float(lower), ceiling)

    low, high = 0.0, 1.0
    while shares(high).sum().item() < total:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        low, high = (middle, high) if shares(middle).sum().item() < total else (low, middle)
    exact = shares(high)
    budgets = exact.floor()
    missing = int(round(total - budgets.sum().item()))
    fraction = exact - budgets
    fraction[budgets >= ceiling] = -1.0  # a pinned layer cannot take another token
    if missing > 0:
        budgets[fraction.topk(missing).indices] += 1
    return [int(b) for b in budgets.tolist()]
