"""KVzip (Kim et al., NeurIPS 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv 2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from d2o.engine.api import STATE_VALUE_BYTES, AttentionStats, Observed, ProbePass, StatsRequest
from d2o.methods.allocation import Allocation, ScoreShare
from d2o.methods.base import Method, check, register
from d2o.options import whole

RECALL = "recall"  # slot state: the most attention a token received while the context was repeated

# The prompts of the authors' code and of kvpress 0.5.5, word for word.
REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with"
# At most this many tokens for a request and the chat template's end of turn (a memory plan's bound:
# about 20 on the supported tokenizers, 67 with one token per byte).
REQUEST_TOKENS = 128


@register
@dataclass
class KVzip(Method):
    """After the prefill, the model is asked to repeat the context and fed it back (teacher forcing:
    "Repeat the previous context exactly." + the end of a user turn + the context), ``chunk``
    tokens at a time; each later chunk's prompt asks to repeat "starting with" the ``overlap`` last
    tokens of the one before. A token's score is the most attention any query of that
    reconstruction, in any head of its KV head's group, pays it; the attention of a chunk's
    queries is normalised over the ``n_sinks`` first tokens, the chunk and the reconstruction's
    own tokens, as in the authors' code. The reconstruction's tokens then leave the cache (each
    chunk's before the next is fed). Budgets: one threshold over every layer's scores (``ScoreShare``:
    a layer keeps as many tokens as it has among the row's highest scores); the first 4 tokens
    always stay; no recent window; nothing is evicted while decoding (a question and its answer are
    added to the compressed context). Cost: a second pass over the context, each chunk's queries
    attending to the whole context (``d2o bench prefill --methods kvzip``).

    Choices and differences from the authors' code and kvpress's ``KVzipPress`` (0.5.5):
    - By default (``heads=even``) every KV head of a layer keeps as many tokens: the global
      threshold sets each layer's count, the heads share it evenly and each keeps its own best.
      KVzip lets each KV head keep its own count: ``heads=adaptive`` does, within each layer's
      count, with a floor of ``head_floor`` (0.2) of the even share per head (0: KVzip's, none).
    - The end of the user turn is the tokenizer's chat template's (kvpress's rule; "\\n" without a
      template); the authors' code writes one per model family. The whole prompt is reconstructed
      (kvpress skips a chat template's opening, which a raw prompt does not have).
    - Scores and softmax in float32 (the authors' code: the model's dtype); chunks of 2048 tokens
      (kvpress; the authors' code: 2000); the library's floor under ratio budgets
      (``--min-tokens``) holds every layer up to it.
    - The probe's tokens sit at the positions after the context, so a context within a chunk of
      the model's last position is probed past it (RoPE extrapolates there).
    """

    name = "kvzip"
    summary = "KVzip: tokens scored by the attention they get while the model repeats the context (query-agnostic)"
    evicts_during_decode = False
    probes = True

    n_sinks: int = 4
    allocation: Allocation = field(default_factory=ScoreShare)
    chunk: int = 2048
    overlap: int = 8

    def __post_init__(self):
        super().__post_init__()
        check(whole(self.chunk) and self.chunk >= 1, "chunk", self.chunk, "must be a whole number of tokens >= 1")
        check(whole(self.overlap) and self.overlap >= 0, "overlap", self.overlap, "must be a whole number >= 0")

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES

    def probe(self, cache, prompts: list[list[int]]) -> list[ProbePass]:
        return reconstruction(cache.tokenizer, prompts, self.chunk, self.overlap)

    def probe_tokens(self, prompt_tokens: int) -> int:
        return min(prompt_tokens, self.chunk) + self.overlap + REQUEST_TOKENS

    def stats_request(self, layer, n_query: int) -> StatsRequest | None:
        probe = layer.cache.probing
        if probe is None:
            return None
        return StatsRequest(column_max=True, visible=chunk_keys(layer, probe, self.n_sinks))

    def observe(self, layer, stats: AttentionStats) -> Observed | None:
        probe = layer.cache.probing
        if probe is None or stats.column_max is None:
            return None
        return Observed({RECALL: recalled(layer, probe, stats.column_max.amax(dim=2))})

    def score(self, layer) -> torch.Tensor:
        # The sinks score highest (kvpress), so that the threshold over layers counts them as kept.
        sinks = (layer.token_index >= 0) & (layer.token_index < self.n_sinks)
        return layer.slot_state[RECALL].masked_fill(sinks, torch.finfo(torch.float32).max)


def reply_suffix(tokenizer) -> str:
    """What the chat template puts between a user's message and the model's reply (kvpress's rule:
    a dummy message is templated and cut after its text); "\\n" when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                         add_generation_prompt=True, tokenize=False)
    return text.split(separator)[-1]


def reconstruction(tokenizer, prompts: list[list[int]], chunk: int, overlap: int) -> list[ProbePass]:
    """KVzip's probe: for each ``chunk`` of every row's prompt, the request to repeat it and the
    chunk itself (pass i holds every row's chunk i; a row with fewer chunks sits it out)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    first, later, suffix = encode(REPEAT), encode(REPEAT_PART), encode(reply_suffix(tokenizer))
    passes = []
    for start in range(0, max(len(prompt) for prompt in prompts), chunk):
        ids, spans = [], []
        for prompt in prompts:
            end = min(len(prompt), start + chunk)
            if start >= end:
                ids.append([])
                spans.append((len(prompt), len(prompt)))
                continue
            ask = first if start == 0 else later + prompt[max(0, start - overlap):start]
            ids.append(ask + suffix + prompt[start:end])
            spans.append((start, end))
        passes.append(ProbePass(ids, spans))
    return passes


def _span_bounds(layer, probe: ProbePass) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, 1, 1) each: the span's start and end, and where the probe's own tokens begin."""
    device = layer.token_index.device
    start, end = (torch.tensor(bound, device=device)[:, None, None] for bound in zip(*probe.spans))
    fed = torch.tensor([len(ids) for ids in probe.ids], device=device)
    return start, end, (layer.real_seen - fed)[:, None, None]


def chunk_keys(layer, probe: ProbePass, n_sinks: int) -> torch.Tensor | None:
    """(B, G, N) bool: the slots a reconstruction's attention is normalised over (the first
    ``n_sinks`` tokens before the chunk, the chunk, the probe's own tokens); None when that is
    every slot (a context of one chunk)."""
    start, end, own = _span_bounds(layer, probe)
    index = layer.token_index
    visible = (index < torch.clamp(start, max=n_sinks)) | ((index >= start) & (index < end)) | (index >= own)
    return None if bool(visible[index >= 0].all()) else visible


def recalled(layer, probe: ProbePass, scores: torch.Tensor) -> torch.Tensor:
    """The slot state ``recall`` with ``scores`` (B, G, N) for the tokens the probe is about."""
    start, end, _ = _span_bounds(layer, probe)
    index = layer.token_index
    inside = (index >= start) & (index < end)
    recall = layer.slot_state.get(RECALL)
    return torch.where(inside, scores, 0.0 if recall is None else recall)
