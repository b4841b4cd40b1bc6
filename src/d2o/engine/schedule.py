"""When a cache compresses and what it evicts.

After every pass (a ``hold`` counts as one) sliding-window layers are brought back to their window;
at the first pass the policy compresses after, its probe passes run (if it probes), then
``allocate`` shares the budget's total among layers; every layer over its budget then asks the
policy for ``score`` and ``protected``. One token over (a decode step): the victim's slot is
emptied for the next token. More: the kept slots are gathered into smaller tensors. With
``evict_every=k`` the layers of a row run over their budgets until one reaches budget + k, then the
slots over are emptied where they are, every layer's merged in one call: the next k tokens' slots.

A prompt prefilled in chunks (``prefill``) is compressed after every chunk to the whole prompt's
budget, allocated anew after each chunk (its total from the whole prompt's length, its shares from
the statistics the layers hold then: the last chunk's allocation stays); every method compresses
then, those that compress once included, after its probe passes for that chunk (KVzip's) and, for a
method that scores with the question, a pass of the question (``QUESTION``), so that no chunk is
compressed without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from d2o.budget import UNLIMITED
from d2o.engine.api import Evicted, ProbePass
from d2o.engine.ragged import RaggedLayer
from d2o.engine.selection import select_evicted, select_kept, select_victim
from d2o.errors import D2OError
from d2o.options import whole


# A sliding-window layer's rule, the stock cache's: keep the newest tokens.
NEWEST = SimpleNamespace(merge=None, score=lambda layer: layer.token_index,
                         protected=lambda layer, target: torch.zeros_like(layer.token_index, dtype=torch.bool))


@dataclass
class Chunks:
    """A prefill in chunks running: each row's real tokens in the whole prompt (B,), the question
    pass shown after each chunk (or None), whether it is the prompt's own last tokens (then the last
    chunk holds it and shows it itself), and whether the chunk fed now is the last."""

    lengths: torch.Tensor
    question: ProbePass | None
    in_prompt: bool
    last: bool = False


class Schedule:
    """A cache's compression: its counters (passes, holds, when a row may be due) and decisions."""

    def __init__(self, cache, evict_every: int = 1):
        if not whole(evict_every) or evict_every < 1:
            raise D2OError(f"evict_every={evict_every!r} must be a whole number of steps >= 1")
        self.cache = cache
        self.evict_every = evict_every
        self.holds = 0
        self.restart()

    def restart(self) -> None:
        self.forwards = 0  # passes completed (a hold, or a prefill in chunks, counts as one)
        self.allocated = False
        self.quiet = self.seen_at_check = 0  # tokens fed before a row may be due; tokens seen when counted
        self.chunks: Chunks | None = None

    prefilling = property(lambda schedule: not schedule.allocated or schedule.chunks is not None)

    def prompt_lengths(self) -> torch.Tensor:
        """(B,) real tokens of each row's prompt: the whole one's while it comes in chunks."""
        return self.cache.layers[0].real_seen if self.chunks is None else self.chunks.lengths

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, question: ProbePass | None = None, in_prompt: bool = True,
                **kwargs):
        """Feed a prompt (B, S) (left-padded: ``attention_mask``) through ``model``, whole or ``prefill_chunk``
        tokens at a time, compressed after each chunk; ``question``, a pass the methods that score
        with a question see after each chunk: the prompt's own last tokens (``in_prompt``) or a
        question asked after it. One chunk per step: yields ``(output, done)`` after each, the
        model's output for that chunk and whether it was the last (closed early: the cache is left
        part-filled and not compressed, for nothing but to be dropped)."""
        length, chunk = input_ids.shape[1], self.cache.prefill_chunk or input_ids.shape[1]
        if length <= chunk and (question is None or in_prompt):
            yield model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        cache=self.cache, **kwargs), True
            return
        policy = self.cache.policy
        if policy.compress_after_forward > 1:
            raise D2OError(f"{policy.name} first compresses after the first decode step: it cannot compress a prompt "
                           f"in chunks, nor see a question after it")
        if self.cache.layers[0].is_initialized:
            raise D2OError("a prompt is prefilled in chunks into a new cache")
        lengths = attention_mask.sum(-1) if attention_mask is not None else \
            torch.full((input_ids.shape[0],), length, device=input_ids.device)
        self.chunks, forwards = Chunks(lengths, question if policy.question_tokens else None, in_prompt), self.forwards
        try:
            # The first chunk takes the remainder, so that every row's chunks end where they would
            # alone: its left padding moves no boundary.
            for end in range(length % chunk or chunk, length + 1, chunk):
                start = max(end - chunk, 0)
                self.chunks.last = end == length
                output = model(input_ids=input_ids[:, start:end], cache=self.cache,
                               attention_mask=None if attention_mask is None else attention_mask[:, :end],
                               position_ids=None if position_ids is None else position_ids[:, start:end], **kwargs)
                if end < length:
                    yield output, False
        finally:
            self.chunks = None
        self.forwards = forwards + 1
        self._observe_while_decoding()
        yield output, True

    def end_of_forward(self) -> None:
        if not self.holds:
            self.forwards += 1
            self.compress()

    def end_of_hold(self) -> None:
        self.forwards += 1  # the block was one pass (a prefill in chunks is one prefill)
        for layer in self.cache.layers:
            layer.carried_window = None
        # Compress in the mode the passes ran in: inference tensors are written in place only in it.
        first = self.cache.layers[0]
        with torch.inference_mode(first.is_initialized and first.token_index.is_inference()):
            self.compress()

    def compress(self) -> None:
        """Bring sliding-window layers back to their window, allocate budgets if it is time, and bring
        every other layer back to its budget."""
        if not self.cache.layers[0].is_initialized:
            return
        try:
            self._compress()
        finally:
            for layer in self.cache.layers:
                layer.settle()

    def _compress(self) -> None:
        cache, policy = self.cache, self.cache.policy
        windowed = [layer for layer in cache.layers if layer.window is not None]
        if windowed:
            kept = torch.stack([layer.n_kept for layer in windowed])  # (L, B)
            windows = torch.tensor([layer.window - 1 for layer in windowed], device=kept.device)
            self._shrink_layers(windowed, kept, torch.minimum(kept, windows[:, None]), NEWEST)
        chunks = self.chunks
        decoding = self.allocated and chunks is None
        if not self.allocated and chunks is None and self.forwards < policy.compress_after_forward:
            return
        if self.prefilling:
            self._probe()
            self._allocate()
        elif not policy.evicts_during_decode and chunks is None:
            return
        layers = [cache.layers[index] for index in cache.compressible]
        if not layers:  # every layer slides (the full cache of such a model)
            return
        seen = cache.layers[0].seen
        added, self.seen_at_check = seen - self.seen_at_check, seen
        if not self.may_evict_after(added):  # no row can have reached budget + evict_every yet
            self.quiet -= added
            return
        batched = decoding and self.evict_every > 1
        kept = torch.stack([layer.n_kept for layer in layers])
        limit = self.limit(torch.stack([layer.budget for layer in layers]),
                           torch.stack([layer.real_seen for layer in layers]))
        target = torch.where(limit == UNLIMITED, kept, torch.minimum(limit, kept))
        if batched:  # a row is brought back to its budgets when one of its layers reaches budget + evict_every
            over = (kept - target).amax(0)
            due = over >= self.evict_every
            # Each pass of one token raises a layer's excess by one at most (a floor can only lower it):
            # the passes until the next row is due need no count.
            self.quiet = self.evict_every - 1 - int(torch.where(due, 0, over).max())
            if not bool(due.any()):
                return
            target = torch.where(due, target, kept)
        self._shrink_layers(layers, kept, target, policy, in_place=batched)

    def may_evict_after(self, n_query: int) -> bool:
        """Whether the pass running (``n_query`` new tokens per row) may end in an eviction."""
        return not (self.allocated and self.chunks is None and self.evict_every > 1
                    and self.cache.policy.evicts_during_decode and n_query <= self.quiet)

    def _probe(self) -> None:
        """Before a compression of the prompt: the policy's probe passes (once; after every chunk of a
        prefill in chunks), and the question's where a chunk does not show it."""
        cache, chunks, prober = self.cache, self.chunks, self.cache.prober
        passes = []
        if cache.policy.probes and (chunks is not None or not prober.probed) and \
                any(layer.observing for layer in cache.layers):
            passes = prober.policy_passes(cache)
        if chunks is not None and chunks.question is not None and not (chunks.last and chunks.in_prompt):
            passes.append(chunks.question)
        if passes:
            prober.run(cache, passes)

    def _allocate(self) -> None:
        cache = self.cache
        prompt = self.prompt_lengths()
        if cache.budget.unlimited:
            budgets = torch.full((len(prompt), cache.n_layers), UNLIMITED, dtype=torch.long)
        else:
            layers = len(cache.compressible)
            totals = torch.tensor([cache.budget.total(layers, int(n)) for n in prompt.tolist()], dtype=torch.long)
            allocated = cache.policy.allocate(cache.view, totals)
            budgets = allocated.budgets
            for i, state in allocated.states.items():
                cache.layers[i].state = state
        for i, layer in enumerate(cache.layers):
            layer.budget = budgets[:, i].to(layer.device)
        self.allocated = True
        if self.chunks is None or self.chunks.last:  # final: what only the allocation read can go
            for layer in cache.layers:
                layer.apply_observed(cache.policy.once_allocated(layer.view))
        if self.chunks is None:
            self._observe_while_decoding()
        cache.prober.forget()

    def _observe_while_decoding(self) -> None:
        """Once the prompt is compressed, a layer collects statistics only if it can evict."""
        for layer in self.cache.layers:
            layer.observing = (layer.window is None and self.cache.policy.evicts_during_decode
                               and layer.budget is not None and bool((layer.budget != UNLIMITED).any()))

    def limit(self, budget: torch.Tensor, real_seen: torch.Tensor) -> torch.Tensor:
        """Budgets as they hold now: as allocated, never below a ratio budget's floor ``min(seen,
        min_tokens)`` (a row below it grows to it); UNLIMITED stays."""
        if self.cache.budget.ratio is None:
            return budget
        floor = real_seen.clamp_max(self.cache.budget.min_tokens)
        return torch.where(budget == UNLIMITED, budget, torch.maximum(budget, floor))

    def floor_decides(self, layer) -> torch.Tensor:
        """(B,) bool: the floor, not the share of the ratio, set the layer's budget."""
        budget = self.cache.budget
        if budget.ratio is None or layer.budget is None or self.cache.policy.keeps_everything:
            return torch.zeros_like(layer.real_seen, dtype=torch.bool)
        floor = layer.real_seen.clamp_max(budget.min_tokens)
        return (layer.budget != UNLIMITED) & (layer.budget <= floor)

    def _shrink_layers(self, layers: list, kept: torch.Tensor, target: torch.Tensor, chooser,
                       in_place: bool = False) -> None:
        """Bring each of ``layers`` from ``kept`` to ``target`` tokens per row ((L, B) each), keeping what
        ``chooser`` (the policy, or the window's rule) scores and protects, its merge folding in what
        left. A decode step's layers go to the merge in one call; a larger eviction (the prefill's) is
        merged layer by layer (one layer's copies held at a time). ``in_place``: evicting in batches
        of steps (a decode step's evicted slots are emptied where they are)."""
        excess = kept - target
        most, fewest = excess.amax(-1).tolist(), excess.amin(-1).tolist()
        merging, opened = [], []
        for layer, row_target, row_excess, n_most, n_fewest in zip(layers, target.unbind(), excess.unbind(), most,
                                                                     fewest):
            if n_most <= 0:
                continue
            # Evicted slots are emptied where they are only after a pass of one token (a decode step).
            in_step = in_place and layer.owns_storage and layer.written is not None
            if isinstance(layer, RaggedLayer) and self.chunks is None and self.allocated:
                # Decoding: every KV head evicts the row's excess, as in the even layout; the layer is
                # evicted from opened (its runs let go meanwhile; the step's pass may have left it so),
                # and closed once what left it is merged.
                opened.append((layer, layer.opened_instead()))
                layer, in_step = opened[-1][1], True
            evicted = self._shrink(layer, row_target, row_excess, n_most, n_fewest, chooser, in_step)
            if evicted is None:
                continue
            if n_most == 1 or in_step:  # a few tokens per layer: all layers' are merged together
                merging.append((layer, evicted))
            else:
                layer.apply_merged(chooser.merge.merge([layer.view], [evicted])[0])
                layer.settle()  # a quantized layer's full-precision copy goes before the next is made
        if merging:
            merged_layers, evicted = zip(*merging)
            results = chooser.merge.merge([layer.view for layer in merged_layers], list(evicted))
            for layer, merged in zip(merged_layers, results):
                layer.apply_merged(merged)
        for runs, layer in opened:
            runs.close(layer)

    def _shrink(self, layer, target: torch.Tensor, excess: torch.Tensor, most: int, fewest: int, chooser,
                in_place: bool = False) -> Evicted | None:
        """Bring ``layer`` down to ``target`` (B,) tokens per row, ``excess`` (B,) fewer than it holds
        (``most`` and ``fewest`` of them); returns copies of what left when a merge folds it in."""
        runs = layer if isinstance(layer, RaggedLayer) else None
        if runs is not None:  # a layer of runs is compressed opened, an ordinary layer (B, G, N)
            layer = runs.opened()
        scores, protected = chooser.score(layer.view), chooser.protected(layer.view, target)
        if scores.dtype != torch.float32:
            scores = scores.float()
        merge, policy = chooser.merge, self.cache.policy
        # Counts per KV head (after a prompt or a chunk): the layer is gathered into runs, however few leave.
        per_head = chooser is policy and policy.per_head_budgets and not in_place
        evicted = None
        if most == 1 and layer.owns_storage and not per_head:
            victim = select_victim(scores, protected, layer.token_index)
            if merge is not None:
                evicted = layer.evicted(victim, (excess > 0)[:, None], merge.reads, merge.vectors)
            layer.drop(victim, None if fewest == 1 else (excess > 0)[:, None])
        elif in_place and not per_head:  # the evicted slots are emptied where they are, for the next tokens to fill
            slots, valid = select_evicted(scores, protected, layer.token_index, excess)
            if merge is not None:
                evicted = layer.evicted(slots, valid, merge.reads, merge.vectors)
            layer.drop(slots, valid)
        else:  # a longer input was appended: the kept slots are gathered, k empty ones after them
            counts = held = None
            if per_head:  # shared among the heads anew
                held = layer.head_counts()
                counts = policy.head_targets(layer.view, scores, protected, target)
            keep, keep_valid = select_kept(scores, protected, layer.token_index, target if counts is None else counts)
            if merge is not None:
                gone = excess if counts is None else held - counts
                evicted = layer.evicted(*select_evicted(scores, protected, layer.token_index, gone), merge.reads,
                                        merge.vectors)
            if counts is not None:  # each KV head its own count: merged here, then held as a run of slots per head
                layer.keep(keep, keep_valid)
                if evicted is not None:
                    layer.apply_merged(merge.merge([layer.view], [evicted])[0])
                if runs is None:
                    self.cache.keep_per_head(layer)
                else:
                    runs.close(layer)
                return None
            # The layer is then as wide as it will be when decoding (budget + evict_every).
            batched = self.evict_every > 1 and chooser is policy and policy.evicts_during_decode and \
                (self.chunks is None or self.chunks.last)
            layer.keep(keep, keep_valid, slack=self.evict_every if batched else 0)
        return evicted
