"""The chunked statistics equal those of the explicit attention matrix."""

import pytest
import torch

from d2o.engine import stats as stats_module
from d2o.engine.stats import StatsRequest, attention_stats


def explicit_attention(query, key, kv_valid, scaling):
    """The full (B, H, q, N) probability matrix, the reference the chunks must reproduce."""
    batch, heads, n_query, _ = query.shape
    group = heads // key.shape[1]
    keys = key.repeat_interleave(group, dim=1)
    scores = query @ keys.transpose(-1, -2) * scaling
    n_keys = key.shape[2]
    causal = torch.arange(n_keys)[None, :] <= torch.arange(n_query)[:, None] + (n_keys - n_query)
    allowed = causal[None, None] & kv_valid[:, None, None, :]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


@pytest.mark.parametrize("chunk_elements", [1, 97, 1 << 23])
@pytest.mark.parametrize("n_past", [0, 13])
def test_chunked_stats_equal_the_full_matrix(monkeypatch, chunk_elements, n_past):
    monkeypatch.setattr(stats_module, "CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    batch, heads, kv_heads, n_query, dim = 3, 6, 2, 40, 8
    n_keys = n_past + n_query
    query = torch.randn(batch, heads, n_query, dim, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, n_keys, dim, dtype=torch.float64)
    kv_valid = torch.ones(batch, n_keys, dtype=torch.bool)
    kv_valid[1, :7] = False  # left padding in the past and in the new tokens
    kv_valid[2, : n_past + 11] = False
    kv_valid[0, 3] = False  # an evicted slot in the middle
    query_valid = kv_valid[:, n_past:]
    window = 5
    per_head = kv_valid[:, None].expand(-1, kv_heads, -1)
    got = attention_stats(query, key, per_head, query_valid, 0.3, StatsRequest(column_mass=True, window=window))

    probs = explicit_attention(query, key, kv_valid, 0.3).nan_to_num(0.0) * query_valid[:, None, :, None]
    expected_mass = probs.sum(2).view(batch, kv_heads, heads // kv_heads, n_keys)
    expected_window = probs[:, :, -window:].reshape(batch, kv_heads, heads // kv_heads, window, n_keys)
    torch.testing.assert_close(got.column_mass.double(), expected_mass, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.window.double(), expected_window, atol=1e-6, rtol=1e-6)
    # Every real query row is a distribution: the column mass sums to the number of real queries.
    torch.testing.assert_close(got.column_mass.sum(-1).double(),
                               query_valid.sum(-1).double()[:, None, None].expand(-1, kv_heads, heads // kv_heads),
                               atol=1e-5, rtol=1e-6)  # float32 sums of ~40 rows


def test_window_only_request_skips_the_mass():
    query = torch.randn(1, 4, 30, 8)
    key = torch.randn(1, 2, 30, 8)
    valid = torch.ones(1, 30, dtype=torch.bool)
    got = attention_stats(query, key, valid[:, None].expand(-1, 2, -1), valid, 0.35, StatsRequest(window=1))
    assert got.column_mass is None and got.window.shape == (1, 2, 2, 1, 30)
    expected = explicit_attention(query, key, valid, 0.35)[:, :, -1:]
    torch.testing.assert_close(got.window.view(1, 4, 1, 30), expected)


@pytest.mark.parametrize("chunk_elements", [97, 1 << 23])
def test_the_output_from_the_statistics_equals_sdpa(monkeypatch, chunk_elements):
    """Several chunks of query rows, GQA, padding: the output computed with the column mass is
    the attention output."""
    monkeypatch.setattr(stats_module, "CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(1)
    query, key, value = torch.randn(2, 6, 40, 8), torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :9] = False
    got = attention_stats(query, key, valid[:, None].expand(-1, 2, -1), valid, 0.3, StatsRequest(column_mass=True),
                          value=value).output
    expected = explicit_attention(query, key, valid, 0.3).nan_to_num(0.0) @ value.repeat_interleave(3, dim=1)
    real = valid[:, None, :, None].transpose(1, 2)  # padding queries' outputs are not compared
    torch.testing.assert_close(got * real, expected.transpose(1, 2) * real, atol=1e-5, rtol=1e-5)


class _WrappedHead(torch.nn.Module):
    """An output head that is not a plain linear layer: it is called as it is."""

    def __init__(self, linear):
        super().__init__()
        self.weight, self.inner = linear.weight, linear

    def forward(self, hidden):
        return self.inner(hidden)


# Tiles of 700 logits: a linear head in tiles of 20 positions (the last one 8) by 35 tokens (the
# last 15); any other head 14 positions at a time. Or all 48 positions at once.
@pytest.mark.parametrize("chunk_elements", [700, 1 << 22])
@pytest.mark.parametrize("head", ["linear", "linear+bias", "wrapped"])
def test_surprisal_equals_the_log_softmax_of_the_whole_logits(monkeypatch, chunk_elements, head):
    """-log p(x_t | x_<t), a tile of positions and vocabulary at a time, the logsumexp kept running
    over the vocabulary's slices: equal to the log-softmax of all positions' logits at once, the
    earlier pass's last hidden state scoring this pass's first token, and zero where the token or
    its predictor is padding."""
    monkeypatch.setattr(stats_module, "SURPRISAL_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(stats_module, "SURPRISAL_ROWS", 20)
    torch.manual_seed(2)
    vocab, dim, n_new = 50, 16, 24
    linear = torch.nn.Linear(dim, vocab, bias=head == "linear+bias", dtype=torch.float64)
    lm_head = _WrappedHead(linear) if head == "wrapped" else linear
    hidden, previous = torch.randn(2, n_new, dim, dtype=torch.float64), torch.randn(2, dim, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, n_new))
    index = torch.stack([torch.arange(30, 30 + n_new), torch.arange(n_new) - 5]).clamp(min=-1)  # a row left-padded by 5
    with torch.inference_mode():
        got, last = stats_module.token_surprisal(ids, hidden, lm_head, index, previous)
    log_probs = torch.log_softmax(linear(torch.cat([previous[:, None], hidden[:, :-1]], dim=1)), dim=-1)
    expected = -log_probs.gather(-1, ids[..., None])[..., 0]
    expected[1, :6] = 0.0  # padding, and the first real token, predicted from padding
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(last, hidden[:, -1])
