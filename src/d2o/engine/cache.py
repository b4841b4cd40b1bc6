"""A compressed KV cache for transformers: a list of ``CompressedLayer`` run by one ``Policy``.

This file is the transformers container and what is done to rows (a request leaves, one joins, a
copy goes on alone); ``schedule`` decides when to compress and what to evict, ``probing`` runs
probe passes, ``model_facts`` knows the model, ``report`` says what the layers hold. The cache
names no method: it calls its policy through ``api``, handing it read-only views.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from d2o.budget import Budget
from d2o.engine.api import CacheView, LayerView, Policy, ProbePass, TokenValues
from d2o.engine.model_facts import ModelFacts, compressible_layers, head_dim, sliding_windows
from d2o.engine.probing import Prober
from d2o.engine.quantization import KVQuantization
from d2o.engine.quantized import QuantizedLayer
from d2o.engine.ragged import QuantizedRaggedLayer, RaggedLayer
from d2o.engine.report import CacheReport, report_of
from d2o.engine.schedule import Schedule
from d2o.engine.shared import reader_of
from d2o.engine.slots import named
from d2o.engine.stats import token_surprisal
from d2o.engine.storage import CompressedLayer
from d2o.errors import D2OError
from d2o.options import check_prefill_chunk


class CompressedCache(Cache):
    """A transformers ``Cache`` that compresses each layer to the budget its policy allocates.

    Use it wherever transformers takes a cache, on a model whose attention runs through d2o's
    hook (``d2o.install(model)``; ``d2o.load_model`` does it)::

        cache = CompressedCache(model, d2o.get_method("d2o"), budget=0.2)
        model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cache.report().table())

    Compression runs at the end of every pass: the first the policy compresses after (the prefill)
    fixes each layer's budget; from then on a layer over it (a decode step's token, an appended
    question) is brought back to it, unless the policy compresses once. ``with cache.hold():``
    defers compression (a chunked prefill scored as a whole).
    """

    def __init__(self, model, policy: Policy, budget: Budget | str | float = 0.2, observe: bool | None = None,
                 tokenizer=None, evict_every: int = 1, kv_bits: int | KVQuantization | None = None,
                 prefill_chunk: int | None = None):
        """``observe``: compute the policy's statistics even under a budget that evicts nothing (a
        prefill forks will share; by default a budget of 1 runs the stock kernels alone).
        ``tokenizer``: the model's, for a method writing text into a probe (by default the one saved
        with the model). ``evict_every``: decoding, a layer runs up to ``evict_every - 1`` tokens over
        its budget, brought back in one pass (1: every step). ``kv_bits``: keys and values at 8, 4 or
        2 bits (or a ``KVQuantization``); None: in the model's dtype. ``prefill_chunk``: ``prefill``
        feeds a prompt that many tokens at a time, compressed after each (None: whole)."""
        if isinstance(policy, str):
            raise D2OError(f"CompressedCache takes a method object, not the name {policy!r}: "
                           f"d2o.get_method({policy!r}) builds one")
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self._setup(ModelFacts(model.get_decoder(), model.config.get_text_config(), tokenizer), policy, budget,
                    observe, evict_every, kv_bits)

    def _setup(self, facts: ModelFacts, policy: Policy, budget, observe: bool | None = None, evict_every: int = 1,
               kv_bits: int | KVQuantization | None = None) -> None:
        self.schedule = Schedule(self, evict_every)
        self.quantization = KVQuantization.of(kv_bits)
        self.facts = facts
        self.policy = policy
        self.budget = policy.budget_for(Budget.parse(budget))
        config = facts.config
        self.n_layers = config.num_hidden_layers
        groups = config.num_attention_heads // config.num_key_value_heads
        self.kv_repeats = groups if policy.repeats_kv_heads else 1
        windows = sliding_windows(config)
        self.compressible = compressible_layers(windows, self.budget.unlimited)
        if self.quantization is not None:
            self.quantization.check(head_dim(config))
        quantized = self.quantization
        super().__init__(layers=[CompressedLayer(self, i, window) if quantized is None else
                                 QuantizedLayer(self, i, window, quantized) for i, window in enumerate(windows)])
        self._observe = observe
        self._start_observing()
        self.prober = Prober()
        # The last real token's final hidden state (for surprisal), and (hidden, logits): the model's of it.
        self._last_hidden = self._last_logits = None
        self._make_views()

    def _make_views(self) -> None:
        self.view = CacheView(self)  # the cache as its policy reads it
        for layer, view in zip(self.layers, self.view.layers):
            layer.view = view

    evict_every = property(lambda cache: cache.schedule.evict_every)
    tokenizer = property(lambda cache: cache.facts.tokenizer(cache.policy.name))

    def fork(self, policy: Policy, budget, slot_prefix: str = "", state_of=None,
             evict_every: int = 1, kv_bits: int | KVQuantization | None = None) -> CompressedCache:
        """A cache for ``policy`` at ``budget`` going on from this one's tokens, compressed now if it is
        time: key/value tensors shared (neither writes them in place); the slot state under
        ``slot_prefix`` and per layer ``state_of(layer)``, if given, copied as the new one's own. The
        source holds every token (budget 1.0): what a compression made of them is a method's own."""
        if not self.budget.unlimited:
            raise D2OError(f"only a cache that holds every token (budget 1.0) can be forked; this one's budget is "
                           f"{self.budget}")
        new = CompressedCache.__new__(CompressedCache)
        new.prefill_chunk = None
        new._setup(self.facts, policy, budget, evict_every=evict_every, kv_bits=kv_bits)
        new.prober.probed = self.prober.probed  # a combining policy ran each method's probe into its slot state
        if new.kv_repeats != self.kv_repeats:
            raise D2OError(f"{policy.name} stores KV heads differently: it cannot share another method's prefill")
        new.schedule.forwards = self.schedule.forwards
        new._last_hidden, new._last_logits = self._last_hidden, self._last_logits
        for mine, theirs in zip(self.layers, new.layers):
            if not mine.is_initialized:
                continue
            keys, values = mine.attended()
            theirs.lazy_initialization(keys, values)
            theirs.adopt(keys, values, mine.slots.forked(slot_prefix))
            mine.settle()
            theirs.seen, theirs.real_seen = mine.seen, mine.real_seen
            mine.owns_storage = theirs.owns_storage = False
            if state_of is not None and state_of(mine) is not None:
                theirs.state = state_of(mine).map_rows(torch.clone)
        new.schedule.compress()
        return new

    def copy(self, shared_prefix: bool = False) -> CompressedCache:
        """A cache in this one's state that goes on alone (another question on a compressed context):
        key/value tensors and token indices shared (neither writes them in place from now on), what
        a policy accumulates into copied. ``shared_prefix``: its layers read this one's keys and
        values in place for good, as a read-only prefix (``shared.SharedRunsLayer`` where its method
        evicts nothing while decoding, else ``shared.SharedPrefixLayer``; a layer that cannot be
        either, quantized or of a batch, is copied as without), so that copies joined into one batch
        hold them once."""
        new = copy.copy(self)
        new.prober = self.prober.copy()
        new.schedule = copy.copy(self.schedule)
        new.schedule.cache = new
        readers = [reader_of(layer) if shared_prefix else None for layer in self.layers]
        new.layers = [layer.copy_for(new) if reader is None else reader.over(layer, new)
                      for layer, reader in zip(self.layers, readers)]
        new._make_views()
        return new

    def keep_per_head(self, layer: CompressedLayer) -> None:
        """``layer``, whose KV heads now hold counts of their own, becomes a ``RaggedLayer`` (a run of
        slots per head)."""
        self._replace_layer((QuantizedRaggedLayer if isinstance(layer, QuantizedLayer) else RaggedLayer).holding(layer))

    def _replace_layer(self, new: CompressedLayer) -> None:
        self.layers[new.layer_idx] = new
        new.view = self.view.layers[new.layer_idx] = LayerView(new, self.view)

    # -- rows ---------------------------------------------------------------------------------
    batch_size = property(lambda cache: cache.layers[0].token_index.shape[0] if cache.layers[0].is_initialized else 0)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) the rows ``index`` (1-D): finished requests leave a batch."""
        for layer in self.layers:
            layer.select_rows(index)
        if self._last_hidden is not None:
            self._last_hidden = self._last_hidden[torch.as_tensor(index, device=self._last_hidden.device)]

    reorder_cache = batch_select_indices = select_rows  # transformers' names (beam search, contrastive search)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def why_not_joined(self, other: CompressedCache) -> str | None:
        """Why ``other``'s rows cannot join this cache's now (None: they can)."""
        if other.policy != self.policy or other.budget != self.budget or other.kv_repeats != self.kv_repeats:
            return "only caches of the same method and budget can share a batch"
        if other.quantization != self.quantization:
            return "only caches that store keys and values alike (kv_bits) can share a batch"
        if any(mine is not theirs and (mine is None or theirs is None or mine["keys"] is not theirs["keys"])
               for mine, theirs in zip(*([getattr(layer, "prefix", None) for layer in cache.layers]
                                         for cache in (self, other)))):
            return "only rows reading the same shared prefix (or none) can share a batch"
        if any(isinstance(mine, RaggedLayer) != isinstance(theirs, RaggedLayer)
               for mine, theirs in zip(self.layers, other.layers)):
            return "rows whose KV heads keep counts of their own (heads=adaptive, compressed) join only rows that do"
        if other.schedule.allocated != self.schedule.allocated or other.schedule.holds or self.schedule.holds:
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
        self.schedule.forwards = max(self.schedule.forwards, *(other.schedule.forwards for other in others))
        self.schedule.quiet = 0  # a joining row may be nearer its next eviction: count at the next pass

    # -- lifecycle ----------------------------------------------------------------------------
    def _start_observing(self) -> None:
        """Before a sequence every full-attention layer collects statistics, but under a budget that
        evicts nothing (unless ``observe``); allocation then stops the layers that never evict."""
        for layer in self.layers:
            layer.observing = layer.window is None and (not self.budget.unlimited or bool(self._observe))

    def reset(self) -> None:
        super().reset()
        self._start_observing()  # the last sequence's allocation stopped some layers observing
        self.schedule.restart()
        self._last_hidden = self._last_logits = None
        self.prober = Prober()

    @contextmanager
    def hold(self):
        """Defer compression until the block ends (a prompt prefilled in chunks, scored as a whole);
        meanwhile a layer carries its observation window's attention rows from pass to pass."""
        self.schedule.holds += 1
        try:
            yield self
        finally:
            self.schedule.holds -= 1
        if not self.schedule.holds:
            self.schedule.end_of_hold()

    held = property(lambda cache: cache.schedule.holds > 0, doc="Inside ``hold()``.")

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, question: ProbePass | None = None, in_prompt: bool = True,
                **kwargs):
        """Feed a prompt (B, S) through ``model`` into this cache, ``prefill_chunk`` tokens at a time,
        compressed after each chunk to the whole prompt's budget: it never holds more than that budget
        and one chunk. ``question``: a pass of the question (``api.QUESTION``) shown after each chunk to
        a method that scores with it: the prompt's own last tokens (``in_prompt``), or a question to
        come. Returns the model's output for the last chunk (``kwargs`` go to every pass)."""
        for output, _ in self.prefill_steps(model, input_ids, attention_mask, position_ids, question, in_prompt,
                                            **kwargs):
            pass
        return output

    def prefill_steps(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, question: ProbePass | None = None,
                      in_prompt: bool = True, **kwargs):
        """``prefill`` one chunk at a time (a server feeds one between its decode steps): yields
        ``(output, done)`` after each chunk."""
        return self.schedule.prefill(model, input_ids, attention_mask, position_ids, question, in_prompt, **kwargs)

    # -- tokens --------------------------------------------------------------------------------
    def observe_tokens(self, input_ids: torch.Tensor, hidden: torch.Tensor, lm_head) -> None:
        """Give the policy each new token's surprisal, -log p(token | earlier tokens), (B, q)."""
        index = self.layers[0].fresh_index(input_ids.shape[1])
        # The model's own logits of the last pass, if they were computed from the very hidden states
        # kept here (not when rows were selected, joined or forked since, nor for another input).
        known = (self._last_logits is not None and self._last_hidden is not None
                 and self._last_logits[0].device == self._last_hidden.device  # layers spread over devices
                 and torch.equal(self._last_logits[0], self._last_hidden))
        surprisal, self._last_hidden = token_surprisal(input_ids, hidden, lm_head, index, self._last_hidden,
                                                       self._last_logits[1] if known else None)
        self._last_logits = None
        self.record(self.policy.observe_tokens(self.view, surprisal, input_ids))

    def record(self, values: TokenValues | None) -> None:
        """The new tokens' values a policy gives, into every layer's slot state."""
        if values is None:
            return
        for name, tensor in values.values.items():
            for layer in self.layers:
                layer.record(name, tensor, values.decay.get(name, 1.0))

    def observe_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """The logits (B, V) the model computed from this pass's last final hidden states ``hidden``
        (B, d): they predict the next pass's first token."""
        self._last_logits = (hidden.clone(), logits.clone())

    # -- inspection and saving ------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes the layers hold for their slots: keys, values, token indices and method state."""
        return sum(layer.nbytes + layer.state_nbytes for layer in self.layers)

    def report(self, rows: list[int] | None = None) -> CacheReport:
        """What the layers hold, for ``rows`` of the batch (all by default)."""
        return report_of(self, rows)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The cache's tensors by name (``LAYER.NAME``), and what else rebuilds it (``load_state_dict``)."""
        tensors, layers = {}, []
        if self._last_hidden is not None:  # the surprisal of the first token fed next reads them
            tensors["last_hidden"] = self._last_hidden
        if self._last_logits is not None:
            tensors["last_logits.hidden"], tensors["last_logits.logits"] = self._last_logits
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:
                layers.append(None)
                continue
            own, meta = layer.state_dict()
            tensors.update({f"{i}.{name}": tensor for name, tensor in own.items()})
            layers.append(meta)
        return tensors, {"layers": layers, "forwards": self.schedule.forwards, "allocated": self.schedule.allocated,
                         "probed": self.prober.probed, "evict_every": self.evict_every}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> None:
        """This cache as ``state_dict`` saw another (of the same policy and model)."""
        if len(meta["layers"]) != len(self.layers):
            raise D2OError(f"the saved context has {len(meta['layers'])} layers, the model {len(self.layers)}")
        for i, (layer, saved) in enumerate(zip(self.layers, meta["layers"])):
            if saved is not None and "bounds" in saved:
                self._replace_layer(layer := RaggedLayer(self, i, layer.window) if self.quantization is None else
                                    QuantizedRaggedLayer(self, i, layer.window, self.quantization))
            if saved is not None:
                layer.load_state_dict(named(tensors, f"{i}."), saved, dtype)
        self.schedule.forwards, self.schedule.allocated, self.prober.probed = (meta[name] for name in (
            "forwards", "allocated", "probed"))
        self._last_hidden = tensors.get("last_hidden")
        if "last_logits.hidden" in tensors:
            self._last_logits = (tensors["last_logits.hidden"], tensors["last_logits.logits"])
