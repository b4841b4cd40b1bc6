"""The attention function d2o registers with transformers, and installing it on a model.

transformers builds one causal mask per pass, sized for layer 0, and reads it at ``kv_offset +
slot``: after eviction that matches the kept tokens only by chance, and layers of different lengths
cannot take a multi-token input. So d2o's mask function passes the 2D padding mask through and its
attention function builds each layer's mask: slot validity plus a bottom-right causal block over
the new tokens; the output comes from transformers' own SDPA (or eager) function, so without
compression the logits are the stock model's. Statistics are computed exactly in query chunks
(``stats``); after the decoder's last layer the cache compresses (a forward hook).

transformers does not hand the cache to the attention function: a hook before the decoder's pass
binds its cache (per thread), and the function takes that cache's layer of its module's
``layer_idx``, whose ``update`` just stored the pass's keys; a layer that took none is an error.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from d2o.engine.api import AttentionStats, StatsRequest, as_dtype
from d2o.engine.cache import CompressedCache
from d2o.engine.ragged import RaggedLayer
from d2o.engine.shared import SharedPrefixLayer, SharedRunsLayer
from d2o.engine.stats import allowed_keys, attention_stats
from d2o.engine.storage import HOOK_PREFIX
from d2o.errors import D2OError

# Families whose attention calls `cache.update`, then the attention function on unrepeated KV heads
# with keys after RoPE (checked in the tests on tiny random models).
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
NO_STATISTICS = StatsRequest()
ATTENTION_NAMES = {backend: HOOK_PREFIX + backend for backend in ("sdpa", "eager")}
HOOK_ATTRIBUTE = "_d2o_end_of_forward"  # on the decoder: the handle of the forward hook
STOCK_ATTRIBUTE = "_d2o_stock_attention"  # on the model: the implementation install replaced
# Per thread, the d2o cache of each decoder pass running (None: another cache, or none), innermost last.
_passes = threading.local()


def _bound_layer(module):
    """The layer of the pass's d2o cache that attention ``module`` attends with (None: no d2o cache)."""
    stack = getattr(_passes, "caches", None)
    cache = stack[-1] if stack else None
    if cache is None:
        return None
    index = getattr(module, "layer_idx", None)
    layer = cache.layers[index] if isinstance(index, int) and 0 <= index < len(cache.layers) else None
    if layer is None or not layer.pending:
        raise D2OError(f"d2o's attention ran for layer {index} of a pass with a compressed cache, but that layer of "
                       f"the cache took no keys in this pass (its update did not run): the model's attention does "
                       f"not store its keys through the cache, which d2o needs (supported: "
                       f"{', '.join(SUPPORTED_FAMILIES)})")
    return layer


