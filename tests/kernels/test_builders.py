"""Each paper mask builder, held to the mask written the obvious way (a Python predicate per (row, col))."""

from __future__ import annotations

import pytest
import torch
from flashmask_helpers import CASES, TOTAL, S, brute_force_allowed

from tokenloom.kernels import MASK_BUILDERS, dense_allowed_mask, random_eviction_mask


def test_every_registered_builder_has_a_case():
    assert set(MASK_BUILDERS) - {"random_eviction"} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_builder_matches_predicate(name):
    args, allowed = CASES[name]
    builder = MASK_BUILDERS[name]
    idx = builder.build(*args)
    n = TOTAL.get(name, S)
    assert idx.dtype == torch.int32 and idx.shape[:3] == (1, 1, n)
    got = dense_allowed_mask(idx, causal=builder.causal, seq_q=n)
    want = brute_force_allowed(n, n, allowed)
    mismatch = (got != want).nonzero().tolist()
    assert not mismatch, f"{name}: first mismatches (b, h, row, col) {mismatch[:5]}"


def test_random_eviction_is_causal_with_one_eviction_row_per_column():
    idx = random_eviction_mask(S, seed=3)
    allowed = dense_allowed_mask(idx, causal=True, seq_q=S)[0, 0]
    for j in range(S):
        rows = allowed[:, j].nonzero().flatten().tolist()
        assert rows[0] == j and rows == list(range(j, rows[-1] + 1)), f"column {j} sees rows {rows}"
    assert torch.equal(idx, random_eviction_mask(S, seed=3))
    assert not torch.equal(idx, random_eviction_mask(S, seed=4))


@pytest.mark.parametrize(
    "call",
    [
        lambda: MASK_BUILDERS["sliding_window"].build(10, 0),
        lambda: MASK_BUILDERS["causal_document"].build([]),
        lambda: MASK_BUILDERS["document"].build([4, -1]),
        lambda: MASK_BUILDERS["prefix_lm_causal"].build(10, 11),
        lambda: MASK_BUILDERS["prefix_lm_document"].build([4, 4], [5, 0]),
        lambda: MASK_BUILDERS["qk_sparse"].build(10, (5, 3), (0, 0)),
        lambda: MASK_BUILDERS["global_sliding_window"].build(10, 11, 2),
    ],
)
def test_builders_reject_bad_arguments(call):
    with pytest.raises(ValueError):
        call()
