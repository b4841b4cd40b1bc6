"""Exact attention statistics without the S x S matrix, and each token's surprisal.

The attention's output comes from a fast kernel that never exposes probabilities: here they are
recomputed exactly a chunk of query rows at a time (each row complete, so its softmax is exact) and
reduced at once: the extra memory is one chunk of rows plus the (B, H, N) results.
"""

from __future__ import annotations

import torch

from d2o.engine.api import AttentionStats, StatsRequest

# Scores held at once by one chunk (float32 elements): 8 MB, small enough to stay in cache.
CHUNK_ELEMENTS = 1 << 21


def allowed_keys(kv_valid: torch.Tensor, q_start: int, q_end: int, n_new: int, n_keys: int,
                 window_mask=None) -> torch.Tensor:
    """(B, G, c, n_keys) bool: which of the first ``n_keys`` slots queries ``q_start:q_end`` may see:
    ``kv_valid`` (B, G|1, N) where valid, the ``n_new`` newest (the queries' own) causally, bottom-right
    aligned; ``window_mask`` (a callable) adds a sliding window."""
    device = kv_valid.device
    past = kv_valid.shape[-1] - n_new
    rows = torch.arange(q_start, q_end, device=device)[:, None] + past
    cols = torch.arange(n_keys, device=device)[None, :]
    allowed = (cols <= rows)[None, None] & kv_valid[:, :, None, :n_keys]
    if window_mask is not None:
        allowed = allowed & window_mask(q_start, q_end, n_keys)
    return allowed


