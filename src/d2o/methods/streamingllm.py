"""StreamingLLM (Xiao et al., ICLR 2024, arXiv 2309.17453): attention sinks + a local window."""

from __future__ import annotations

from dataclasses import dataclass

from d2o.methods.base import Method, recency, register


@register
@dataclass
class StreamingLLM(Method):
    """The first ``n_sinks`` tokens (4 in the paper: "4 initial tokens suffice") and the last
    B - 4. Kept keys keep their original positions (RoPE is applied before caching); the paper's
    re-assignment of positions inside the cache, needed only beyond the pretraining length, is
    not done (as in kvpress without KeyRerotationPress)."""

    name = "streamingllm"
    summary = "StreamingLLM: 4 attention sinks + the most recent tokens"

    n_sinks: int = 4

    def score(self, layer):
        return recency(layer)
