"""KV budgets: a ratio of the prompt (``0.2``) or an absolute number of tokens per layer (``128t``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from d2o.errors import D2OError
from d2o.options import whole

UNLIMITED = -1  # a layer budget that never evicts (an exempt layer, or a budget covering everything)
# No layer of a ratio budget is brought below min(tokens seen, MIN_TOKENS): short prompts keep
# their answers. Chosen by measurement (docs/results/floor.md, benchmarks/floor.py).
MIN_TOKENS = 128
# Decode steps between evictions when generating, answering a compressed context, serving and
# benchmarking (a layer runs up to 7 tokens over its budget, then one pass brings it back): D2O's
# step costs 1.00x the full cache's at 1K where evicting every step costs 1.11x, with the same answers
# on the committed tasks (docs/benchmarks/README.md, docs/results/evict-every-8); 16 or 32 are 1-2%
# faster and hold 8 or 24 slots more per layer. `d2o eval` and a
# `CompressedCache` made by hand evict at every step, as the methods' papers do, unless told.
EVICT_EVERY = 8
MOST_TOKENS = 2**40  # above any model's positions; a larger count would overflow the totals' int64 arithmetic


@dataclass(frozen=True)
class Budget:
    """How many KV tokens a compressed cache may hold, on average per layer.

    Exactly one of ``ratio`` (a fraction of the prompt's real tokens, 0 < ratio <= 1) and ``tokens``
    (an absolute per-layer count) is set. The total over layers is what every method is held to:
    ``max(round(L * ratio * S), L * min(S, min_tokens))`` or ``L * tokens``. Under a ratio no layer
    is brought below ``min(tokens seen, min_tokens)`` (the floor): a prompt shorter than it is never
    compressed, and the floor is part of every method's budget alike. Token budgets have no floor.
    """

    ratio: float | None = None
    tokens: int | None = None
    min_tokens: int = MIN_TOKENS
    # True when the floor was asked for (``min_tokens`` given), not the default: a method that
    # reproduces code without a floor (d2o-official) then keeps it.
    floor_given: bool = field(default=False, compare=False)

    def __post_init__(self):
        if (self.ratio is None) == (self.tokens is None):
            raise D2OError("a budget is either a ratio (0.2) or a token count (128t), not both or neither")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise D2OError(f"budget ratio must be in (0, 1], got {self.ratio:g}")
        if self.tokens is not None and (not whole(self.tokens) or not 1 <= self.tokens <= MOST_TOKENS):
            raise D2OError(f"budget must be a whole number of tokens per layer from 1 to 2**40, got {self.tokens!r}")
        if not whole(self.min_tokens) or not 0 <= self.min_tokens <= MOST_TOKENS:
            raise D2OError(f"min_tokens must be a whole number from 0 to 2**40, got {self.min_tokens!r}")

    @classmethod
    def parse(cls, value: Budget | str | float | int, min_tokens: int | None = None) -> Budget:
        """``0.2`` / ``"0.2"`` -> ratio; ``"128t"`` / ``"128tok"`` / ``"128tokens"`` -> tokens per layer;
        ``min_tokens`` replaces the floor (None: keep it)."""
        if min_tokens is not None:
            return replace(cls.parse(value), min_tokens=min_tokens, floor_given=True)
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise D2OError(f"budget must be a ratio or a token count, got {value!r}")
        if isinstance(value, (int, float)):
            return cls(ratio=float(value))
        text = str(value).strip().lower()
        for suffix in ("tokens", "tok", "t"):
            if text.endswith(suffix):
                number = text[: -len(suffix)].strip()
                if not (number.isascii() and number.isdigit()):  # not '²', which int() refuses
                    raise D2OError(f"budget {value!r}: a token budget is a whole number followed by 't', e.g. 128t")
                return cls(tokens=int(number))
        try:
            ratio = float(text)
        except ValueError:
            raise D2OError(f"budget {value!r} is neither a ratio (0.2) nor a token count (128t)") from None
        return cls(ratio=ratio)

    @property
    def unlimited(self) -> bool:
        """The whole sequence, now and as it grows: nothing is ever evicted."""
        return self.ratio == 1.0

    def floor(self, seen: int) -> int:
        """The fewest tokens a layer keeps after ``seen`` tokens (0 under a token budget)."""
        return min(seen, self.min_tokens) if self.ratio is not None else 0

    def total(self, n_layers: int, prompt_tokens: int) -> int:
        """Total KV tokens over ``n_layers`` layers for a prompt of ``prompt_tokens`` real tokens."""
        if self.ratio is not None:
            return max(round(n_layers * self.ratio * prompt_tokens), n_layers * self.floor(prompt_tokens))
        return n_layers * self.tokens

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else f"{self.tokens}t"

    @property
    def described(self) -> str:
        """For a reader: the budget and, under a ratio, its floor (which moves short prompts' figures)."""
        return f"{self} (floor {self.min_tokens})" if self.ratio is not None and self.min_tokens else str(self)


def parse_budgets(values, min_tokens: int | None = None) -> list[Budget]:
    """``Budget.parse`` of each of ``values``; a floor (``min_tokens``) given where every budget is a
    token budget, which has none, is refused rather than ignored."""
    budgets = [Budget.parse(value, min_tokens) for value in values]
    if min_tokens is not None and budgets and all(budget.ratio is None for budget in budgets):
        raise D2OError(f"min_tokens={min_tokens} (--min-tokens) is the floor of a ratio budget; a token budget "
                       f"({', '.join(map(str, budgets))}) has none: each layer holds exactly its count")
    return budgets