def attention_stats(query: torch.Tensor, key: torch.Tensor, kv_valid: torch.Tensor, query_valid: torch.Tensor,
                    scaling: float, request: StatsRequest, window_mask=None, log_weight: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> AttentionStats:
    """``request`` for queries (B, H, q, D) over keys (B, G, N, D), exactly, in query chunks, and with
    ``value`` given and column statistics asked, the output from the same probabilities.
    ``kv_valid`` (B, G, N): real slots (the last q the queries' own); ``query_valid`` (B, q): real
    queries (padding's count nothing); ``log_weight`` (B, G, N) is added to the logits. A chunk is one
    matrix product per row and KV head (a group's query heads stacked) over the keys it can see."""
    batch, heads, n_query, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    past = n_keys - n_query
    window_rows = min(request.window, n_query)
    window_start = n_query - window_rows
    if not request.columns and not window_rows:
        return AttentionStats(n_query)
    columns = (batch, kv_heads, group, n_keys)
    mass = key.new_zeros(columns, dtype=torch.float32) if request.column_mass else None
    most = key.new_zeros(columns, dtype=torch.float32) if request.column_max else None
    window = key.new_zeros((batch, kv_heads, group, window_rows, n_keys), dtype=torch.float32) if window_rows else None
    first = 0 if request.columns else window_start  # only the window's rows are needed without column statistics
    work = torch.promote_types(query.dtype, torch.float32)  # float32 at least (a float64 model keeps float64)
    output = None
    if value is not None and request.columns:
        output = torch.empty((batch, heads, n_query, value.shape[-1]), dtype=work, device=query.device)
    chunk = min(n_query - first, max(1, CHUNK_ELEMENTS // max(1, group * n_keys)))
    lowest = torch.finfo(work).min
    # Only the rows from `first` on are needed (all of them for column mass, the window's otherwise).
    queries = (query[:, :, first:].to(work) * scaling).view(batch, kv_heads, group, n_query - first, dim)
    # One buffer for every chunk's scores, turned into probabilities in place: fresh multi-MB
    # tensors per chunk would cost a page fault per 4 KB each time.
    buffer = torch.empty(group * chunk * n_keys, dtype=work, device=key.device)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).triu_(1)  # within a chunk's own block
    for b in range(batch):
        padded_queries = not bool(query_valid[b].all())
        padded_keys = not bool(kv_valid[b].all())
        for g in range(kv_heads):
            keys_t = key[b, g].to(work).t().contiguous()  # (D, N)
            values_g = value[b, g].to(work) if output is not None else None
            for start in range(first, n_query, chunk):
                end = min(n_query, start + chunk)
                rows, visible = end - start, past + end  # later slots are invisible to every row
                scores = buffer[: group * rows * visible].view(group * rows, visible)
                rows_of_queries = queries[b, g, :, start - first : end - first].reshape(group * rows, dim)
                torch.mm(rows_of_queries, keys_t[:, :visible], out=scores)
                scores = scores.view(group, rows, visible)
                if log_weight is not None:
                    scores += log_weight[b, g, :visible]
                # Causal: only the block of this chunk's own tokens has future columns.
                own = scores[:, :, past + start : visible]
                own.masked_fill_(future[:rows, :rows], lowest)
                if padded_keys:
                    scores.masked_fill_(~kv_valid[b, g, None, None, :visible], lowest)
                if window_mask is not None:
                    allowed = window_mask(start, end, visible)[b]
                    scores.masked_fill_(~allowed[g if allowed.shape[0] > 1 else 0], lowest)
                probs = torch.softmax(scores, dim=-1, out=scores)
                if output is not None:
                    output[b, g * group : (g + 1) * group, start:end] = torch.matmul(probs, values_g[:visible])
                if padded_queries:
                    probs.mul_(query_valid[b, None, start:end, None])
                if mass is not None:
                    mass[b, g, :, :visible] += probs.sum(dim=1)
                if most is not None:
                    torch.maximum(most[b, g, :, :visible], probs.amax(dim=1), out=most[b, g, :, :visible])
                if window is not None and end > window_start:
                    low = max(start, window_start)
                    window[b, g, :, low - window_start : end - window_start, :visible] = probs[:, low - start :]
    if output is not None:
        output = output.transpose(1, 2).to(query.dtype)  # (B, q, H, D), as attention functions return it
    return AttentionStats(n_query, column_mass=mass, window=window, output=output, column_max=most)


# Logits held at once while computing surprisal (float32 elements): 16 MB.
SURPRISAL_CHUNK_ELEMENTS = 1 << 22
# Positions a plain linear head computes together, a slice of the vocabulary at a time (read once for all).
SURPRISAL_ROWS = 4096


def _logit_tiles(lm_head, hidden: torch.Tensor):
    """Yield ``(rows, first, logits)``: the logits of ``hidden[rows]`` (n, d) for the vocabulary from
    ``first`` on, tiles of at most SURPRISAL_CHUNK_ELEMENTS covering all (n, V). A plain linear head
    is read in slices of the vocabulary into one buffer (a fresh tensor per tile costs page faults);
    any other head, or positions that fit one tile (a decode step's), calls the head as it is."""
    n, vocab = hidden.shape[0], lm_head.weight.shape[0]
    whole_rows = max(1, SURPRISAL_CHUNK_ELEMENTS // vocab)  # positions whose logits make one tile
    if (n <= whole_rows or type(lm_head) is not torch.nn.Linear or hasattr(lm_head, "_hf_hook")
            or lm_head.weight.is_meta):
        for start in range(0, n, whole_rows):
            yield slice(start, start + whole_rows), 0, lm_head(hidden[start : start + whole_rows])
        return
    weight, bias = lm_head.weight, lm_head.bias
    step = min(n, SURPRISAL_ROWS)
    width = min(vocab, max(1, SURPRISAL_CHUNK_ELEMENTS // step))
    buffer = torch.empty(step * width, dtype=weight.dtype, device=weight.device)
    for start in range(0, n, step):
        part = hidden[start : start + step]
        for first in range(0, vocab, width):
            slice_ = weight[first : first + width]
            out = buffer[: part.shape[0] * slice_.shape[0]].view(part.shape[0], slice_.shape[0])
            if bias is None:
                torch.mm(part, slice_.t(), out=out)
            else:
                torch.addmm(bias[first : first + width], part, slice_.t(), out=out)
            yield slice(start, start + part.shape[0]), first, out


def _negative_log_likelihood(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(lm_head(hidden))[targets], (n,) float32, for ``hidden`` (n, d): a logsumexp kept
    running over the tiles of the logits (their largest value so far, and the sum of exp below it)."""
    n = hidden.shape[0]
    top = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    total = torch.zeros((n,), dtype=torch.float32, device=hidden.device)
    picked = torch.zeros((n,), dtype=torch.float32, device=hidden.device)
    for rows, first, logits in _logit_tiles(lm_head, hidden):
        logits = logits.float()
        width = logits.shape[-1]
        target = targets[rows] - first
        inside = (target >= 0) & (target < width)
        picked[rows] = torch.where(inside, logits.gather(-1, target.clamp(0, width - 1)[:, None])[:, 0], picked[rows])
        new_top = torch.maximum(top[rows], logits.amax(-1))
        # In place: the tile is written again by the next one.
        total[rows] = total[rows] * (top[rows] - new_top).exp() + logits.sub_(new_top[:, None]).exp_().sum(-1)
        top[rows] = new_top
    return total.log() + top - picked


def token_surprisal(
    input_ids: torch.Tensor, hidden: torch.Tensor, lm_head, index: torch.Tensor, previous: torch.Tensor | None,
    previous_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-log p(x_t | x_<t) of each new token (B, q), float32 (0: padding, a row's first token), and the
    new ``previous``. ``hidden`` (B, q, d): the final hidden states; ``index`` (B, q): each token's
    index in its row (-1: padding); ``previous`` (B, d): the last token's of the pass before (it
    predicts this pass's first token), ``previous_logits`` (B, V) its logits if the model computed
    them. Logits a tile at a time, never (q, vocab) at once."""
    batch, n_new, _ = hidden.shape
    surprisal = torch.zeros((batch, n_new), dtype=torch.float32, device=hidden.device)
    predictors = hidden[:, :-1]
    if previous_logits is not None:
        logits = previous_logits.float()
        surprisal[:, 0] = torch.logsumexp(logits, dim=-1) - logits.gather(-1, input_ids[:, :1]).squeeze(-1)
    elif previous is not None:
        predictors = torch.cat([previous[:, None].to(hidden.dtype), predictors], dim=1)
    if predictors.shape[1]:
        offset = n_new - predictors.shape[1]
        targets = input_ids[:, offset:]
        surprisal[:, offset:] = _negative_log_likelihood(lm_head, predictors.reshape(-1, predictors.shape[-1]),
                                                         targets.reshape(-1)).view(batch, -1)
    # A row's first token has none: whatever precedes it is padding (in this pass or, fed in chunks,
    # the pass before), and a later token's predecessor is the real token before it (left padding).
    surprisal = surprisal * (index > 0)
    return surprisal, hidden[:, -1]
