"""Exact attention statistics without the S x S matrix.

Methods score tokens from the attention they receive. The output of attention comes from the
fast kernel (SDPA / flash), which never exposes probabilities; here the probabilities are
recomputed exactly, a chunk of query rows at a time (each row is complete, so its softmax is
exact), and reduced at once: peak extra memory is one chunk of rows plus the (B, H, N) results,
linear in the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Scores held at once by one chunk (float32 elements): about 32 MB.
CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class StatsRequest:
    """What a method needs from one forward pass of one layer."""

    column_mass: bool = False  # attention each slot received, summed over this pass's real queries
    window: int = 0  # attention rows of the last `window` queries


@dataclass
class AttentionStats:
    """Statistics of one forward pass of one layer, per query head grouped by KV head.

    ``column_mass``: (B, G, group, N) float32, or None. ``window``: (B, G, group, w, N) float32
    (the rows of the last w queries; rows of padding queries are zero), or None.
    """

    column_mass: torch.Tensor | None = None
    window: torch.Tensor | None = None


def allowed_keys(
    kv_valid: torch.Tensor, q_start: int, q_end: int, n_new: int, n_keys: int, window_mask=None
) -> torch.Tensor:
    """(B, 1, c, n_keys) bool: which of the first ``n_keys`` slots queries ``q_start:q_end`` may see.

    The ``n_new`` newest slots are this pass's queries themselves (causal, bottom-right aligned);
    older slots are visible when valid. ``window_mask`` (optional callable) adds a sliding window.
    """
    device = kv_valid.device
    past = kv_valid.shape[-1] - n_new
    rows = torch.arange(q_start, q_end, device=device)[:, None] + past
    cols = torch.arange(n_keys, device=device)[None, :]
    allowed = (cols <= rows)[None, None] & kv_valid[:, None, None, :n_keys]
    if window_mask is not None:
        allowed = allowed & window_mask(q_start, q_end, n_keys)
    return allowed


def attention_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    kv_valid: torch.Tensor,
    query_valid: torch.Tensor,
    scaling: float,
    request: StatsRequest,
    window_mask=None,
) -> AttentionStats:
    """Compute ``request`` for queries (B, H, q, D) over keys (B, G, N, D), exactly, in query chunks.

    ``kv_valid`` (B, N) marks real slots (the last q are the queries' own), ``query_valid`` (B, q)
    real queries: padding queries contribute nothing.
    """
    batch, heads, n_query, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    past = n_keys - n_query
    keys_t = key.float().transpose(-1, -2)  # (B, G, D, N)
    queries = query.float().view(batch, kv_heads, group, n_query, dim)
    mass = key.new_zeros((batch, kv_heads, group, n_keys), dtype=torch.float32) if request.column_mass else None
    window_rows = min(request.window, n_query)
    window_start = n_query - window_rows
    window = (
        key.new_zeros((batch, kv_heads, group, window_rows, n_keys), dtype=torch.float32) if window_rows else None
    )
    # Only the window's rows are needed when column mass is not.
    first = 0 if request.column_mass else window_start
    if not request.column_mass and not window_rows:
        return AttentionStats()
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * n_keys))
    for start in range(first, n_query, chunk):
        end = min(n_query, start + chunk)
        visible = past + end  # causal: later slots are invisible to every row of the chunk
        q = queries[:, :, :, start:end].reshape(batch, kv_heads, group * (end - start), dim)
        scores = torch.matmul(q, keys_t[..., :visible]).view(batch, kv_heads, group, end - start, visible)
        scores.mul_(scaling)
        allowed = allowed_keys(kv_valid, start, end, n_query, visible, window_mask)  # (B, 1|G, c, visible)
        scores.masked_fill_(~allowed.view(batch, -1, 1, end - start, visible), torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        probs.mul_(query_valid[:, None, None, start:end, None])
        if mass is not None:
            mass[..., :visible] += probs.sum(dim=-2)
        if window is not None and end > window_start:
            lo = max(start, window_start)
            window[:, :, :, lo - window_start : end - window_start, :visible] = probs[:, :, :, lo - start :]
    return AttentionStats(column_mass=mass, window=window)
