"""D2O's token level compensation: evicted tokens merged into their most similar kept token.

For every evicted slot e (per KV head): its best cosine similarity m_e with a kept key (keys as
cached, after RoPE) and that kept slot c*(e). A threshold tau, one per layer and per row, follows
an exponential moving average of the mean best similarity of each eviction's tokens (first
value: that mean; then tau <- alpha * tau + (1 - alpha) * mean); e is merged into c*(e) when
m_e >= tau. Paper weights, for a kept c with merged set E_c (e = Euler's number):
    w_e = exp(m_e) / (sum_{E_c} exp(m_e') + e),  w_c = e / (sum_{E_c} exp(m_e') + e),
a convex combination applied to keys and values alike. tau lives in the cache layer, so it
starts afresh with every cache (the released code carries it from one prompt to the next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from d2o.engine.api import STATE_VALUE_BYTES, Evicted, Merged, RowState, as_dtype
from d2o.errors import D2OError
from d2o.methods.scoring import MASS, VOTES
from d2o.options import whole

SIMILARITY_ON = ("key", "value")
WEIGHTINGS = ("paper", "official", "normalized", "count", "attention")
ATTENTION_STATES = (VOTES, MASS)
DECISIONS = ("per_head", "mean_over_heads")
MERGES = "merges"  # slot state: evicted (token, KV head) pairs each kept slot has absorbed
NO_TARGET = -2.0  # the similarity of an evicted token with no slot allowed to absorb it
NORM_EPS = 1e-12  # as torch.nn.functional.normalize
CHUNK_ELEMENTS = 1 << 21  # similarities held at once (float32): 8 MB


@dataclass
class MergeState(RowState):
    """Per layer: the merge threshold of each row (NaN before its first eviction) and its history."""

    tau: torch.Tensor | None = None  # (B,)
    tau_history: list[torch.Tensor] = field(default_factory=list)  # (B,) per eviction; NaN: the row evicted none


@dataclass
class SimilarityMerge:
    """``on``: similarity of keys (paper's choice) or values; ``decision``: merge per KV head, or per
    token on its similarity averaged over heads (released code); ``weighting``, for a kept slot c
    absorbing the evicted tokens E_c, each e with best similarity m_e:
      - ``paper``: (e * c + sum exp(m_e) e) / (e + sum exp(m_e)) (convex, Euler's e for c itself);
      - ``official``: (c + sum m_e e) / (1 + |E_c|) (the released code; the vector shrinks);
      - ``normalized``: (c + sum m_e e) / (1 + sum m_e) (the released weights, made convex);
      - ``count``: each vector weighted by the number of tokens it stands for (a token-count mean);
      - ``attention``: each vector weighted by the attention it is expected to receive. A kept slot
        standing for n_c tokens that received attention a_c, absorbing e (n_e tokens, attention
        a_e), weighs n_c and e weighs min(n_e, n_c * a_e / a_c): a query that attends to c far more
        than to e (the one that retrieves c) is answered with c's value, not a blend. ``attention``
        names the slot state a is read from: ``votes``, the strongest look of the latest queries
        (kept by ``BlendedScores``: the best guess at the queries to come), or ``mass``, the
        accumulated attention per query that could see the token (kept by every attention score).

    Options beyond the paper (all off in ``d2o``): ``mass``, a slot standing for n tokens gets
    log n added to its attention logits (and statistics), so it receives the attention of n tokens;
    ``values_only``, the kept slot keeps its own key (RoPE-consistent) and only values merge;
    ``blend=False`` (with ``mass``), it keeps its value too and only its weight grows: the evicted
    tokens' attention goes to the kept slot's own value, so what a later query reads is never a
    mixture;
    ``max_merges``, a kept slot absorbs at most that many evicted tokens (the most similar first);
    ``skip_first``/``skip_newest``, the first tokens (attention sinks) and the newest ones (1: the
    current token) never absorb; ``min_distance``, a token is never merged into a slot within that
    many positions of it (it goes to its most similar slot further away, if that passes the
    threshold): a phrase is read forward one token at a time, each found by the one before, and
    two neighbouring words folded into one slot leave nothing to step to. Their keys are alike
    largely through RoPE's nearby positions, not their content, so without it most of what merges
    into a needle's kept words is its own evicted words."""

    alpha: float = 0.5
    on: str = "key"
    weighting: str = "paper"
    decision: str = "per_head"
    mass: bool = False
    values_only: bool = False
    blend: bool = True
    max_merges: int | None = None
    skip_first: int = 0
    skip_newest: int = 0
    min_distance: int = 0
    attention: str = VOTES

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise D2OError(f"alpha={self.alpha!r} must be in [0, 1]")
        for name, value, allowed in (("on", self.on, SIMILARITY_ON), ("weighting", self.weighting, WEIGHTINGS),
                                     ("decision", self.decision, DECISIONS), ("attention", self.attention,
                                                                               ATTENTION_STATES)):
            if value not in allowed:
                raise D2OError(f"{name}={value!r} must be one of {', '.join(allowed)}")
        if self.max_merges is not None and (not whole(self.max_merges) or self.max_merges < 0):
            raise D2OError(f"max_merges={self.max_merges!r} must be a whole number >= 0 (or None: no cap)")
        for name in ("skip_first", "skip_newest", "min_distance"):
            value = getattr(self, name)
            if not whole(value) or value < 0:
                raise D2OError(f"{name}={value!r} must be a whole number >= 0")
        for name in ("mass", "values_only", "blend"):
            if not isinstance(getattr(self, name), bool):
                raise D2OError(f"{name}={getattr(self, name)!r} must be true or false")
        if not self.blend and not self.mass:
            raise D2OError("blend=False keeps the kept slots' vectors as they are: without mass=True a merge "
                           "would change nothing")

    uneven_heads: ClassVar[bool] = True  # it folds evictions whose count differs per KV head
    changes_vectors = property(lambda merge: merge.blend, doc="Without blending, only the kept slots' weights.")

    @property
    def reads(self) -> tuple[str, ...]:
        """The slot state of evicted tokens the merge reads: what weighs them by attention."""
        return (self.attention,) if self.weighting == "attention" else ()

    @property
    def vectors(self) -> tuple[str, ...]:
        """The vectors of evicted tokens it reads: those it compares, and those it blends in."""
        read = {f"{self.on}s"}
        if self.blend:
            read |= {"values"} if self.values_only else {"keys", "values"}
        return tuple(part for part in ("keys", "values") if part in read)

    def new_state(self) -> MergeState:
        return MergeState()

    @property
    def counts_tokens(self) -> bool:
        """Whether it reads how many tokens each slot stands for (the layer's log weight, made on
        its first merge; only ``mass`` raises it above one)."""
        return self.weighting in ("count", "attention") or self.mass

    def slot_state_bytes(self, group: int) -> int:
        """Each slot's merge count (int32) and, if it counts tokens, its log weight (float32)."""
        return STATE_VALUE_BYTES * (1 + self.counts_tokens)

    def report(self, layer) -> dict[str, list]:
        """Per row: its threshold at each eviction, and the most evicted tokens one slot absorbed."""
        history = torch.stack(layer.state.tau_history, dim=1).tolist() if layer.state.tau_history else None
        rows = layer.merged.shape[0]
        taus = [[t for t in row if t == t] for row in history] if history else [[] for _ in range(rows)]
        merges = layer.slot_state.get(MERGES)
        most = merges.flatten(1).amax(-1).tolist() if merges is not None and merges.numel() else [0] * rows
        return {"tau": taus, "most_merges_in_a_slot": most}

    def merge(self, layers: list, evicted: list[Evicted]) -> list[Merged]:
        """Fold each layer's evicted tokens into its kept slots. Layers evicting as many tokens per
        row (every layer of a decode step: one) are decided together, their rows stacked as one
        batch: the rule is per row, so only the number of tensor operations changes."""
        merged: list[Merged | None] = [None] * len(layers)
        widths: dict[int, list[int]] = {}
        for i, gone in enumerate(evicted):
            widths.setdefault(gone.token_index.shape[-1], []).append(i)
        for width, members in widths.items():
            if width == 0:
                for i in members:
                    merged[i] = Merged(torch.zeros(layers[i].token_index.shape[0], dtype=torch.long,
                                                   device=layers[i].device))
                continue
            for i, result in zip(members, self._merge_stacked([layers[i] for i in members],
                                                              [evicted[i] for i in members])):
                merged[i] = result
        return merged

    def _merge_stacked(self, layers: list, evicted: list[Evicted]) -> list[Merged]:
        """``merge`` for layers that evict E tokens per row and KV head each, rows of all stacked."""
        batch = evicted[0].token_index.shape[0]
        rows = [slice(i * batch, (i + 1) * batch) for i in range(len(layers))]

        on = "keys" if self.on == "key" else "values"
        sources = as_dtype(_stack([getattr(gone, on) for gone in evicted]), torch.float32)
        sources = torch.nn.functional.normalize(sources, dim=-1)
        similar = [most_similar(normalized, layer.vector_parts(on), self._barred(layer),
                                self._near(layer, lost) if self.min_distance else None)
                   for layer, lost, normalized in zip(layers, evicted, sources.split(batch))]
        best, target = _stack([b for b, _ in similar]), _stack([t for _, t in similar])  # (L*B, G, E)
        valid = _stack([gone.valid for gone in evicted])  # (L*B, E), or (L*B, G, E) where heads evict unevenly
        gone = valid if valid.dim() == 3 else valid[:, None, :]
        if self.skip_first or self.skip_newest or self.min_distance:  # no slot left to absorb it: just dropped
            gone = gone & (best > NO_TARGET)

        # One threshold per row: EMA of the mean best similarity over heads and evicted tokens; a row
        # that evicted nothing keeps its threshold.
        count = gone.expand_as(best).sum((1, 2))  # per head: a token may have a slot in one head, none in another
        mean_best = (best * gone).sum((1, 2)) / count.clamp_min(1)
        previous = _stack([layer.state.tau if layer.state.tau is not None else mean_best.new_full((batch,), math.nan)
                          for layer in layers])
        ema = self.alpha * previous + (1 - self.alpha) * mean_best
        tau = torch.where(previous.isnan(), mean_best, ema)
        evicting = count > 0
        history = torch.where(evicting, tau, math.nan)
        tau = torch.where(evicting, tau, previous)

        if self.decision == "per_head":
            merged = (best >= tau[:, None, None]) & gone
        else:
            merged = ((best * gone).mean(1, keepdim=True) >= tau[:, None, None]) & gone
            merged = merged.expand_as(best)
        absorbed = [layer.slot_state.get(MERGES) for layer in layers]
        absorbed = [torch.zeros(layer.token_index.shape, dtype=torch.int32, device=layer.device) if slots is None
                    else slots.clone() for layer, slots in zip(layers, absorbed)]
        if self.max_merges is not None:
            already = _stack([slots.gather(2, target[row]) for slots, row in zip(absorbed, rows)])
            merged = merged & (already + rank_within_target(target, merged, best) < self.max_merges)
        results = self._fold(layers, evicted, rows, best, target, merged)
        for result, layer, slots, row_target, row_merged, row_tau, row_history, count in zip(
                results, layers, absorbed, target.split(batch), merged.int().split(batch), tau.split(batch),
                history.split(batch), merged.sum((1, 2)).split(batch)):
            result.count = count
            result.slot_state[MERGES] = slots.scatter_add_(2, row_target, row_merged)
            result.state = replace(layer.state, tau=row_tau, tau_history=[*layer.state.tau_history, row_history])
        return results

    def _barred(self, layer) -> torch.Tensor:
        """(B, G, N) bool: the slots that may not absorb evicted tokens: empty ones (index -1), the
        first ``skip_first`` tokens, the newest ``skip_newest``."""
        barred = layer.token_index < self.skip_first if self.skip_first else layer.token_index < 0
        if self.skip_newest:
            barred = barred | (layer.token_index >= (layer.real_seen - self.skip_newest)[:, None, None])
        return barred

    def _near(self, layer, evicted: Evicted):
        """The kept slots within ``min_distance`` positions of each evicted token, as a function of a
        slice of the evicted tokens ((B, G, e, N) bool), so that no (E, N) matrix is held whole."""
        kept = layer.token_index[:, :, None, :]

        def near(part: slice) -> torch.Tensor:
            # Two comparisons with the window's ends: an (e, N) matrix of differences and its absolute
            # value, in the index's integers, cost a prefill's compression more than its similarities.
            index = evicted.token_index[:, :, part, None]
            return (kept >= index - self.min_distance) & (kept <= index + self.min_distance)
        return near

    def _fold(self, layers: list, evicted: list[Evicted], rows: list[slice], best, target, merged) -> list[Merged]:
        """The merged vectors (unless ``blend`` is off) and, with ``mass``, the slots' new weights, per layer.

        A kept slot c receiving tokens becomes (w_c * c + sum_e w_e * e) / (d_c + sum_e d_e), with the
        weights w and denominators d of ``weighting``; the others are left exactly as they are. The
        weights are computed for the stacked rows of all ``layers`` at once (``rows``: each one's).
        """
        results = [Merged(count=None) for _ in layers]
        if self.counts_tokens:  # tokens each kept target and each evicted token stands for
            weights = [layer.weights() for layer in layers]
            kept_count = _stack([weight.gather(2, target[row]) for weight, row in zip(weights, rows)]).exp()
            gone_count = _stack([gone.log_weight.exp() if gone.log_weight is not None else torch.ones_like(best[row])
                                for gone, row in zip(evicted, rows)])
            for result, layer, weight in zip(results, layers, weights):
                if layer.log_weight is None:  # a slot's token count, one each, from now on kept
                    result.log_weight = weight
        if self.weighting == "paper":
            self_weight, source_weight = math.e, best.exp()
        elif self.weighting == "count":
            self_weight, source_weight = kept_count, gone_count
        elif self.weighting == "attention":
            kept_attention = _stack([self._attention(layer.slot_state, layer.token_index, layer.real_seen)
                                    .gather(2, target[row]) for layer, row in zip(layers, rows)])
            gone_attention = _stack([self._attention(gone.slot_state, gone.token_index, layer.real_seen)
                                    for layer, gone in zip(layers, evicted)])
            expected = kept_count * gone_attention / kept_attention.clamp_min(NORM_EPS)
            self_weight, source_weight = kept_count, torch.minimum(gone_count, expected)
        else:
            self_weight, source_weight = 1.0, best
        source_weight = torch.where(merged, source_weight, 0.0)
        counts = merged.float() if self.weighting == "official" else source_weight
        parts = ("values",) if self.values_only else ("keys", "values")
        if self.blend and target.shape[-1] == 1:  # a decode step: at most one evicted token per row and head
            # As shares of the denominator: a slot that absorbs nothing keeps exactly 1 x itself + 0.
            denominator = self_weight + counts
            own_share, source_share = (self_weight / denominator)[..., None], (source_weight / denominator)[..., None]
            for part in parts:
                current = _stack([layer.vectors_at(part, target[row]) for layer, row in zip(layers, rows)])
                dtype, current = current.dtype, as_dtype(current, torch.float32)
                sources = as_dtype(_stack([getattr(gone, part) for gone in evicted]), torch.float32)
                blended = torch.addcmul(current * own_share, sources, source_share).to(dtype)
                for result, row in zip(results, rows):
                    setattr(result, part, blended[row])
            for result, row in zip(results, rows):
                result.slots, result.changed = target[row], merged[row]
        elif self.blend:
            for result, layer, gone, row in zip(results, layers, evicted, rows):
                folded, result.changed = self._fold_many(layer, gone, target[row], merged[row], source_weight[row],
                                                         counts[row], parts)
                for part, vectors in folded.items():
                    setattr(result, part, vectors)
        if self.mass:  # a slot's weight: the tokens it now stands for (as much of them as its attention says)
            stands_for = torch.where(merged, source_weight if self.weighting == "attention" else gone_count, 0.0)
            for result, weight, row in zip(results, weights, rows):
                added = torch.zeros_like(weight).scatter_add_(2, target[row], stands_for[row])
                result.log_weight = torch.where(added > 0, (weight.exp() + added).log(), weight)
        return results

    def _fold_many(self, layer, evicted: Evicted, target, merged, source_weight, counts,
                   parts: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The fold of one layer evicting several tokens per row and head (several may share a
        target): the new ``parts`` of every slot, and (B, G, N) how many tokens each received."""
        keys = layer.keys
        received = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
        received.scatter_add_(2, target, merged.int())
        if self.weighting == "paper":
            own = torch.full(keys.shape[:3], math.e, device=keys.device)
        elif self.weighting in ("count", "attention"):
            own = layer.weights().exp()
        else:
            own = torch.full(keys.shape[:3], 1.0, device=keys.device)
        denominator = own.clone().scatter_add_(2, target, counts)
        folded = {}
        for part in parts:
            kept, sources = getattr(layer, part), getattr(evicted, part)
            numerator = kept.float() * own[..., None]
            contribution = sources.float() * source_weight[..., None]
            numerator.scatter_add_(2, target[..., None].expand_as(contribution), contribution)
            folded[part] = as_dtype(torch.where(received[..., None] > 0, numerator / denominator[..., None],
                                                kept.float()), kept.dtype)
        return folded, received

    def _attention(self, slot_state: dict, token_index: torch.Tensor, real_seen: torch.Tensor) -> torch.Tensor:
        """(B, G, n) the attention the slots of ``slot_state`` received, as ``attention`` says."""
        if self.attention not in slot_state:
            raise D2OError(f"weighting='attention' reads the attention each slot received from its slot state "
                           f"{self.attention!r}, which this method's scoring does not keep")
        if self.attention == VOTES:
            return slot_state[VOTES].float()
        queries_seen = (real_seen[:, None, None] - token_index).clamp_min(1)
        return slot_state[MASS].float().sum(-1) / queries_seen


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer tensors (B, ...) as the rows of one (L * B, ...)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rank_within_target(target: torch.Tensor, merged: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """(B, G, E): for each evicted token, how many merged tokens bound for the same kept slot are
    more similar to it (ties: the earlier in the list) - its place in that slot's queue."""
    order = (target.double() * 4 - best.double().clamp(-1, 1)).argsort(dim=-1, stable=True)  # by slot, best first
    slots, chosen = target.gather(-1, order), merged.gather(-1, order).long()
    position = torch.arange(slots.shape[-1], device=slots.device).expand_as(slots)
    starts = torch.ones_like(slots, dtype=torch.bool)
    starts[..., 1:] = slots[..., 1:] != slots[..., :-1]
    group_start = torch.where(starts, position, 0).cummax(-1).values
    before = chosen.cumsum(-1) - chosen
    rank = before - before.gather(-1, group_start)
    return torch.empty_like(rank).scatter_(-1, order, rank)


def most_similar(sources: torch.Tensor, targets: tuple[torch.Tensor, ...], barred: torch.Tensor, near=None):
    """Best cosine similarity of each source (B, G, E, D), normalised already, with a target that
    is not ``barred`` (per KV head, (B, G, K)), nor marked by ``near(part)`` (if given: (B, G, e, K)
    for the sources of the slice ``part`` of E), and its index. The K targets come in parts one
    after another (``LayerView.vector_parts``), each (B, G, k, D), or (1, G, k, D) for every row.

    The targets are the whole kept cache, at every decode step: their dot products with the
    sources are divided by their norms rather than normalising them, so they are read twice and
    never copied; a part shared by every row is multiplied by all rows' sources at once."""
    parts = [as_dtype(part, torch.float32) for part in targets]
    scales = [torch.linalg.vector_norm(part, dim=-1).clamp_min_(NORM_EPS).reciprocal_()[:, :, None, :]
              for part in parts]
    transposed = [part.transpose(-1, -2) for part in parts]
    barred = barred[:, :, None, :]  # scored NO_TARGET: below any cosine similarity
    batch, heads, n_sources, _ = sources.shape
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * barred.shape[-1]))
    best, index = [], []
    for start in range(0, max(n_sources, 1), chunk):
        part = slice(start, min(start + chunk, n_sources))
        products = [_dots(sources[:, :, part], part_t).mul_(scale) for part_t, scale in zip(transposed, scales)]
        similarity = products[0] if len(products) == 1 else torch.cat(products, dim=-1)
        similarity.masked_fill_(barred, NO_TARGET)
        if near is not None:
            similarity.masked_fill_(near(part), NO_TARGET)
        values, indices = similarity.max(dim=-1)
        best.append(values)
        index.append(indices)
    if len(best) == 1:
        return best[0], index[0]
    return torch.cat(best, dim=-1), torch.cat(index, dim=-1)


def _dots(sources: torch.Tensor, targets_t: torch.Tensor) -> torch.Tensor:
    """(B, G, e, k): ``sources`` (B, G, e, D) times ``targets_t`` (B, G, D, k), or (1, G, D, k) for
    every row: then one product per KV head of all rows' sources (broadcasting would copy the
    targets for each row)."""
    batch, heads, count, dim = sources.shape
    if targets_t.shape[0] == batch:
        return torch.matmul(sources, targets_t)
    stacked = sources.transpose(0, 1).reshape(heads, batch * count, dim)
    return torch.bmm(stacked, targets_t[0]).view(heads, batch, count, -1).transpose(0, 1)
