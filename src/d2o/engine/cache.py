"""A compressed KV cache for transformers: a list of ``CompressedLayer`` run by one ``Policy``.

The cache knows nothing about a particular method. After every forward pass it asks its policy
for layer budgets (once) and, for every layer over its budget, for token scores, the slots that
must stay, and optionally how to merge what is evicted (see ``policy``); ``selection`` turns the
answers into slot indices and the layer gathers the kept slots into smaller tensors.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from contextlib import contextmanager
from functools import lru_cache

import torch
from transformers.cache_utils import Cache

from d2o.budget import UNLIMITED, Budget
from d2o.engine.policy import Evicted, Policy, ProbePass
from d2o.engine.quantization import KVQuantization
from d2o.engine.quantized import QuantizedLayer
from d2o.engine.report import CacheReport, LayerReport
from d2o.engine.selection import evicted_slots, select_evicted, select_kept, select_victim
from d2o.engine.stats import token_surprisal
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError
from d2o.options import whole


class _Newest:
    """A sliding-window layer's rule, the stock cache's: keep the newest tokens."""

    merge = None

    @staticmethod
    def score(layer: CompressedLayer) -> torch.Tensor:
        return layer.token_index

    @staticmethod
    def protected(layer: CompressedLayer, target: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(layer.token_index, dtype=torch.bool)


NEWEST = _Newest()


def sliding_windows(config) -> list[int | None]:
    """Per layer: its sliding window, or None for a layer that attends to every token (the layers
    a budget shares). Hybrid models (Gemma 3) name each layer's kind in ``layer_types``; a config
    without them slides in every layer when it has a ``sliding_window`` (Mistral 7B v0.1), as
    transformers reads it (its attention masks so, and its own cache keeps the window)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or \
        ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" and window else None for kind in kinds]


