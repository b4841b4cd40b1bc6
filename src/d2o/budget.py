"""KV budgets: a ratio of the prompt (``0.2``) or an absolute number of tokens per layer (``128t``)."""

from __future__ import annotations

from dataclasses import dataclass

from d2o.errors import D2OError

UNLIMITED = -1  # a layer budget that never evicts (an exempt layer, or a budget covering everything)


@dataclass(frozen=True)
class Budget:
    """How many KV tokens a compressed cache may hold, on average per layer.

    Exactly one of ``ratio`` (a fraction of the prompt's real tokens, 0 < ratio <= 1) and ``tokens``
    (an absolute per-layer count) is set. The total over layers is what every method is held to:
    ``round(L * ratio * S)`` or ``L * tokens`` (never more than the ``L * S`` the prompt fills).
    """

    ratio: float | None = None
    tokens: int | None = None

    def __post_init__(self):
        if (self.ratio is None) == (self.tokens is None):
            raise D2OError("a budget is either a ratio (0.2) or a token count (128t), not both or neither")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise D2OError(f"budget ratio must be in (0, 1], got {self.ratio:g}")
        if self.tokens is not None and self.tokens < 1:
            raise D2OError(f"budget must be at least 1 token per layer, got {self.tokens}")

    @classmethod
    def parse(cls, value: Budget | str | float | int) -> Budget:
        """``0.2`` / ``"0.2"`` -> ratio; ``"128t"`` / ``"128tok"`` / ``"128tokens"`` -> tokens per layer."""
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
                if not number.isdigit():
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

    def total(self, n_layers: int, prompt_tokens: int) -> int:
        """Total KV tokens over ``n_layers`` layers for a prompt of ``prompt_tokens`` real tokens."""
        if self.ratio is not None:
            return round(n_layers * self.ratio * prompt_tokens)
        return n_layers * self.tokens

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else f"{self.tokens}t"
