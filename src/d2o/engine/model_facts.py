"""What a cache needs to know of its model: which layers slide, head sizes, RoPE tables, the tokenizer."""

from __future__ import annotations

import inspect
import weakref
from functools import lru_cache

import torch

from d2o.errors import D2OError


def sliding_windows(config) -> list[int | None]:
    """Per layer its sliding window, or None where it attends to every token. Hybrid models (Gemma 3)
    name each layer's kind in ``layer_types``; without them a ``sliding_window`` slides every layer
    (Mistral 7B v0.1), as transformers reads it."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or \
        ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" and window else None for kind in kinds]


def head_dim(config) -> int:
    """Channels per attention head: the config's ``head_dim``, or the hidden size shared."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def compressible_layers(windows: list[int | None], unlimited: bool) -> list[int]:
    """The layers a budget shares: those attending to every token (a sliding one keeps its window)."""
    layers = [i for i, window in enumerate(windows) if window is None]
    if not layers and not unlimited:
        raise D2OError(f"every layer of this model attends over a sliding window of {windows[0]} tokens, so its "
                       f"cache is bounded by the window already; d2o's methods compress full-attention layers, and "
                       f"it has none (within the window, the same model with sliding_window=None attends alike)")
    return layers


@lru_cache(maxsize=8)
def _saved_tokenizer(path: str):
    """The tokenizer saved with a model at ``path`` (a folder, or a name transformers resolves)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ModelFacts:
    """A cache's model, held weakly (a cache must not keep it alive, nor be deep-copied with it): its
    text config, its decoder, its RoPE tables and its tokenizer."""

    def __init__(self, decoder, config, tokenizer=None):
        self._decoder = decoder if isinstance(decoder, weakref.ref) else weakref.ref(decoder)
        self.config = config
        self._tokenizer = tokenizer

    def decoder(self):
        decoder = self._decoder()
        if decoder is None:
            raise D2OError("the model this cache was made for is gone")
        return decoder

    def tokenizer(self, needed_by: str):
        """The tokenizer given, else the one saved with the model (``needed_by``: the method asking)."""
        if self._tokenizer is None:
            path = getattr(self.config, "_name_or_path", "") or ""
            try:
                if not path:
                    raise OSError("the model was not loaded from a folder")
                self._tokenizer = _saved_tokenizer(path)
            except (OSError, ValueError) as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise D2OError(f"{needed_by} writes text of its own into its probe and needs the model's "
                               f"tokenizer, which cannot be loaded from {path!r} ({first}): give it, "
                               f"CompressedCache(..., tokenizer=tokenizer)") from None
        return self._tokenizer

    def rotary(self, layer_idx: int, positions: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables of the model's RoPE at ``positions`` (B, n) in a layer, (B, n, D) each."""
        rotary = getattr(self.decoder(), "rotary_emb", None)
        if rotary is None:
            raise D2OError("this method reads the model's rotary embedding, and this model's decoder has none")
        carrier = torch.empty((), dtype=dtype, device=positions.device)
        kinds = getattr(self.config, "layer_types", None)
        if kinds and "layer_type" in inspect.signature(rotary.forward).parameters:  # per kind of layer (Gemma 3)
            return rotary(carrier, positions, kinds[layer_idx])
        return rotary(carrier, positions)
