"""Token scores: which tokens a layer keeps when it must evict (higher = keep).

H2O and D2O score a token by the attention it has received (``AccumulatedAttention``: the D2O
paper's token level). ``BlendedScores`` adds what that score misses when the question comes at
the end of a long prompt, or only after the context was compressed: the attention of the prompt's
last queries (which see the question), and each token's surprisal under the model (new
information, whatever is asked later).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from d2o.engine.api import QUESTION, STATE_VALUE_BYTES, AttentionStats, Observed, StatsRequest, TokenValues
from d2o.errors import D2OError
from d2o.options import whole

MASS, VOTES, SURPRISAL, NOVELTY, WORD = "mass", "votes", "surprisal", "novelty", "word"  # slot state


class Scoring(Protocol):
    """The part of a method that scores tokens: the statistics it needs, and the scores."""

    needs_surprisal: bool
    keeps: tuple[str, ...]  # the slot states it keeps (what a merge may weigh tokens by)

    def stats_request(self, layer, n_query: int) -> StatsRequest | None: ...

    def observe(self, layer, stats: AttentionStats) -> Observed: ...

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues | None: ...

    def once_allocated(self, layer) -> Observed | None: ...

    def score(self, layer) -> torch.Tensor: ...

    def slot_state_bytes(self, group: int, allocated: bool = False) -> int:
        """Bytes of the slot states it keeps, per slot and KV head of ``group`` query heads, at most
        (``allocated``: from the final allocation on)."""


@dataclass
class AccumulatedAttention:
    """The attention a token has received so far (column mass of the prefill, then every decode
    query's attention), summed over the query heads of its KV head, in float32.

    The mass is kept per query head because D2O's allocation reads its spread in each
    (``InverseVariance``); a score reads only its sum. ``sum_heads``: once the budgets are final,
    the mass is kept summed (one value per slot and KV head instead of one per query head: a row's
    bookkeeping shrinks by ``group - 1`` floats a slot). The scores are the same sums, added in
    another order while decoding (the last bits of a float may differ)."""

    needs_surprisal: ClassVar[bool] = False
    sum_heads: bool = False

    def __post_init__(self):
        if not isinstance(self.sum_heads, bool):
            raise D2OError(f"sum_heads={self.sum_heads!r} must be true or false")

    @property
    def keeps(self) -> tuple[str, ...]:
        return (MASS,)

    def slot_state_bytes(self, group: int, allocated: bool = False) -> int:
        return STATE_VALUE_BYTES * (1 if allocated and self.sum_heads else group)  # the mass, of each query head

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        return StatsRequest(column_mass=True)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        mass, held = column_mass(stats), layer.slot_state.get(MASS)
        if held is not None and held.shape[-1] < mass.shape[-1]:  # kept summed (``sum_heads``)
            mass = mass.sum(-1, keepdim=True)
        return Observed(added={MASS: mass})

    def once_allocated(self, layer) -> Observed | None:
        mass = layer.slot_state.get(MASS)
        if not self.sum_heads or mass is None or mass.shape[-1] == 1:
            return None
        return Observed(slot_state={MASS: mass.sum(-1, keepdim=True)})

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues | None:
        return None

    def score(self, layer) -> torch.Tensor:
        return layer.slot_state[MASS].sum(-1)


@dataclass
class BlendedScores(AccumulatedAttention):
    """Three shares, each normalised to sum to one over a head's held tokens, then added:

    - accumulated attention, divided by the queries that could see each token when ``mean``
      (so an early token is not preferred for having been seen by more queries);
    - the votes of the latest queries: at the prefill the prompt's last ``window`` (SnapKV's
      observation window: a question at the end of the prompt points at what it needs), then each
      pass's own (a question fed after the context was compressed, each new token). ``votes="max"``
      scores a token by the strongest attention any of those queries (any head of its group) pays
      it, ``"sum"`` by their total (SnapKV's rule, under which many weak attentions of the context's
      own queries outvote the one strong look of a retrieving query);
    - the token's surprisal ``-log p(token | before)`` in a pass, weighted by ``surprisal``: what
      the model could not predict is information, wherever the question comes. ``surprisal=0``
      drops the share (and the logits it costs);
    - the novelty of the token's sentence, weighted by ``novelty``: the mean surprisal of its
      sentence (the tokens up to one whose text ends a sentence or a line, at most
      ``sentence_limit`` of them). A fact a later question asks about is a sentence the model
      could not predict as a whole, off the surrounding text's topic, and it is kept whole; a
      token's own surprisal finds rare words everywhere, a needle's digits less than a rare name.
      A sentence split between two passes (a chunked prefill, decoding) counts as two.

    Votes and surprisal then spread in token order: a vote on a token reaches the ``span[0]``
    tokens before it and the ``span[1]`` after it (each token keeps the largest that reaches it;
    ``span=(3, 3)`` is SnapKV's max-pool kernel of 7). Reading goes forward: a query that finds a
    token next reads the tokens that follow it (the digits after a passkey's first, the rest of a
    needle's phrase, each found by the previous one only once it is generated), so a vote reaches
    further forward than back; a surprising token opens new information that runs on for a
    clause (``surprisal_span``).

    ``words``: a vote then reaches every token of the word it lands in (the tokens from one whose
    text begins with a blank to the next such, at most ``word_limit``). A value copied out of the
    context is read token by token after the one the question finds, and a long one (a UUID: 30 to
    38 tokens; a number written digit by digit) runs past any fixed span: its first tokens are
    kept and the answer invents the rest. Spread over its word, the vote keeps the value whole; a
    word of prose is one to three tokens, which the span reaches already.
    """

    mean: bool = False
    window: int = 32
    votes: str = "max"
    span: tuple[int, int] = (3, 8)
    surprisal: float = 2.0
    surprisal_span: tuple[int, int] = (3, 16)
    novelty: float = 0.0
    sentence_limit: int = 64
    words: bool = False
    word_limit: int = 64

    def __post_init__(self):
        super().__post_init__()
        if not whole(self.window) or self.window < 0:
            raise D2OError(f"window={self.window!r} must be a whole number >= 0")
        if self.votes not in VOTE_RULES:
            raise D2OError(f"votes={self.votes!r} must be one of {', '.join(VOTE_RULES)}")
        for name in ("span", "surprisal_span"):
            value = getattr(self, name)
            if (not isinstance(value, (tuple, list)) or len(value) != 2
                    or any(not whole(v) or v < 0 for v in value)):
                raise D2OError(f"{name}={value!r} must be two whole numbers >= 0: the tokens before and after "
                               f"a voted one")
            setattr(self, name, tuple(value))
        for name in ("surprisal", "novelty"):
            if not getattr(self, name) >= 0:
                raise D2OError(f"{name}={getattr(self, name)!r} must be >= 0")
        for name in ("sentence_limit", "word_limit"):
            if not whole(getattr(self, name)) or getattr(self, name) < 1:
                raise D2OError(f"{name}={getattr(self, name)!r} must be a whole number of tokens >= 1")
        if not isinstance(self.words, bool):
            raise D2OError(f"words={self.words!r} must be true or false")

    @property
    def needs_surprisal(self) -> bool:
        # The words are read from the new tokens' ids, handed over with their surprisal.
        return self.surprisal > 0 or self.novelty > 0 or self.reads_words

    @property
    def reads_words(self) -> bool:
        return self.words and self.window > 0

    @property
    def keeps(self) -> tuple[str, ...]:
        return ((MASS,) + ((VOTES,) if self.window else ()) + ((SURPRISAL,) if self.surprisal else ())
                + ((NOVELTY,) if self.novelty else ()) + ((WORD,) if self.reads_words else ()))

    def slot_state_bytes(self, group: int, allocated: bool = False) -> int:
        return super().slot_state_bytes(group, allocated) + STATE_VALUE_BYTES * (len(self.keeps) - 1)  # one value each

    def stats_request(self, layer, n_query: int) -> StatsRequest:
        probe = layer.cache.probing
        if probe is not None and probe.tag == QUESTION:  # the question shown after a chunk: it votes, once
            return StatsRequest(window=self.window)
        # The votes are replaced by every pass and read only by an eviction: none after a pass none follows.
        return StatsRequest(column_mass=True, window=self.window if layer.cache.may_evict_after(n_query) else 0)

    def observe(self, layer, stats: AttentionStats) -> Observed:
        observed = Observed() if stats.column_mass is None else super().observe(layer, stats)
        if stats.window is not None:  # the votes of this pass's last queries replace the last pass's
            # (B, G, N): over the group's heads and the window's queries (padding queries' rows are 0)
            votes = stats.window.amax(dim=(2, 3)) if self.votes == "max" else stats.window.sum(dim=(2, 3))
            observed.slot_state[VOTES] = spread_in_token_order(votes, layer.token_index, self.span)
        return observed

    def observe_tokens(self, cache, surprisal: torch.Tensor, input_ids: torch.Tensor) -> TokenValues:
        values = {}
        if self.surprisal:
            values[SURPRISAL] = spread(surprisal, self.surprisal_span)
        if self.novelty or self.reads_words:
            index = cache.layers[0].fresh_index(input_ids.shape[1])
        if self.novelty:
            ends = sentence_ends(cache.tokenizer, cache.vocab_size).to(input_ids.device)[input_ids]
            values[NOVELTY] = sentence_means(surprisal, ends, index >= 0, self.sentence_limit)
        if self.reads_words:
            starts = word_starts(cache.tokenizer, cache.vocab_size).to(input_ids.device)[input_ids]
            values[WORD] = word_first_tokens(index, starts, self.word_limit).float()
        return TokenValues(values)

    def score(self, layer) -> torch.Tensor:
        empty = layer.token_index < 0
        mass = layer.slot_state[MASS].sum(-1)
        if self.mean:
            mass = mass / (layer.real_seen[:, None, None] - layer.token_index).clamp_min(1)
        total = share(mass, empty)
        if VOTES in layer.slot_state:
            votes = layer.slot_state[VOTES]
            if WORD in layer.slot_state:
                votes = max_over_words(votes, layer.slot_state[WORD].long(), ~empty, layer.seen)
            total += share(votes, empty)
        if self.surprisal and SURPRISAL in layer.slot_state:
            total += self.surprisal * share(layer.slot_state[SURPRISAL], empty)
        if self.novelty and NOVELTY in layer.slot_state:
            total += self.novelty * share(layer.slot_state[NOVELTY], empty)
        return total


VOTE_RULES = ("max", "sum")


def scoring_named(name: str) -> Scoring:
    """A scoring by name: accumulated (H2O's, the D2O paper's) or blended."""
    scorings = {"accumulated": AccumulatedAttention, "blended": BlendedScores}
    if name not in scorings:
        raise D2OError(f"scoring={name!r} must be one of {', '.join(scorings)}")
    return scorings[name]()


def share(scores: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``scores`` (B, G, N) over the slots not ``empty``, normalised to sum to one per row and head."""
    scores = scores.float().masked_fill(empty, 0.0)
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-12)


def spread(values: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Over the last dimension, each value reaches the ``span[0]`` positions before it and the
    ``span[1]`` after it: a position gets the largest value reaching it (a 1-D max pool of
    ``values`` >= 0, shape kept)."""
    before, after = span
    if after == before == 0:
        return values
    flat = F.pad(values.reshape(-1, 1, values.shape[-1]), (after, before))  # position t: t-after .. t+before
    return F.max_pool1d(flat, before + after + 1, stride=1).view(values.shape)


def spread_in_token_order(values: torch.Tensor, token_index: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """``spread`` of ``values`` (B, G, N) over each slot's neighbours in token order (slots hold
    tokens in no order; empty ones, -1, neither give nor get a value)."""
    empty = token_index < 0
    if span == (0, 0):
        return values.masked_fill(empty, 0.0)
    order = token_index.masked_fill(empty, torch.iinfo(token_index.dtype).max).argsort(dim=-1)  # empty ones last
    spread_values = spread(values.masked_fill(empty, 0.0).gather(-1, order), span)
    return torch.empty_like(spread_values).scatter_(-1, order, spread_values).masked_fill_(empty, 0.0)


def column_mass(stats: AttentionStats) -> torch.Tensor:
    """This pass's column mass as the slot state ``mass`` holds it, (B, G, N, group) float32: the
    attention accumulated per query head, added to what earlier passes gave."""
    return stats.column_mass.permute(0, 1, 3, 2)


# A token whose text holds one of these ends a sentence (or a line).
SENTENCE_END = re.compile(r"[.!?\n\u3002\uff01\uff1f]")  # . ! ? a line break, and the ideographic ones


@lru_cache(maxsize=4)
def token_texts(tokenizer, size: int) -> tuple[str, ...]:
    """The text of each of the first ``size`` token ids, decoded alone."""
    return tuple(tokenizer.batch_decode([[i] for i in range(size)]))


def token_flags(tokenizer, vocab_size: int, flag) -> torch.Tensor:
    """(vocab_size,) bool: ``flag(text)`` for each token id's text (ids the tokenizer lacks: False)."""
    texts = token_texts(tokenizer, min(len(tokenizer), vocab_size))
    flags = torch.zeros(vocab_size, dtype=torch.bool)
    flags[:len(texts)] = torch.tensor([flag(text) for text in texts])
    return flags


@lru_cache(maxsize=4)
def sentence_ends(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) bool: the token ids whose text ends a sentence."""
    return token_flags(tokenizer, vocab_size, lambda text: bool(SENTENCE_END.search(text)))


@lru_cache(maxsize=4)
def word_starts(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) bool: the token ids whose text begins with a blank (a space, a line break)."""
    return token_flags(tokenizer, vocab_size, lambda text: text[:1].isspace())


def word_first_tokens(token_index: torch.Tensor, starts: torch.Tensor, limit: int) -> torch.Tensor:
    """(B, q): the token index of each token's word's first token: a word runs from a token that
    ``starts`` one (or the pass's first) up to the next, cut every ``limit`` tokens; padding (-1)
    keeps -1. A word split between two passes counts as two."""
    begins = starts.clone()
    begins[:, 1:] |= token_index[:, :-1] < 0  # the first real token after padding
    return token_index.gather(1, segment_starts(begins, limit)).masked_fill(token_index < 0, -1)


def segment_starts(begins: torch.Tensor, limit: int) -> torch.Tensor:
    """(B, q): the position of each position's segment's first, a segment running from the pass's
    first position or one where ``begins`` up to the next, cut every ``limit`` positions."""
    batch, n = begins.shape
    position = torch.arange(n, device=begins.device).expand(batch, n)
    start = torch.where(begins, position, 0).cummax(dim=1).values
    return start + (position - start) // limit * limit


def max_over_words(values: torch.Tensor, word: torch.Tensor, valid: torch.Tensor, seen: int) -> torch.Tensor:
    """``values`` (B, G, N) >= 0, each slot's replaced by the largest among the valid slots of its
    word (``word``: its word's first token index, below ``seen``); invalid slots get 0."""
    word = word.masked_fill(~valid, 0)
    values = values.masked_fill(~valid, 0.0)
    most = values.new_zeros(*values.shape[:-1], seen).scatter_reduce_(-1, word, values, "amax")
    return most.gather(-1, word).masked_fill_(~valid, 0.0)


def sentence_means(values: torch.Tensor, ends: torch.Tensor, real: torch.Tensor, limit: int) -> torch.Tensor:
    """(B, q): each real token's value replaced by the mean over its sentence, the tokens after one
    that ends a sentence (``ends``) up to and including the next such token, cut every ``limit``
    tokens; padding (``real`` False) neither counts nor gets one."""
    batch, n = values.shape
    ends = (ends & real) | ~real  # each padding token a sentence of its own, weighing nothing
    start = segment_starts(F.pad(ends[:, :-1], (1, 0)), limit)  # a sentence begins after an end
    _, sentence = torch.unique(start + torch.arange(batch, device=values.device)[:, None] * n, return_inverse=True)
    weight = real.to(values.dtype)
    sums = values.new_zeros(int(sentence.max()) + 1).index_add_(0, sentence.flatten(), (values * weight).flatten())
    counts = values.new_zeros(sums.shape).index_add_(0, sentence.flatten(), weight.flatten())
    return (sums / counts.clamp_min(1))[sentence] * weight
