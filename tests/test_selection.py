"""The selection functions against plain loops over rows and heads."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d2o.engine.selection import select_evicted, select_kept, take_slots


def random_layer(seed: int, batch: int = 3, heads: int = 2, slots: int = 12):
    """Scores with ties, protected slots, and token indices in shuffled slots with empty ones."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (batch, heads, slots), generator=generator).float()  # many ties
    token_index = torch.stack([torch.randperm(slots, generator=generator) for _ in range(batch * heads)])
    token_index = token_index.view(batch, heads, slots)
    empty = torch.rand(batch, 1, slots, generator=generator) < 0.2
    token_index = token_index.masked_fill(empty, -1)
    protected = (torch.rand(batch, heads, slots, generator=generator) < 0.15) & (token_index >= 0)
    valid = (token_index >= 0)[:, 0].sum(-1)
    target = torch.minimum(valid, torch.randint(1, slots, (batch,), generator=generator))
    target = torch.maximum(target, (protected.sum(-1).amax(-1)))
    return scores, protected, token_index, target


def expected_kept(scores, protected, token_index, target):
    """Per row and head: protected slots, then the best scores, ties to the newer token."""
    kept = []
    for b in range(scores.shape[0]):
        row = []
        for g in range(scores.shape[1]):
            slots = [s for s in range(scores.shape[2]) if token_index[b, g, s] >= 0]
            ranked = sorted(slots, key=lambda s: (not protected[b, g, s], -scores[b, g, s], -token_index[b, g, s]))
            row.append(sorted(ranked[: int(target[b])]))
        kept.append(row)
    return kept


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_select_kept_keeps_protected_slots_then_the_best_scores(seed):
    scores, protected, token_index, target = random_layer(seed)
    keep, keep_valid = select_kept(scores, protected, token_index, target)
    assert keep.shape[-1] == int(target.max())
    assert keep_valid.sum(-1).tolist() == target.tolist()
    for b, row in enumerate(expected_kept(scores, protected, token_index, target)):
        for g, slots in enumerate(row):
            assert keep[b, g, : int(target[b])].tolist() == slots  # in slot order


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), target_below_protected=st.booleans())
def test_select_evicted_finds_the_valid_slots_select_kept_leaves_out(seed, target_below_protected):
    """In slot order, also when a row keeps fewer slots than it protects (the newer protected ones stay)."""
    scores, protected, token_index, target = random_layer(seed)
    if target_below_protected:
        target = (target - 2).clamp_min(0)
    keep, keep_valid = select_kept(scores, protected, token_index, target)
    count = (token_index[:, 0] >= 0).sum(-1) - target
    evict, evict_valid = select_evicted(scores, protected, token_index, count)
    assert evict_valid.sum(-1).tolist() == count.tolist()
    for b in range(scores.shape[0]):
        n = int(count[b])
        for g in range(scores.shape[1]):
            valid = {s for s in range(scores.shape[2]) if token_index[b, g, s] >= 0}
            kept = set(keep[b, g, : int(target[b])].tolist())
            assert evict[b, g, :n].tolist() == sorted(valid - kept)


def test_take_slots_equals_gather():
    tensor = torch.randn(2, 3, 10, 4)
    slots = torch.randint(0, 10, (2, 3, 6))
    expected = tensor.gather(2, slots[..., None].expand(-1, -1, -1, 4))
    assert torch.equal(take_slots(tensor, slots), expected)
    assert torch.equal(take_slots(tensor[..., 0], slots), tensor[..., 0].gather(2, slots))