def _padding_mask(attention_mask=None, **_) -> torch.Tensor | None:
    """Mask function: the 2D padding mask (B, seen + q) as given, or None when nothing is padded."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return None if bool(attention_mask.all()) else attention_mask.bool()
    return attention_mask


def _make_attention(backend: str):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = _bound_layer(module)
        try:
            return attend(layer, module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        finally:
            if layer is not None:
                layer.settle()

    def attend(layer, module, query, key, value, attention_mask, dropout, scaling, **kwargs):
        if attention_mask is not None and attention_mask.dim() != 2:
            raise D2OError("d2o's attention takes a 2D padding mask (batch, tokens), not a prepared 4D mask")
        batch, n_query, n_keys = query.shape[0], query.shape[2], key.shape[2]
        window = kwargs.get("sliding_window")
        new_valid = None if attention_mask is None else attention_mask[:, -n_query:].bool()  # None: all real
        scaling = module.scaling if scaling is None else scaling
        log_weight = None
        request = None
        if layer is not None:
            if isinstance(layer, RaggedLayer) and layer.attends_opened:
                # Its method evicts while decoding, or it is stored quantized: the pass runs on the layer
                # opened, (B, G, N) slots.
                layer = layer.open_pass(new_valid)
                key, value = layer.attended()
            else:
                layer.admit(new_valid)
            if isinstance(layer, RaggedLayer):  # compressed once: it observes nothing from then on
                return _ragged_attention(layer, query, scaling), None
            if isinstance(layer, SharedRunsLayer):  # reading runs in place: nothing observed either
                return _shared_runs_attention(layer, query, scaling), None
            if layer.observing:
                request = layer.cache.policy.stats_request(layer.view, n_query)
            shared = isinstance(layer, SharedPrefixLayer) and n_query == 1
            if (layer.observing or shared) and n_query == 1 and window is None and \
                    (request is None or request.visible is None):
                # A decode step of a layer that evicts (or reads a shared prefix): one product with the keys
                # plus the layer's logit bias (no mask to build, nothing to ask the device); its
                # probabilities give the statistics.
                bias = layer.logit_bias(torch.float64 if query.dtype == torch.float64 else torch.float32)
                output, stats = _one_query_attention(query, key, value, bias, new_valid, scaling,
                                                     request or NO_STATISTICS,
                                                     (layer.prefix["keys"], layer.prefix["values"]) if shared else None)
                if request is not None:
                    _observe(layer, request, stats, query, scaling)
                return output, None
            if shared:  # ``update`` handed over the own part alone: this pass reads the gathered view
                key, value = layer.attended()
            n_keys = key.shape[2]  # the keys this pass reads (what the layer's ``update`` returned, or others)
            kv_valid = layer.valid  # (B, G, N)
            positions = layer.token_index
            log_weight = layer.log_weight
            if window is not None:
                query_positions = layer.fresh_index(n_query)[:, None]  # (B, 1, q)
        else:  # no d2o cache (plain DynamicCache, or none): slots are the padded token stream
            kv_valid = (query.new_ones((batch, n_keys), dtype=torch.bool) if attention_mask is None
                        else attention_mask[:, -n_keys:].bool())[:, None]
            positions = torch.arange(n_keys, device=query.device).expand(batch, 1, n_keys)
            query_positions = positions[:, :, n_keys - n_query:]
        if key.shape[1] != query.shape[1] // module.num_key_value_groups:  # KV heads stored repeated
            module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], training=module.training,
                                     is_causal=getattr(module, "is_causal", True), scaling=module.scaling)
        window_mask = None if window is None else _sliding_window(window, positions, query_positions)
        every_slot = window_mask is None and bool(kv_valid.all())

        if request is not None and request.columns and request.visible is None and n_query > 1 and backend == "sdpa":
            # Every row's probabilities are needed anyway: the output comes from them too.
            stats = attention_stats(query, key, kv_valid.expand(-1, key.shape[1], -1),
                                    kv_valid.new_ones((batch, n_query)) if new_valid is None else new_valid,
                                    scaling, request, window_mask, log_weight, value)
            _observe(layer, request, stats, query, scaling)
            return stats.output, None

        mask = None
        plain = every_slot and log_weight is None
        if not plain or (backend == "eager" and n_query > 1) or n_query not in (1, n_keys):
            uniform = log_weight is None and bool((kv_valid == kv_valid[:, :1]).all())
            mask = allowed_keys(kv_valid[:, :1] if uniform else kv_valid, 0, n_query, n_query, n_keys,
                                window_mask)  # (B, 1|G, q, N)
            if log_weight is not None or backend == "eager":
                # An additive float mask: each slot's log weight where visible, the lowest value where not
                # (eager's softmax runs in float32: a float64 minimum would become -inf there, NaN rows).
                lowest = max(torch.finfo(query.dtype).min, torch.finfo(torch.float32).min)
                bias = 0.0 if log_weight is None else log_weight[:, :, None, :].to(query.dtype)
                mask = torch.where(mask, bias, torch.tensor(lowest, dtype=query.dtype, device=query.device))
            if mask.shape[1] > 1:  # slots differ between KV heads: one mask per query head
                mask = repeat_kv(mask, module.num_key_value_groups)
        if backend == "eager":
            output, _ = eager_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout)
        else:
            output, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)

        if request is not None:
            per_head = kv_valid.expand(-1, key.shape[1], -1)
            if request.visible is not None:
                per_head = per_head & request.visible
            if new_valid is None:
                new_valid = kv_valid.new_ones((batch, n_query))
            stats = attention_stats(query, key, per_head, new_valid, scaling, request, window_mask, log_weight)
            _observe(layer, request, stats, query, scaling)
        return output, None

    attention.__name__ = f"d2o_{backend}_attention"
    return attention


def _observe(layer, request: StatsRequest, stats: AttentionStats, query: torch.Tensor, scaling: float) -> None:
    """Hand a pass's statistics (with its queries, if asked) to the policy and write what it makes of
    them. Inside a hold the earlier passes' window rows go with this pass's (the prompt's last)."""
    if request.queries:
        stats = replace(stats, queries=query, query_index=layer.fresh_index(query.shape[2]), scaling=scaling)
    if not layer.cache.held or stats.window is None:
        layer.carried_window = None
    else:
        earlier = layer.carried_window
        if earlier is not None and earlier.shape[:3] == stats.window.shape[:3]:
            # Slots added since take no attention from the earlier queries (nothing is evicted while held).
            earlier = F.pad(earlier, (0, stats.window.shape[-1] - earlier.shape[-1]))
            rows = torch.cat([earlier, stats.window], dim=3)[:, :, :, -request.window :]
            stats = replace(stats, window=rows)
        layer.carried_window = stats.window
    layer.apply_observed(layer.cache.policy.observe(layer.view, stats))


def _one_query_attention(query, key, value, bias, new_valid, scaling, request, prefix=None):
    """One query per row (a decode step) whose statistics are asked for: its probabilities (float32
    at least) give the output and, for free, the column mass and window row. ``bias`` (B, G, 1, N):
    the slots' log weights, the lowest value for empty ones (added whether there are any or not:
    asking would make the host wait for the device in every layer of every step). ``prefix``: keys
    and values (1, G, P, D) every row reads before ``key``/``value`` (a shared prefix, read in place:
    every row's queries against it as one row's), its slots the first P of ``bias``."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    dtype = bias.dtype
    queries = as_dtype(query, dtype).view(batch, kv_heads, group, dim) * scaling
    scores = torch.matmul(queries, as_dtype(key, dtype).transpose(-1, -2))  # (B, G, group, N)
    if prefix is not None:
        stacked = queries.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
        shared = torch.matmul(stacked, as_dtype(prefix[0], dtype).transpose(-1, -2))  # (1, G, B x group, P)
        scores = torch.cat([shared.view(kv_heads, batch, group, -1).transpose(0, 1), scores], dim=-1)
    probs = torch.softmax(scores.add_(bias), dim=-1)
    if prefix is None:
        output = torch.matmul(probs, as_dtype(value, dtype))
    else:
        width = prefix[1].shape[2]
        read = probs[..., :width].transpose(0, 1).reshape(1, kv_heads, batch * group, width)
        output = torch.matmul(read, as_dtype(prefix[1], dtype)).view(kv_heads, batch, group, -1).transpose(0, 1) \
            + torch.matmul(probs[..., width:], as_dtype(value, dtype))
    output = as_dtype(output, query.dtype).reshape(batch, 1, heads, value.shape[-1])
    probs = as_dtype(probs, torch.float32)
    if new_valid is not None:  # a padding query observes nothing (a real one's probabilities times 1 are unchanged)
        probs = probs * new_valid[:, :, None, None]
    return output, AttentionStats(1, column_mass=probs if request.column_mass else None,
                                  window=probs[:, :, :, None, :] if request.window else None,
                                  column_max=probs if request.column_max else None)


def _ragged_attention(layer: RaggedLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The output (B, q, H, D) of queries (B, H, q, D) over a layer of one run of slots per KV head:
    per KV head, its query heads stacked as one head's queries over its run (a view), the pass's
    own tokens (the run's last q slots) causally. Masked by the lowest value, not -inf: a padding
    query seeing no slot gets a finite output, which nothing reads."""
    batch, heads, n_query, dim = query.shape
    group = heads // layer.kv_heads
    valid = layer.token_index >= 0  # (B, 1, T)
    lowest = torch.finfo(query.dtype).min
    # One query per row (a decode step): every query sees every valid slot of its run, one mask for all runs.
    bias = query.new_zeros(valid.shape).masked_fill_(~valid, lowest)[:, :, None, :] if n_query == 1 else None
    outputs = []
    for g, (start, stop) in enumerate(layer.runs):
        if bias is not None:
            mask = bias[..., start:stop]
        else:
            allowed = allowed_keys(valid[:, :, start:stop], 0, n_query, n_query, stop - start)  # (B, 1, q, N)
            mask = query.new_zeros(allowed.shape).masked_fill_(~allowed, lowest)
            mask = mask.expand(batch, group, n_query, stop - start).reshape(batch, 1, group * n_query, stop - start)
        queries = query[:, g * group:(g + 1) * group].reshape(batch, 1, group * n_query, dim)
        output = F.scaled_dot_product_attention(queries, layer.keys[:, :, start:stop], layer.values[:, :, start:stop],
                                                attn_mask=mask, scale=scaling)
        outputs.append(output.view(batch, group, n_query, -1))
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous()


def _shared_runs_attention(layer: SharedRunsLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The output (B, q, H, D) of queries (B, H, q, D) over rows reading a context's layer in place
    (``SharedRunsLayer``): per KV head, every row's queries of its query heads against the head's
    run of the prefix as one row's (one product, the prefix never repeated per row), then against
    the row's own part (the pass's own tokens causally), one softmax over both (float32 at least).
    Masked by the lowest value: a padding query gets a finite output, which nothing reads."""
    batch, heads, n_query, dim = query.shape
    group = heads // layer.kv_heads
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lowest = torch.finfo(dtype).min
    own_valid = layer.token_index >= 0  # (B, G, N)
    own_bias = torch.zeros(own_valid.shape[:2] + (n_query, own_valid.shape[2]), dtype=dtype, device=query.device)
    own_bias.masked_fill_(~allowed_keys(own_valid, 0, n_query, n_query, own_valid.shape[2]), lowest)
    own_keys, own_values = (as_dtype(vectors, dtype) for vectors in (layer.keys, layer.values))  # (B, G, N, D)
    queries = as_dtype(query, dtype).reshape(batch, layer.kv_heads, group * n_query, dim) * scaling
    outputs = []
    for g in range(layer.kv_heads):
        keys, values = (as_dtype(layer.prefix_run(name, g)[0, 0], dtype) for name in ("keys", "values"))  # (n, D)
        mine = queries[:, g]  # (B, group x q, D)
        shared = (mine.reshape(batch * group * n_query, dim) @ keys.T).view(batch, group, n_query, -1)
        own = (mine @ own_keys[:, g].transpose(-1, -2)).view(batch, group, n_query, -1) + own_bias[:, g, None]
        empty = layer.prefix_run("token_index", g)[0, 0] < 0
        probs = torch.softmax(torch.cat([shared.masked_fill_(empty, lowest), own], dim=-1), dim=-1)
        width = keys.shape[0]
        output = (probs[..., :width].reshape(batch * group * n_query, width) @ values).view(
            batch, group, n_query, -1) + probs[..., width:].reshape(batch, group * n_query, -1).matmul(
            own_values[:, g]).view(batch, group, n_query, -1)
        outputs.append(output)
    return as_dtype(torch.cat(outputs, dim=1), query.dtype).transpose(1, 2).contiguous()


def _sliding_window(window, positions, query_pos):
    """A callable adding a sliding window to `allowed_keys` (None: it changes nothing); ``positions``
    (B, G|1, N): each slot's token index, ``query_pos`` (B, 1, q): the new tokens'."""
    newest = query_pos.max()
    if bool(newest - positions.masked_fill(positions < 0, newest).min() < window):
        return None

    def mask(q_start: int, q_end: int, n_visible: int) -> torch.Tensor:
        distance = query_pos[:, :, q_start:q_end, None] - positions[:, :, None, :n_visible]
        return distance < window  # (B, G, c, n_visible)

    return mask


def register() -> None:
    """Register d2o's attention and mask functions with transformers (idempotent)."""
    for backend, name in ATTENTION_NAMES.items():
        AttentionInterface.register(name, _make_attention(backend))
        AttentionMaskInterface.register(name, _padding_mask)


def check_family(config) -> None:
    """Refuse a model whose attention d2o cannot hook, naming its family."""
    family = getattr(config.get_text_config(), "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise D2OError(f"model family {family!r} is not supported: d2o hooks the attention of "
                       f"{', '.join(SUPPORTED_FAMILIES)}")


def check_backend(backend: str) -> None:
    if backend not in ATTENTION_NAMES:
        raise D2OError(f"attention backend {backend!r} is not supported: choose sdpa or eager")


def install(model, backend: str | None = None) -> None:
    """Route ``model``'s attention through d2o's hook; ``backend`` is "sdpa" (default) or "eager".
    Outputs are unchanged (the same kernels); only a ``CompressedCache`` compresses; ``uninstall``
    puts the model back."""
    check_family(model.config)
    current = model.config.get_text_config()._attn_implementation
    if backend is None:
        if current in ATTENTION_NAMES.values():
            return
        backend = "eager" if current == "eager" else "sdpa"
    check_backend(backend)
    register()
    if current not in ATTENTION_NAMES.values():
        setattr(model, STOCK_ATTRIBUTE, current)
    model.set_attn_implementation(ATTENTION_NAMES[backend])
    decoder = model.get_decoder()
    if not hasattr(decoder, HOOK_ATTRIBUTE):
        setattr(decoder, HOOK_ATTRIBUTE, _install_hooks(decoder, model.get_output_embeddings()))


def uninstall(model) -> None:
    """Undo ``install``: the model's own attention implementation again, and no forward hook."""
    decoder = model.get_decoder()
    handles = getattr(decoder, HOOK_ATTRIBUTE, None)
    if handles is not None:
        for handle in handles:
            handle.remove()
        delattr(decoder, HOOK_ATTRIBUTE)
    stock = getattr(model, STOCK_ATTRIBUTE, None)
    if stock is not None:
        model.set_attn_implementation(stock)
        delattr(model, STOCK_ATTRIBUTE)


def _install_hooks(decoder, lm_head) -> tuple:
    """Forward hooks on the decoder and the output embeddings; returns their handles. A pass's cache
    is bound before it and unbound after it, whatever happens. After it a d2o cache sees the tokens
    and compresses: after the final norm, so that policies may score by what the model predicted
    (surprisal); the next token's needs this pass's last logits, which the output head's hook hands
    over as the model computes them."""
    def awaiting_logits() -> list[CompressedCache]:
        """The cache of this model's pass whose logits come next, per thread as the bound caches are:
        two threads' passes (a server's prefill beside its decode steps) must not take each other's."""
        if not hasattr(_passes, "awaiting_logits"):
            _passes.awaiting_logits = {}
        return _passes.awaiting_logits.setdefault(id(decoder), [])

    def bind(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not hasattr(_passes, "caches"):
            _passes.caches = []
        _passes.caches.append(cache if isinstance(cache, CompressedCache) else None)

    def unbind(module, args, output):
        _passes.caches.pop()

    def end_of_decoder(module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, CompressedCache) and cache.prober.probing is not None:
            return  # a probe pass, run from the cache's own compression: observed, never kept
        awaiting_logits().clear()
        if isinstance(cache, CompressedCache):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if cache.policy.probes and cache.schedule.prefilling:
                if input_ids is None:
                    raise D2OError(f"{cache.policy.name} probes the model with the prompt's tokens: give input_ids, "
                                   f"not embeddings")
                cache.prober.record(input_ids, cache.layers[0].fresh_index(input_ids.shape[1]) >= 0)
            if cache.policy.needs_surprisal:
                if input_ids is None:
                    raise D2OError(f"{cache.policy.name} scores tokens by surprisal: give input_ids, not embeddings")
                if lm_head is None:
                    raise D2OError(f"{cache.policy.name} scores tokens by surprisal: it needs a model with its output "
                                   f"head (a ...ForCausalLM), not the bare decoder")
                cache.observe_tokens(input_ids, output.last_hidden_state, lm_head)
                awaiting_logits().append(cache)
            cache.schedule.end_of_forward()

    def logits(module, args, output):
        awaiting = awaiting_logits()
        if awaiting:
            awaiting.pop().observe_logits(args[0][:, -1], output[:, -1])

    handles = (decoder.register_forward_pre_hook(bind, with_kwargs=True),
               decoder.register_forward_hook(end_of_decoder, with_kwargs=True),
               decoder.register_forward_hook(unbind, always_call=True))
    return handles if lm_head is None else (*handles, lm_head.register_forward_hook(logits))