def head_dim(config) -> int:
    """Channels per attention head of a (text) config: its ``head_dim``, or the hidden size shared."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def compressible_layers(windows: list[int | None], budget: Budget) -> list[int]:
    """The layers a budget shares: those attending to every token (a sliding-window layer keeps its
    window, as the stock cache does). A model whose every layer slides has none to compress."""
    layers = [i for i, window in enumerate(windows) if window is None]
    if not layers and not budget.unlimited:
        raise D2OError(f"every layer of this model attends over a sliding window of {windows[0]} tokens, so its "
                       f"cache is bounded by the window already; d2o's methods compress full-attention layers, and "
                       f"it has none (within the window, the same model with sliding_window=None attends alike)")
    return layers


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses each layer to the budget its policy allocates.

    Use it wherever transformers takes a cache, on a model whose attention runs through d2o's
    hook (``d2o.install(model)``; ``d2o.load_model`` does it)::

        cache = CompressedCache(model, d2o.get_method("d2o"), budget=0.2)
        model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cache.report().table())

    Compression runs at the end of every forward pass: the first one that the policy compresses
    after (the prefill, by default) fixes each layer's budget; from then on a layer over its
    budget (one new token per decode step, or a multi-token input such as an appended question)
    is brought back to it, unless the policy keeps its cache after the first compression.
    ``with cache.hold(): ...`` defers compression (a chunked prefill scored as a whole).
    """

    def __init__(self, model, policy: Policy, budget: Budget | str | float = 0.2, observe: bool | None = None,
                 tokenizer=None, evict_every: int = 1, kv_bits: int | KVQuantization | None = None):
        """``observe``: compute the policy's statistics even under a budget that never evicts (a
        prefill that forks will share); by default only when something can be evicted, so that a
        budget of 1 runs the stock kernels alone. ``tokenizer``: the model's, for a method that
        writes text of its own into a probe (KVzip's "Repeat the previous context"); by default the
        one saved with the model (``config.name_or_path``). ``evict_every``: during decoding, a layer
        runs up to ``evict_every - 1`` tokens over its budget and is brought back to it, in one
        pass, when a row reaches budget + ``evict_every`` (1: at every step). ``kv_bits``: store keys
        and values at 8, 4 or 2 bits (or as a ``KVQuantization``, with its group size and residual);
        None: in the model's dtype."""
        if isinstance(policy, str):
            raise D2OError(f"CompressedCache takes a method object, not the name {policy!r}: "
                           f"d2o.get_method({policy!r}) builds one")
        # A weak reference: a cache must not keep its model alive, nor be deep-copied with it.
        self._decoder = weakref.ref(model.get_decoder())
        self._tokenizer = tokenizer
        self._setup(model.config.get_text_config(), policy, budget, observe, evict_every, kv_bits)

    def _setup(self, config, policy: Policy, budget, observe: bool | None = None, evict_every: int = 1,
               kv_bits: int | KVQuantization | None = None) -> None:
        if not whole(evict_every) or evict_every < 1:
            raise D2OError(f"evict_every={evict_every!r} must be a whole number of steps >= 1")
        self.evict_every = evict_every
        self.quantization = KVQuantization.of(kv_bits)
        self.config = config
        self.policy = policy
        self.budget = policy.budget_for(Budget.parse(budget))
        self.n_layers = config.num_hidden_layers
        groups = config.num_attention_heads // config.num_key_value_heads
        self.kv_repeats = groups if policy.repeats_kv_heads else 1
        windows = sliding_windows(config)
        self.compressible = compressible_layers(windows, self.budget)
        if self.quantization is not None:
            self.quantization.check(head_dim(config))
            layers = [QuantizedLayer(self, i, window, self.quantization) for i, window in enumerate(windows)]
        else:
            layers = [CompressedLayer(self, i, window) for i, window in enumerate(windows)]
        super().__init__(layers=layers)
        self._observe = observe
        self._start_observing()
        self.forwards = 0
        self.allocated = False
        self._holds = 0
        # Decoding in batches of steps: the tokens that can still be fed before a row may be due, and
        # the tokens seen (padding included) when that was counted.
        self._quiet = 0
        self._seen_at_check = 0
        self._last_hidden = None  # the last real token's final hidden state (for surprisal)
        self._last_logits = None  # (hidden, logits): the model's logits from those hidden states
        self._start_probing()

    def _start_probing(self) -> None:
        self.probing: ProbePass | None = None  # the probe pass running now
        self.probed = False  # the policy's probe passes ran (they run once, before the first compression)
        self._prompt: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, real) of each pass before it

    def fork(self, policy: Policy, budget, slot_prefix: str = "", state_of=None,
             evict_every: int = 1, kv_bits: int | KVQuantization | None = None) -> CompressedCache:
        """A cache for ``policy`` at ``budget`` continuing from this one's tokens, compressed now if
        it is time. Key/value tensors are shared (compression writes new tensors, never into old
        ones); the slot state under ``slot_prefix`` becomes the new cache's own (copied, since
        methods accumulate into it), and so does, per layer, ``state_of(layer)`` if given (a copy:
        what the policy kept of the prefill in its ``RowState``). The source must hold every token
        (budget 1.0): what a compressed cache has made of its tokens (merged slots' weights,
        thresholds, budgets) is the method's own and does not carry over."""
        if not self.budget.unlimited:
            raise D2OError(f"only a cache that holds every token (budget 1.0) can be forked; this one's budget is "
                           f"{self.budget}")
        new = CompressedCache.__new__(CompressedCache)
        new._decoder, new._tokenizer = self._decoder, self._tokenizer
        new._setup(self.config, policy, budget, evict_every=evict_every, kv_bits=kv_bits)
        new.probed = self.probed  # a policy combining the methods ran each one's probe into its slot state
        if new.kv_repeats != self.kv_repeats:
            raise D2OError(f"{policy.name} stores KV heads differently: it cannot share another method's prefill")
        new.forwards = self.forwards
        new._last_hidden, new._last_logits = self._last_hidden, self._last_logits
        for mine, theirs in zip(self.layers, new.layers):
            if not mine.is_initialized:
                continue
            keys, values = mine.attended()
            theirs.lazy_initialization(keys, values)
            theirs.adopt(keys, values)
            mine.settle()
            theirs.token_index = mine.token_index
            theirs.seen, theirs.real_seen = mine.seen, mine.real_seen
            mine.owns_storage = theirs.owns_storage = False
            theirs.slot_state = {
                name[len(slot_prefix):]: state.clone()
                for name, state in mine.slot_state.items()
                if name.startswith(slot_prefix)
            }
            if state_of is not None:
                own = state_of(mine)
                theirs.state = None if own is None else own.map_rows(torch.clone)
        new.compress()
        return new

    def copy(self) -> CompressedCache:
        """A cache in this one's state that goes on alone (another question after one compressed
        context). Key/value tensors and token indices are shared, and from now on neither cache
        writes into them in place (each writes new tensors, as after a fork); everything a policy
        accumulates into (slot state, log weights, row state, counts) is copied."""
        new = copy.copy(self)
        new._prompt = list(self._prompt)
        new.layers = [layer.copy_for(new) for layer in self.layers]
        return new

    # -- rows ---------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        first = self.layers[0]
        return first.token_index.shape[0] if first.is_initialized else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) the rows ``index`` (1-D): finished requests leave a batch."""
        for layer in self.layers:
            layer.select_rows(index)
        if self._last_hidden is not None:
            self._last_hidden = self._last_hidden[torch.as_tensor(index, device=self._last_hidden.device)]

    def why_not_joined(self, other: CompressedCache) -> str | None:
        """Why ``other``'s rows cannot join this cache's now (None: they can)."""
        if other.policy != self.policy or other.budget != self.budget or other.kv_repeats != self.kv_repeats:
            return "only caches of the same method and budget can share a batch"
        if other.quantization != self.quantization:
            return "only caches that store keys and values alike (kv_bits) can share a batch"
        if other.allocated != self.allocated or other._holds or self._holds:
            return "caches join a batch once both are compressing (after their prefill), never while held"
        return None

    def join(self, others: list[CompressedCache]) -> None:
        """Append the rows of ``others`` (caches of the same policy and budget, at the same stage of
        compression) to this cache's: new requests join a running batch."""
        for other in others:
            why = self.why_not_joined(other)
            if why is not None:
                raise D2OError(why)
        for mine, *theirs in zip(self.layers, *(other.layers for other in others)):
            mine.join(theirs)
            mine.observing = any(layer.observing for layer in (mine, *theirs))
        if self._last_hidden is not None:
            self._last_hidden = torch.cat([self._last_hidden, *(other._last_hidden for other in others)])
        self.forwards = max(self.forwards, *(other.forwards for other in others))
        self._quiet = 0  # a joining row may be nearer its next eviction: count at the next pass

    # -- lifecycle ----------------------------------------------------------------------------
    def _start_observing(self) -> None:
        """Before a sequence: every full-attention layer collects statistics, none where nothing
        will ever be evicted (unless ``observe``); allocation then stops the layers that never evict."""
        for layer in self.layers:
            layer.observing = layer.window is None and (not self.budget.unlimited or bool(self._observe))

    def reset(self) -> None:
        super().reset()
        self._start_observing()  # the last sequence's allocation stopped some layers observing
        self.forwards = 0
        self.allocated = False
        self._quiet = self._seen_at_check = 0
        self._last_hidden = self._last_logits = None
        self._start_probing()

    @contextmanager
    def hold(self):
        """Defer compression until the block ends (e.g. to prefill a long prompt in chunks). Meanwhile
        a layer whose method reads an observation window keeps that window's attention rows (its
        last w queries' over every token), so that the next chunk scores with them."""
        self._holds += 1
        try:
            yield self
        finally:
            self._holds -= 1
        if not self._holds:
            self.forwards += 1  # the block was one pass (a prefill in chunks is one prefill)
            for layer in self.layers:
                layer.held_window = None
            # Compress in the mode the passes ran in: inference tensors are written in place only in it.
            first = self.layers[0]
            with torch.inference_mode(first.is_initialized and first.token_index.is_inference()):
                self.compress()

    @property
    def held(self) -> bool:
        """True inside ``hold()``: compression waits for the block to end."""
        return self._holds > 0

    def observe_tokens(self, input_ids: torch.Tensor, hidden: torch.Tensor, lm_head) -> None:
        """Give the policy each new token's surprisal, -log p(token | earlier tokens), (B, q)."""
        valid = self.layers[0].fresh_real(input_ids.shape[1])
        # The model's own logits of the last pass, if they were computed from the very hidden states
        # kept here (not when rows were selected, joined or forked since, nor for another input).
        known = (self._last_logits is not None and self._last_hidden is not None
                 and self._last_logits[0].device == self._last_hidden.device  # layers spread over devices
                 and torch.equal(self._last_logits[0], self._last_hidden))
        surprisal, self._last_hidden = token_surprisal(input_ids, hidden, lm_head, valid, self._last_hidden,
                                                       self._last_logits[1] if known else None)
        self._last_logits = None
        self.policy.observe_tokens(self, surprisal, input_ids)

    def observe_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """The logits (B, V) the model computed from final hidden states ``hidden`` (B, d): those of
        this pass's last position, which predict the next pass's first token."""
        self._last_logits = (hidden.clone(), logits.clone())

    def record_prompt(self, input_ids: torch.Tensor) -> None:
        """Keep a pass's token ids until the policy's probe has read them (a policy that ``probes``)."""
        real = self.layers[0].fresh_real(input_ids.shape[1])
        self._prompt.append((input_ids.to(real.device), real))

    def prompts(self) -> list[list[int]]:
        """Each row's prompt token ids as recorded (padding left out)."""
        ids = torch.cat([ids for ids, _ in self._prompt], dim=1)
        real = torch.cat([real for _, real in self._prompt], dim=1)
        return [row[mask].tolist() for row, mask in zip(ids, real)]

    @property
    def tokenizer(self):
        """The model's tokenizer: the one given, else the one saved with the model."""
        if self._tokenizer is None:
            path = getattr(self.config, "_name_or_path", "") or ""
            try:
                if not path:
                    raise OSError("the model was not loaded from a folder")
                self._tokenizer = _saved_tokenizer(path)
            except (OSError, ValueError) as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise D2OError(f"{self.policy.name} writes text of its own into its probe and needs the model's "
                               f"tokenizer, which cannot be loaded from {path!r} ({first}): give it, "
                               f"CompressedCache(..., tokenizer=tokenizer)") from None
        return self._tokenizer

    def rotary(self, layer_idx: int, positions: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables the model's RoPE applies at ``positions`` (B, n) in layer
        ``layer_idx``, each (B, n, head_dim), in ``dtype``."""
        rotary = getattr(self._model_decoder(), "rotary_emb", None)
        if rotary is None:
            raise D2OError(f"{self.policy.name} reads the model's rotary embedding, and this model's decoder has none")
        carrier = torch.empty((), dtype=dtype, device=positions.device)
        kinds = getattr(self.config, "layer_types", None)
        if kinds and "layer_type" in inspect.signature(rotary.forward).parameters:  # per kind of layer (Gemma 3)
            return rotary(carrier, positions, kinds[layer_idx])
        return rotary(carrier, positions)

    def _model_decoder(self):
        decoder = self._decoder()
        if decoder is None:
            raise D2OError("the model this cache was made for is gone")
        return decoder

    def _probe(self) -> None:
        """Run the policy's probe passes: each is fed after the prompt, observed, then taken out of
        every layer (each pass sees the prompt alone)."""
        passes = self.policy.probe(self, self.prompts())
        decoder = self._model_decoder()
        device = self.layers[0].device
        snapshots = [layer.snapshot() for layer in self.layers]
        try:
            for probe in passes:
                if not any(probe.ids):
                    continue
                ids, real = (tensor.to(device) for tensor in left_pad(probe.ids))
                positions = self.layers[0].real_seen[:, None] + real.cumsum(-1) - 1
                mask = None
                if not bool(real.all()):
                    mask = torch.cat([real.new_ones((len(probe.ids), self.layers[0].seen)), real], dim=1)
                self.probing = probe
                decoder(input_ids=ids, attention_mask=mask, position_ids=positions.clamp_min(0), cache=self,
                        use_cache=True)
                for layer, snapshot in zip(self.layers, snapshots):
                    layer.restore(snapshot)
        finally:
            self.probing = None
        self.probed = True
        self._prompt = []

    def end_of_forward(self) -> None:
        """Called by the decoder's forward hook after every forward pass; passes inside ``hold()``
        count as one, when the block ends."""
        if not self._holds:
            self.forwards += 1
            self.compress()

    # -- compression --------------------------------------------------------------------------
    def compress(self) -> None:
        """Bring sliding-window layers back to their window; allocate budgets if it is time, then
        bring every other layer over its budget back to it."""
        if not self.layers[0].is_initialized:
            return
        try:
            self._compress()
        finally:
            for layer in self.layers:
                layer.settle()

    def _compress(self) -> None:
        windowed = [layer for layer in self.layers if layer.window is not None]
        if windowed:
            kept = torch.stack([layer.n_kept for layer in windowed])  # (L, B)
            windows = torch.tensor([layer.window - 1 for layer in windowed], device=kept.device)
            self._shrink_layers(windowed, kept, torch.minimum(kept, windows[:, None]), NEWEST)
        decoding = self.allocated
        if not self.allocated:
            if self.forwards < self.policy.compress_after_forward:
                return
            if self.policy.probes and not self.probed and any(layer.observing for layer in self.layers):
                self._probe()
            self._allocate()
        elif not self.policy.evicts_during_decode:
            return
        layers = [self.layers[index] for index in self.compressible]
        if not layers:  # every layer slides (the full cache of such a model)
            return
        added, self._seen_at_check = self.layers[0].seen - self._seen_at_check, self.layers[0].seen
        if not self.may_evict_after(added):  # no row can have reached budget + evict_every yet
            self._quiet -= added
            return
        batched = decoding and self.evict_every > 1
        kept = torch.stack([layer.n_kept for layer in layers])
        limit = self._limit(torch.stack([layer.budget for layer in layers]),
                            torch.stack([layer.real_seen for layer in layers]))
        target = torch.where(limit == UNLIMITED, kept, torch.minimum(limit, kept))
        if batched:  # a row is brought back to its budgets when one of its layers reaches budget + evict_every
            over = (kept - target).amax(0)
            due = over >= self.evict_every
            # Each pass of one token raises a layer's excess by one at most (a floor can only lower it):
            # the passes until the next row is due need no count.
            self._quiet = self.evict_every - 1 - int(torch.where(due, 0, over).max())
            if not bool(due.any()):
                return
            target = torch.where(due, target, kept)
        self._shrink_layers(layers, kept, target, self.policy, in_place=batched)

    def may_evict_after(self, n_query: int) -> bool:
        """Whether the pass running now (``n_query`` new tokens per row) may end in an eviction: a
        method computes what only an eviction reads (the votes of the latest queries) only then."""
        return not (self.allocated and self.evict_every > 1 and self.policy.evicts_during_decode
                    and n_query <= self._quiet)

    def _allocate(self) -> None:
        prompt = self.layers[0].real_seen
        if self.budget.unlimited:
            budgets = torch.full((len(prompt), self.n_layers), UNLIMITED, dtype=torch.long)
        else:
            layers = len(self.compressible)
            totals = torch.tensor([self.budget.total(layers, int(n)) for n in prompt.tolist()], dtype=torch.long)
            budgets = self.policy.allocate(self, totals)
        for i, layer in enumerate(self.layers):
            layer.budget = budgets[:, i].to(layer.device)
            layer.observing = (layer.window is None and self.policy.evicts_during_decode
                               and bool((layer.budget != UNLIMITED).any()))
        self.allocated = True
        self._prompt = []

    def limit(self, layer: CompressedLayer) -> torch.Tensor:
        """(B,) the layer's budget now: as allocated, never below the floor ``min(seen, min_tokens)``
        of a ratio budget (a row below the floor grows until it reaches it); UNLIMITED stays."""
        return self._limit(layer.budget, layer.real_seen)

    def _limit(self, budget: torch.Tensor, real_seen: torch.Tensor) -> torch.Tensor:
        """``limit`` from budgets and tokens seen of any shape (one layer's rows, or every layer's)."""
        if self.budget.ratio is None:
            return budget
        floor = real_seen.clamp_max(self.budget.min_tokens)
        return torch.where(budget == UNLIMITED, budget, torch.maximum(budget, floor))

    def floor_decides(self, layer: CompressedLayer) -> torch.Tensor:
        """(B,) bool: the floor, not the share of the ratio, set the layer's budget."""
        if self.budget.ratio is None or layer.budget is None or self.policy.keeps_everything:
            return torch.zeros_like(layer.real_seen, dtype=torch.bool)
        floor = layer.real_seen.clamp_max(self.budget.min_tokens)
        return (layer.budget != UNLIMITED) & (layer.budget <= floor)

    def _shrink_layers(self, layers: list[CompressedLayer], kept: torch.Tensor, target: torch.Tensor, chooser,
                       in_place: bool = False) -> None:
        """Bring each of ``layers`` from ``kept`` to ``target`` tokens per row ((L, B) each), keeping
        what ``chooser`` (the policy, or the window's rule) scores and protects; its merge, if it has
        one, folds what left into what stayed. The layers of a decode step (one token each per row and
        KV head, or k when evicting every k steps) go to the merge in one call, which may decide them
        together; a larger eviction (the prefill's) is merged as soon as its layer is shrunk, so that
        one layer's copies are held at a time. The counts of every layer are compared at once.
        ``in_place``: decoding in batches of steps (the evicted slots of a decode step are emptied
        where they are)."""
        excess = kept - target
        most, fewest = excess.amax(-1).tolist(), excess.amin(-1).tolist()
        merging = []
        for layer, row_target, row_excess, n_most, n_fewest in zip(layers, target.unbind(), excess.unbind(), most,
                                                                     fewest):
            if n_most <= 0:
                continue
            # Evicted slots are emptied where they are only after a pass of one token (a decode step).
            in_step = in_place and layer.owns_storage and layer.written is not None
            evicted = self._shrink(layer, row_target, row_excess, n_most, n_fewest, chooser, in_step)
            if evicted is None:
                continue
            if n_most == 1 or in_step:  # a few tokens per layer: all layers' are merged together
                merging.append((layer, evicted))
            else:
                layer.merged += chooser.merge.merge([layer], [evicted])[0]
                layer.settle()  # a quantized layer's full-precision copy goes before the next is made
        if merging:
            merged_layers, evicted = zip(*merging)
            for layer, merged in zip(merged_layers, chooser.merge.merge(list(merged_layers), list(evicted))):
                layer.merged += merged

    def _shrink(self, layer: CompressedLayer, target: torch.Tensor, excess: torch.Tensor, most: int, fewest: int,
                chooser, in_place: bool = False) -> Evicted | None:
        """Bring ``layer`` down to ``target`` (B,) tokens per row, ``excess`` (B,) fewer than it holds
        (``most`` and ``fewest`` of them); return what left (copies) when the chooser's merge is to
        fold it in, else None.

        A decode step evicts at most one token per row and KV head: its slot is only marked empty,
        nothing is copied. A larger eviction gathers the kept slots into new tensors, but one of a
        decode step evicting in batches of steps (``in_place``), whose evicted slots are marked empty
        for the next tokens to be written into."""
        scores, protected = chooser.score(layer), chooser.protected(layer, target)
        if scores.dtype != torch.float32:
            scores = scores.float()
        merge = chooser.merge
        evicted = None
        if most == 1 and layer.owns_storage:
            rows = None if fewest == 1 else excess > 0
            victim = select_victim(scores, protected, layer.token_index)
            if merge is not None:
                evicted = layer.evicted(victim, (excess > 0)[:, None], merge.reads, merge.vectors)
            layer.drop(victim, rows)
        elif in_place:  # the evicted slots are emptied where they are, for the next tokens to fill
            slots, valid = select_evicted(scores, protected, layer.token_index, excess)
            if merge is not None:
                evicted = layer.evicted(slots, valid, merge.reads, merge.vectors)
            layer.drop_many(slots, valid)
        else:  # a longer input was appended: the kept slots are gathered, k empty ones after them
            keep, keep_valid = select_kept(scores, protected, layer.token_index, target)
            if merge is not None:
                evicted = layer.evicted(*evicted_slots(layer.valid, keep, keep_valid, target), merge.reads,
                                        merge.vectors)
            # The layer is then as wide as it will be when decoding (budget + evict_every).
            batched = self.evict_every > 1 and chooser is self.policy and self.policy.evicts_during_decode
            layer.keep(keep, keep_valid, slack=self.evict_every if batched else 0)
        return evicted

    # -- inspection ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the layers hold for their slots: keys, values, token indices and method state (not
        the statistics of a pass, nor those a ``hold`` keeps until it ends)."""
        return sum(layer.nbytes + layer.state_nbytes for layer in self.layers)

    def report(self, rows: list[int] | None = None) -> CacheReport:
        """What the layers hold, for ``rows`` of the batch (all of them by default); a row's bytes
        are its share of the layer's tensors."""
        layers = []
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            batch = layer.token_index.shape[0]
            picked = list(range(batch)) if rows is None else list(rows)

            def pick(values: list) -> list:
                return [values[row] for row in picked]

            # What a plain cache would hold: the model's own KV heads, never repeated.
            heads = self.config.num_key_value_heads
            bytes_per_token = heads * (layer.key_dim + layer.value_dim) * layer.dtype.itemsize
            budget = [None] * batch if layer.budget is None else [
                None if b == UNLIMITED else b for b in self.limit(layer).tolist()]
            # What the stock cache holds: every fed token (padding included), or its window.
            full, stock = layer.real_seen, layer.seen
            if layer.window is not None:
                full, stock = full.clamp_max(layer.window - 1), min(stock, layer.window - 1)
            layers.append(
                LayerReport(
                    layer=layer.layer_idx,
                    window=layer.window,
                    budget=pick(budget),
                    kept=pick(layer.n_kept.tolist()),
                    full=pick(full.tolist()),
                    merged=pick(layer.merged.tolist()),
                    floor=pick(self.floor_decides(layer).tolist()),
                    kv_bytes=layer.nbytes * len(picked) // batch,
                    state_bytes=layer.state_nbytes * len(picked) // batch,
                    kv_bytes_full=stock * len(picked) * bytes_per_token,
                    method={name: pick(values) for name, values in self.policy.report(layer).items()},
                    kv_parts={name: count * len(picked) // batch
                              for name, count in layer.nbytes_parts.items()},
                )
            )
        held = not self.policy.keeps_everything
        return CacheReport(method=self.policy.name, budget=str(self.budget) if held else None,
                           min_tokens=self.budget.min_tokens if held and self.budget.ratio is not None else None,
                           layers=layers)


@lru_cache(maxsize=8)
def _saved_tokenizer(path: str):
    """The tokenizer saved with a model at ``path`` (a folder, or a name transformers resolves)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, S) padded on the left, and the padding mask (1 = a real token). The pad id is
    0: padding is masked everywhere, so its value never matters."""
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask
