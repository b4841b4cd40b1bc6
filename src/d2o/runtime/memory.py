"""How much KV memory a request needs: at its prefill, and at most while it decodes.

What a server admits and what ``bench fit`` packs under a memory cap. A layer holds K and V for
every kept slot, and beside them each slot's token index and method state (``slot_bytes``); a
prompt prefilled whole holds every prompt token in every layer before it is compressed (and, for
a method that probes, its longest probe pass beside them); one prefilled in chunks holds at most
the whole prompt's budget and a chunk in every layer (and beside them a chunk's probe pass, and
the question shown after each chunk to a method that scores with one); while decoding, a
method that evicts holds its budget (plus the one
slot a new token is written into), a method that compresses once grows by every generated token,
and the full cache holds everything. A sliding-window layer (Gemma 3) holds its window whatever the
method. Keys and values stored quantized (``kv_bits``) take their packed levels, steps and zero
points per slot, and each row holds its newest tokens in full precision besides (``row_bytes``); a
quantized prefill holds every prompt token quantized, and one layer's in full precision while it
attends. A method whose layer budgets need not add up to its total (``d2o-official``) is planned as
the full cache: a bound it never exceeds.

Rows decoding together share one tensor per layer, as wide as its widest row: ``peak_slots`` gives,
once a row is prefilled, the most slots it can occupy in each layer, and ``padded_bytes`` the most
a batch of such rows can hold, padding included (what a server must reserve for it). Rows reading
one compressed context in place (``engine.shared``) hold their own parts (``own_peaks``) and their
bookkeeping of its slots; its keys and values are counted once, with the context (``shared_plan``,
``shared_prefix``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.budget import UNLIMITED, Budget
from d2o.engine.model_facts import compressible_layers, head_dim, sliding_windows
from d2o.engine.quantization import KVQuantization
from d2o.engine.ragged import RaggedLayer
from d2o.engine.shared import SharedRunsLayer, reader_of
from d2o.engine.slots import TOKEN_INDEX_DTYPE
from d2o.methods.base import Method


@dataclass(frozen=True)
class KVPlan:
    """Bytes of KV cache (keys, values and their slots' bookkeeping) one sequence holds: during its
    prefill, and at most afterwards."""

    prefill_bytes: int
    held_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.prefill_bytes, self.held_bytes)


def _heads_and_dim(config, method: Method) -> tuple[int, int]:
    config = config.get_text_config()
    return (config.num_attention_heads if method.repeats_kv_heads else config.num_key_value_heads), head_dim(config)


def slot_bytes(config, dtype_bytes: int, method: Method, stock: bool = False, kv_bits=None,
               allocated: bool = False) -> list[int]:
    """Bytes of one slot in each layer: the K and V of one token in every stored KV head and, in
    d2o's cache (not in the stock cache: ``stock``), its token index beside them and, in a layer
    the method scores (every layer but a sliding-window one), the method's slot state (float32
    whatever the model's dtype). On SmolLM2 in float32 the index and state add 3-6% to K and V
    for H2O, D2O and d2o-plus, 26% for RoCo (its window's attention rows). ``kv_bits``: K and V
    quantized (``CompressedCache``'s), their packed levels, steps and zero points. ``allocated``:
    a slot from the final allocation on (a row decoding, or reading a compressed context), whose
    method may keep less state then (``Policy.allocated_state_bytes``)."""
    config = config.get_text_config()
    heads, dim = _heads_and_dim(config, method)
    quantization = KVQuantization.of(kv_bits)
    kv = 2 * (dim * dtype_bytes if quantization is None else quantization.token_bytes(dim))
    if stock:
        return [heads * kv for _ in sliding_windows(config)]
    indexed = kv + TOKEN_INDEX_DTYPE.itemsize
    group = config.num_attention_heads // heads
    scored = indexed + (method.allocated_state_bytes(group) if allocated else method.slot_state_bytes(group))
    return [heads * (indexed if window is not None else scored) for window in sliding_windows(config)]


def row_bytes(config, dtype_bytes: int, method: Method, kv_bits=None) -> int:
    """Bytes a row holds in every layer beside its slots: with ``kv_bits``, its newest tokens in full
    precision (K, V and their slots' places, int64 indices; ``KVQuantization.residual``)."""
    quantization = KVQuantization.of(kv_bits)
    if quantization is None:
        return 0
    heads, dim = _heads_and_dim(config, method)
    layers = config.get_text_config().num_hidden_layers
    return layers * heads * quantization.residual * (2 * dim * dtype_bytes + torch.long.itemsize)


def plan(config, method: Method, budget: Budget, prompt_tokens: int, new_tokens: int, dtype_bytes: int = 4,
         stock: bool = False, evict_every: int = 1, kv_bits=None, prefill_chunk: int | None = None,
         question: bool = False, rows: int = 1) -> KVPlan:
    """The KV bytes of one sequence of ``prompt_tokens`` + ``new_tokens`` under ``method`` at ``budget``
    (``stock``: in transformers' own cache, which holds K and V alone: the full cache only;
    ``evict_every``: the cache's, whose layers run that many slots over their budget at most;
    ``kv_bits``: the cache's, keys and values quantized; ``prefill_chunk``: the prompt prefilled that
    many tokens at a time, ``question`` shown after each chunk; ``rows``: the sequences of its batch,
    ``_run_padding``)."""
    windows = sliding_windows(config.get_text_config())
    per_slot = slot_bytes(config, dtype_bytes, method, stock, kv_bits)
    length = prompt_tokens + new_tokens
    compressible = compressible_layers(windows, budget.unlimited)
    exempt = len(method.exempt_among(len(windows), compressible))
    active = len(compressible) - exempt
    whole = method.keeps_everything or budget.unlimited or not method.conserves_budget
    if whole:
        held = len(compressible) * length
    else:
        share = budget.total(len(compressible), prompt_tokens) - exempt * prompt_tokens  # the active layers'
        # Runs padded to their widest rows (no run holds more than the prompt).
        share = min(share * _run_padding(config, method, rows), max(share, active * prompt_tokens))
        if method.evicts_during_decode:
            # At its budget, or growing to the floor; plus the slots written before an eviction (one
            # per step, or evict_every), which a row that never outgrows its budget never needs.
            held = min(max(share, active * budget.floor(length)) + active * evict_every, active * length)
        else:
            held = share + active * new_tokens
        held += exempt * length
    global_slot = per_slot[compressible[0]] if compressible else 0  # every global layer's slot is alike
    sliding = sum(min(length, window) * slot for window, slot in zip(windows, per_slot) if window is not None)
    chunk = prefill_chunk if prefill_chunk and prefill_chunk < prompt_tokens and not stock else None
    probe = method.probe_tokens(chunk or prompt_tokens) + (method.question_tokens if question else 0)
    if chunk is None:
        prefill, attending = (prompt_tokens + probe) * sum(per_slot), prompt_tokens + probe
    else:  # a layer holds its budget and a chunk (a sliding one its window and a chunk), and the probe
        held_by_globals = len(compressible) * prompt_tokens if whole else \
            min(active * prompt_tokens, share + active * chunk) + exempt * prompt_tokens
        prefill = (held_by_globals + len(compressible) * probe) * global_slot + sum(
            min(prompt_tokens, window + chunk) * slot + probe * slot
            for window, slot in zip(windows, per_slot) if window is not None)
        # The layer attending, quantized, opens all its slots: at most the prompt, or the whole budget and a chunk.
        attending = min(prompt_tokens, chunk + (prompt_tokens if whole else share)) + probe
    extra = row_bytes(config, dtype_bytes, method, kv_bits)
    if extra:  # the layer attending holds its tokens in full precision too, while it attends
        heads, dim = _heads_and_dim(config, method)
        prefill += attending * heads * 2 * dim * dtype_bytes
    return KVPlan(prefill_bytes=prefill + extra, held_bytes=held * global_slot + sliding + extra)


def _run_padding(config, method: Method, rows: int) -> int:
    """How many times its even share a row of a batch of ``rows`` may hold in a compressed layer. With
    per-KV-head counts (``heads=adaptive``, ``engine.ragged``) each KV head's run is as wide as its
    widest row: G runs of at most a row's whole layer (G x its share) each, and no wider than all
    the rows' pairs (``rows`` x G x a share), so a row holds at most min(rows, G) x its share."""
    if not method.per_head_budgets:
        return 1
    return max(1, min(rows, _heads_and_dim(config, method)[0]))


def over_cap(kv_plan: KVPlan, cap: int, chunked: bool) -> str | None:
    """None if ``kv_plan`` fits in ``cap`` bytes; "prefill" if only a prefill in chunks (or a
    shorter prompt) would make it fit: a prefill whole holds every prompt token before it is
    compressed; else "held": its budget, chunk, prompt or answer must shrink."""
    if kv_plan.peak_bytes <= cap:
        return None
    return "prefill" if kv_plan.prefill_bytes > cap and not chunked else "held"


def peak_slots(cache, new_tokens: int) -> torch.Tensor:
    """(B, L): the most slots each row of ``cache`` (a ``CompressedCache`` after its prefill)
    occupies in each layer while it is fed up to ``new_tokens`` more tokens.

    A layer that evicts stays at its budget (raised to the floor as the row grows) plus the slots
    new tokens are written into before an eviction (``cache.evict_every``); a layer compressed once grows by every new
    token; an uncompressed layer holds every token."""
    policy, budget = cache.policy, cache.budget
    peaks = []
    for layer in cache.layers:
        final = layer.real_seen + new_tokens
        if layer.window is not None:  # a sliding-window layer holds its window
            peak = final.clamp_max(layer.window)
        elif layer.budget is None or policy.keeps_everything:
            peak = final
        elif not policy.evicts_during_decode:
            peak = layer.n_kept + new_tokens
        else:
            floor = final.clamp_max(budget.min_tokens) if budget.ratio is not None else torch.zeros_like(final)
            limit = torch.maximum(layer.budget, floor)
            peak = torch.where(layer.budget == UNLIMITED, final, torch.minimum(final, limit + cache.evict_every))
        peaks.append(peak.cpu())
    return torch.stack(peaks, dim=1)


def slot_widths(cache) -> list[int]:
    """Slots per row of each layer's tensors now (0 before the first token)."""
    return [_width(layer) for layer in cache.layers]


def _width(layer) -> int:
    return layer.token_index.shape[2] if layer.is_initialized else 0


def joined_widths(caches: list, new_tokens: int) -> list[int]:
    """Slots per row of each layer once the rows of ``caches`` share one batch: the widest cache's
    now. A layer of runs (``engine.ragged``) pads each KV head's run to its widest row, and every run
    grows as its rows do: counted in slots of every KV head (its pairs over its KV heads, rounded
    up), grown by the most any row's layer grows (``peak_slots``) while fed up to ``new_tokens``
    more tokens."""
    ragged = any(isinstance(layer, RaggedLayer) for layer in caches[0].layers)
    peaks = [peak_slots(cache, new_tokens) for cache in caches] if ragged else []  # (B, L) each: runs only
    widths = []
    for i, layers in enumerate(zip(*(cache.layers for cache in caches))):
        if isinstance(layers[0], RaggedLayer):
            runs = [max(heads) for heads in zip(*([stop - start for start, stop in layer.runs] for layer in layers))]
            grown = max(int((peak[:, i] - layer.n_kept.cpu()).max()) for peak, layer in zip(peaks, layers))
            widths.append(-(-sum(runs) // len(runs)) + grown)
        else:
            widths.append(max(map(_width, layers)))
    return widths


def shared_prefix(cache) -> tuple[int, int] | None:
    """What the rows of ``cache`` read in place (``engine.shared``): the identity of the source cache's
    first shared keys (equal for every cache reading them, and ``prefix_identity`` of that cache)
    and the bytes of all its shared keys and values; None: nothing shared."""
    layers = [layer for layer in cache.layers if hasattr(layer, "prefix")]
    if not layers:
        return None
    return id(layers[0].prefix["keys"]), sum(t.nbytes for layer in layers for t in layer.prefix.values())


def prefix_identity(cache) -> int | None:
    """``shared_prefix``'s identity of the caches reading ``cache`` (one row, plain layers) in place."""
    layer = next((layer for layer in cache.layers if layer.is_initialized), None)
    if layer is None:
        return None
    return id(layer.keys) if _reads_in_place(layer) else id(layer)  # read in place, or copied by each


def shareable(cache) -> bool:
    """Whether rows can read ``cache`` (a compressed context) in place: every layer a prefix."""
    return all(map(_reads_in_place, cache.layers))


def _reads_in_place(layer) -> bool:
    """Whether rows can read ``layer`` (a context's) in place (``engine.shared.reader_of``)."""
    return reader_of(layer) is not None


def _own_slots_per_token(cache) -> int:
    """Slots a row's own part beside a shared prefix gains per token fed: its own, and one more where a
    merge copies the prefix slot an eviction folds into (``SharedPrefixLayer``: a merge that writes
    new vectors into it; one that moves only weight leaves the slot in the prefix)."""
    merge = cache.policy.merge
    return 2 if merge is not None and merge.changes_vectors else 1


def shared_plan(cache, rest_tokens: int, new_tokens: int, per_slot: list[int], per_vector: list[int]) -> KVPlan:
    """The KV bytes of one row reading ``cache`` (``shareable``) in place, fed ``rest_tokens`` more
    and generating ``new_tokens``: its own part (``_own_slots_per_token`` per token, ``evict_every``
    beside them) and its bookkeeping of the context's slots (of a plain layer's: a row on runs holds
    none, ``SharedRunsLayer``); the context's keys and values are not counted (they are the context's)."""
    own = _own_slots_per_token(cache) * (rest_tokens + new_tokens) + cache.evict_every
    held = sum(own * slot + (0 if reader_of(layer) is SharedRunsLayer else layer.token_index.shape[2] * (slot - vector))
               for layer, slot, vector in zip(cache.layers, per_slot, per_vector))
    return KVPlan(held, held)


def prefix_widths(cache) -> list[int]:
    """Slots of each layer's shared prefix (``engine.shared``; 0: none), which its rows hold once."""
    return [getattr(layer, "prefix_width", 0) for layer in cache.layers]


def own_peaks(cache, new_tokens: int, peaks: torch.Tensor) -> torch.Tensor:
    """(B, L): the most slots each row's own part beside a shared prefix (``engine.shared``; its
    ``peaks`` in a layer without one: all of it is its own) spans while it is fed up to
    ``new_tokens`` more tokens: it grows by ``_own_slots_per_token`` per token, a row never holds
    more than its ``peaks`` (``peak_slots`` for as many tokens), and the part is at most
    ``evict_every`` slots wider than its fullest KV head (``SharedPrefixLayer``)."""
    per_token = _own_slots_per_token(cache)
    columns = []
    for layer, peak in zip(cache.layers, peaks.unbind(1)):
        width = getattr(layer, "prefix_width", None)
        if width is None:  # no prefix: the row's whole layer is its own
            columns.append(peak)
            continue
        fullest = (layer.token_index[:, :, width:] >= 0).sum(-1).amax(-1).cpu()
        columns.append(torch.minimum(fullest + per_token * new_tokens, peak) + cache.evict_every)
    return torch.stack(columns, dim=1)


def padded_bytes(widths: list[int], peaks: torch.Tensor, per_slot: list[int], per_row: int = 0,
                 prefix: list[int] | None = None, per_vector: list[int] | None = None,
                 own: torch.Tensor | None = None) -> int:
    """The most KV bytes a batch of rows with ``peaks`` (B, L) from ``peak_slots`` reaches: every
    row is as wide as the widest in each layer. ``widths``: each layer's slots now (a batch's
    tensors do not narrow when its widest row leaves); ``per_slot``: ``slot_bytes``; ``per_row``:
    ``row_bytes``. Given ``own`` (``own_peaks``: rows on a shared prefix), each row holds its own part
    and the bookkeeping of the prefix's slots in its slot table (``prefix``: ``prefix_widths``;
    ``per_slot`` but ``per_vector``, the keys' and values' part); the prefix's keys and values are
    the context's, not counted here (``shared_prefix``)."""
    if not len(peaks):
        return 0
    if own is None:
        widest = torch.maximum(peaks.max(0).values, torch.tensor(widths, dtype=peaks.dtype))
        return len(peaks) * (int((widest * torch.tensor(per_slot, dtype=widest.dtype)).sum()) + per_row)
    shared = torch.tensor(prefix, dtype=peaks.dtype)
    widest = torch.maximum(own.max(0).values, torch.tensor(widths, dtype=peaks.dtype) - shared)
    per_slot, per_vector = (torch.tensor(values, dtype=peaks.dtype) for values in (per_slot, per_vector))
    row = (widest * per_slot + shared * (per_slot - per_vector)).sum() + per_row
    return len(peaks) * int(row)
