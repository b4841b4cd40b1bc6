"""SirLLM (Yao et al., ACL 2024, "SirLLM: Streaming Infinite Retentive LLM", arXiv 2405.12528)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.engine.api import STATE_VALUE_BYTES, TokenValues
from d2o.methods.base import HeavyRecent, check, register
from d2o.methods.scoring import SURPRISAL


@register
@dataclass
class SirLLM(HeavyRecent):
    """StreamingLLM plus the tokens of highest token entropy: a token's score is its surprisal
    -log p(x_t | x_<t) under the model itself (the paper's intent; the released code scores the
    previous token, an off-by-one), multiplied by ``decay`` at every later forward pass (the paper
    decays per dialogue turn; 1.0, its default, keeps scores as they are). 4 sinks; the rest of
    each layer's budget split 1:1 between high-entropy and recent tokens (its CLI defaults,
    1000 + 1000). Every layer and head keeps the same tokens.

    Two differences from the released code, for a single long prompt: it evicts only between
    dialogue turns (here: at the end of the prefill and at every decode step, as every method
    here does), and it picks its high-entropy tokens among all tokens, the recent ones included,
    then fills up with the newest (here the newest half is kept first and the most surprising of
    the rest fill the other half: more old tokens are kept when surprising tokens are recent)."""

    name = "sirllm"
    summary = "SirLLM: 4 sinks + high token-entropy (surprisal) tokens with decay + recent window"
    needs_surprisal = True

    n_sinks: int = 4
    decay: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check(0.0 < self.decay <= 1.0, "decay", self.decay, "must be in (0, 1]")

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues:
        return TokenValues({SURPRISAL: surprisal}, decay={SURPRISAL: self.decay})

    def score(self, layer) -> torch.Tensor:
        return layer.slot_state[SURPRISAL]

    def slot_state_bytes(self, group: int) -> int:
        return STATE_VALUE_BYTES
