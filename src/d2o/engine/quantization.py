"""Keys and values at 8, 4 or 2 bits: the codec a quantized cache layer stores its slots with.

A token's key and value are cut into groups of ``group_size`` channels; a group keeps its minimum
(zero point) and step ``(max - min) / (2**bits - 1)`` in float16, every channel the nearest level,
packed ``8 // bits`` to a byte (asymmetric min-max quantization, as KIVI's values and quanto).
KIVI quantizes keys per channel over groups of tokens; here keys are per token too, because
eviction and merging work token by token: a token's bytes are its slot's own, so evicting,
gathering or merging never re-quantizes another token. What per-channel groups buy KIVI (outlier
channels kept accurate) the residual gives the newest tokens: they are also held in full precision.
Plain torch: the packed bytes are ordinary tensors that slot operations apply to like any field
(optimum-quanto's and HQQ's are opaque subclasses quantized along whole tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from d2o.errors import D2OError
from d2o.options import check_kv_bits, whole

SCALE_DTYPE = torch.float16  # each group's step and zero point
GROUP_SIZE = 32  # channels per group by default (or the head dimension, if smaller)
PARTS = ("data", "scale", "zero")  # what vectors are stored as, each (..., channels or groups)


@lru_cache(maxsize=16)
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """Where each of a byte's levels sits in it."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


@dataclass(frozen=True)
class KVQuantization:
    """How a cache stores keys and values: ``bits`` per channel, ``group_size`` channels sharing a
    step and zero point (by default 32, or the head dimension if smaller), the newest ``residual``
    tokens of each row and KV head also held in full precision."""

    bits: int = 4
    group_size: int | None = None
    residual: int = 32

    def __post_init__(self):
        if check_kv_bits(self.bits) is None:
            raise D2OError("KVQuantization needs bits: 8, 4 or 2")
        if self.group_size is not None and (not whole(self.group_size) or self.group_size < 1):
            raise D2OError(f"kv_group_size={self.group_size!r} must be a whole number of channels >= 1")
        if not whole(self.residual) or self.residual < 0:
            raise D2OError(f"kv_residual={self.residual!r} must be a whole number of tokens >= 0")

    @classmethod
    def of(cls, kv_bits: int | KVQuantization | None) -> KVQuantization | None:
        """``kv_bits`` as given to a cache: None (the model's dtype), a bit width, or a ``KVQuantization``."""
        return kv_bits if kv_bits is None or isinstance(kv_bits, KVQuantization) else cls(bits=kv_bits)

    levels = property(lambda quantization: (1 << quantization.bits) - 1)
    per_byte = property(lambda quantization: 8 // quantization.bits)  # levels packed in a byte

    def group(self, dim: int) -> int:
        """Channels per group of a vector of ``dim`` channels."""
        return self.group_size or min(GROUP_SIZE, dim)

    def check(self, dim: int) -> None:
        """Refuse a head dimension the groups or the packing do not divide."""
        group = self.group(dim)
        if dim % group or group % self.per_byte:
            raise D2OError(f"kv_group_size={group} does not divide this model's head dimension {dim} into groups "
                           f"of whole bytes (at {self.bits} bits, {self.per_byte} channels share a byte)")

    def token_bytes(self, dim: int) -> int:
        """Bytes one token's vector of ``dim`` channels takes: packed levels, steps and zero points."""
        return dim // self.per_byte + 2 * (dim // self.group(dim)) * SCALE_DTYPE.itemsize

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``x`` (..., D) as ``PARTS``: ``data`` (..., D / per_byte) uint8, ``scale`` and ``zero``
        (..., D / group_size) float16. Computed in float32 whatever ``x``'s dtype."""
        group = self.group(x.shape[-1])
        groups = x.float().unflatten(-1, (x.shape[-1] // group, group))
        low, high = torch.aminmax(groups, dim=-1)
        zero = low.to(SCALE_DTYPE)
        scale = ((high - low) / self.levels).to(SCALE_DTYPE).clamp_min_(torch.finfo(SCALE_DTYPE).tiny)
        # Levels from the rounded step and zero point, so that decoding and encoding again give the same bytes.
        levels = (groups - zero.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, self.levels)
        levels = levels.to(torch.uint8).view(*x.shape[:-1], x.shape[-1] // self.per_byte, self.per_byte)
        data = (levels << _shifts(self.bits, x.device)).sum(-1, dtype=torch.uint8)
        return {"data": data, "scale": scale, "zero": zero}

    def decode(self, parts: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The vectors (..., D) that ``parts`` (from ``encode``) stand for, in float32: written into
        ``out`` if given (a float32 tensor of that shape, a view of a larger one is fine)."""
        data = parts["data"]
        per_byte = self.per_byte
        dim = data.shape[-1] * per_byte
        if out is None:
            out = torch.empty((*data.shape[:-1], dim), dtype=torch.float32, device=data.device)
        # Each level written straight into float32, then scaled and shifted in place (an addcmul
        # broadcasting a step over each group is several times slower on a CPU).
        levels = out.unflatten(-1, (data.shape[-1], per_byte))
        for i in range(per_byte):
            shifted = data >> (self.bits * i) if i else data
            if i < per_byte - 1:
                torch.bitwise_and(shifted, self.levels, out=levels[..., i])
            else:  # the highest bits need no mask
                levels[..., i].copy_(shifted)
        group = self.group(dim)
        groups = out.unflatten(-1, (dim // group, group))
        groups.mul_(parts["scale"].float()[..., None]).add_(parts["zero"].float()[..., None])
        return out
