"""Keys and values stored at 8, 4 or 2 bits: the codec a quantized cache layer stores its slots with.

Each token's key and value vectors are cut into groups of ``group_size`` channels; a group keeps
its minimum (the zero point) and its step ``(max - min) / (2**bits - 1)`` in float16, and every
channel the nearest level, packed ``8 // bits`` to a byte (asymmetric min-max quantization, as in
KIVI's values and transformers' quanto back-end).

KIVI quantizes keys per channel, over groups of consecutive tokens. Here keys are quantized per
token too, because eviction and merging work token by token: a token's bytes, step and zero point
are its slot's own, so evicting a token, gathering the kept ones into fewer slots, or merging into
one slot never re-quantizes another token (with per-channel groups each of those would
re-quantize the group it falls in). What per-channel groups buy KIVI, the outlier channels of keys
staying accurate, the residual gives the newest tokens here: they are also held in full precision
and read in full precision (``residual``), until newer ones replace them.

Plain torch: the packed bytes must be ordinary tensors that slot operations (gather, scatter,
concatenation along slots and rows) apply to like any other per-slot tensor. optimum-quanto's and
HQQ's quantized tensors are opaque subclasses quantized along whole tensors, and on a CPU they
dequantize with torch operations too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2o.errors import D2OError
from d2o.options import check_kv_bits, whole

SCALE_DTYPE = torch.float16  # each group's step and zero point
PARTS = ("data", "scale", "zero")  # what one quantized tensor is stored as, each (B, G, N, ...)


@dataclass(frozen=True)
class KVQuantization:
    """How a cache stores keys and values: ``bits`` per channel, ``group_size`` channels sharing a
    step and zero point, the newest ``residual`` tokens of each row and KV head also held in full
    precision."""

    bits: int = 4
    group_size: int = 32
    residual: int = 32

    def __post_init__(self):
        if check_kv_bits(self.bits) is None:
            raise D2OError("KVQuantization needs bits: 8, 4 or 2")
        if not whole(self.group_size) or self.group_size < 1:
            raise D2OError(f"kv_group_size={self.group_size!r} must be a whole number of channels >= 1")
        if not whole(self.residual) or self.residual < 0:
            raise D2OError(f"kv_residual={self.residual!r} must be a whole number of tokens >= 0")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def check(self, dim: int) -> None:
        """Refuse a head dimension the groups or the packing do not divide."""
        if dim % self.group_size or dim % self.per_byte:
            raise D2OError(f"kv_group_size={self.group_size} does not divide this model's head dimension {dim} "
                           f"(at {self.bits} bits, {self.per_byte} channels share a byte): choose a divisor of {dim}")

    def token_bytes(self, dim: int) -> int:
        """Bytes one token's vector of ``dim`` channels takes: packed levels, steps and zero points."""
        return dim // self.per_byte + 2 * (dim // self.group_size) * SCALE_DTYPE.itemsize

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``x`` (..., D) as ``PARTS``: ``data`` (..., D / per_byte) uint8, ``scale`` and ``zero``
        (..., D / group_size) float16. Computed in float32 whatever ``x``'s dtype."""
        self.check(x.shape[-1])
        groups = x.float().unflatten(-1, (-1, self.group_size))
        low, high = groups.amin(-1), groups.amax(-1)
        zero = low.to(SCALE_DTYPE)
        scale = ((high - low) / self.levels).to(SCALE_DTYPE).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
        # Levels from the rounded step and zero point, so that decoding and encoding again give the same bytes.
        levels = ((groups - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, self.levels)
        levels = levels.to(torch.uint8).flatten(-2).unflatten(-1, (-1, self.per_byte))
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=x.device)
        data = (levels << shifts).sum(-1, dtype=torch.uint8)
        return {"data": data, "scale": scale, "zero": zero}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The vectors (..., D) in ``dtype`` that ``parts`` (from ``encode``) stand for."""
        data = parts["data"]
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=data.device)
        levels = ((data[..., None] >> shifts) & self.levels).flatten(-2)
        groups = levels.unflatten(-1, (-1, self.group_size)).to(torch.float32)
        vectors = groups * parts["scale"].float()[..., None] + parts["zero"].float()[..., None]
        return vectors.flatten(-2).to(dtype)

