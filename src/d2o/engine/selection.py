"""Which slots a layer keeps: pure tensor functions of (batch, kv_heads, slots) scores."""

from __future__ import annotations

import torch


def select_kept(scores: torch.Tensor, protected: torch.Tensor, token_index: torch.Tensor,
                target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and KV head the ``target[b]`` highest-scoring valid slots (B, G, N each), protected ones
    first, or ``target[b, g]`` per KV head; equal scores (pooling makes plateaus) go to the newer
    token, so a token's slot never changes the choice. Slot indices (B, G, K) in slot order (a
    head's kept slots first), K = max(target), and validity: (B, K), or (B, G, K) per KV head."""
    n_slots = scores.shape[-1]
    ranked = scores.masked_fill(protected, float("inf")).masked_fill(token_index < 0, float("-inf"))
    newest_first = token_index.argsort(dim=-1, descending=True)
    order = ranked.gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)
    width = int(target.max())
    top = newest_first.gather(-1, order[..., :width])
    keep_valid = torch.arange(width, device=scores.device) < target[..., None]
    per_head = keep_valid if keep_valid.dim() == 3 else keep_valid[:, None, :]
    keep = top.masked_fill(~per_head, n_slots).sort(dim=-1).values.clamp_max(n_slots - 1)
    return keep, keep_valid


def select_victim(scores: torch.Tensor, protected: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Per row and KV head, the one slot ``select_kept`` leaves out when it keeps all valid slots
    but one: the lowest-scoring valid unprotected slot, the older token among equal scores. (B, G, 1)."""
    empty = token_index < 0
    ranked = scores.masked_fill(protected | empty, float("inf"))
    lowest = ranked.amin(-1, keepdim=True)
    older_first = token_index.masked_fill((ranked != lowest) | empty, torch.iinfo(token_index.dtype).max)
    return older_first.argmin(-1, keepdim=True)


def select_evicted(scores: torch.Tensor, protected: torch.Tensor, token_index: torch.Tensor,
                   count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots ``select_kept`` leaves out when it keeps all valid slots of row b but ``count[b]``,
    found directly (an eviction of a few slots during decoding): per row and KV head, the lowest
    scores among the valid slots, unprotected ones first, the older token among equal scores;
    ``count`` (B,), or (B, G) per KV head. Indices (B, G, E) in increasing slot order, E =
    max(count), and validity: (B, E), or (B, G, E) per KV head."""
    n_slots = scores.shape[-1]
    empty = token_index < 0
    ranked = scores.masked_fill(protected | empty, float("inf"))
    # Empty slots after the protected ones among the infinite ranks: they are never evicted.
    oldest_first = token_index.masked_fill(empty, torch.iinfo(token_index.dtype).max).argsort(dim=-1)
    order = ranked.gather(-1, oldest_first).argsort(dim=-1, stable=True)
    width = int(count.max())
    evict_valid = torch.arange(width, device=scores.device) < count[..., None]
    per_head = evict_valid if evict_valid.dim() == 3 else evict_valid[:, None, :]
    lowest = oldest_first.gather(-1, order[..., :width])
    slots = lowest.masked_fill(~per_head, n_slots).sort(dim=-1).values.clamp_max(n_slots - 1)
    return slots, evict_valid


def flat_offsets(batch: int, heads: int, n_slots: int, device) -> torch.Tensor:
    """(B, G, 1): where each row and KV head of a (B, G, ``n_slots``, ...) tensor starts in its flat
    (B * G * n_slots, ...) view."""
    return torch.arange(batch * heads, device=device).view(batch, heads, 1) * n_slots


def flat_slots(slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The slots (B, G, K) of a (B, G, ``n_slots``, ...) tensor as indices into its flat
    (B * G * n_slots, ...) view: one index for every field of a layer's slot table."""
    return (slots + flat_offsets(*slots.shape[:2], n_slots, slots.device)).flatten()


def take_flat(tensor: torch.Tensor, index: torch.Tensor, slots_shape: torch.Size) -> torch.Tensor:
    """``tensor`` (B, G, N, ...) at the ``flat_slots`` ``index``: a copy (B, G, K, ...)."""
    batch, heads, n_slots = tensor.shape[:3]
    picked = tensor.reshape(batch * heads * n_slots, -1).index_select(0, index)
    return picked.view(*slots_shape, *tensor.shape[3:])


def take_slots(tensor: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``tensor`` (B, G, N, ...) at ``slots`` (B, G, K) per row and head: a copy (B, G, K, ...).

    One ``index_select`` over the flat (row, head, slot) view copies each slot's trailing values as
    a block; ``gather`` would need an index as large as the result.
    """
    return take_flat(tensor, flat_slots(slots, tensor.shape[2]), slots.shape)
