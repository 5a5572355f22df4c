"""Tile classification is sound: a skipped tile is fully masked and a free tile has nothing masked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.kernels import (
    canonical_indices,
    causal_document_mask,
    classify_tiles,
    column_tile_bounds,
    dense_allowed_mask,
    sliding_window_mask,
    tile_fractions,
)
from tokenloom.kernels.tiles import FULL, SKIP


def check_sound(idx, causal, seq_q, block_q, block_k):
    canonical = canonical_indices(idx, causal=causal, seq_q=seq_q)
    classes = classify_tiles(column_tile_bounds(canonical, seq_q=seq_q, block_k=block_k), seq_q=seq_q, block_q=block_q)
    allowed = dense_allowed_mask(idx, causal=causal, seq_q=seq_q)
    b_n, h_n, tq, tk = classes.shape
    for b in range(b_n):
        for h in range(h_n):
            for qt in range(tq):
                for kt in range(tk):
                    block = allowed[b, h, qt * block_q:(qt + 1) * block_q, kt * block_k:(kt + 1) * block_k]
                    if classes[b, h, qt, kt] == SKIP:
                        assert not block.any(), f"skipped tile {(b, h, qt, kt)} has allowed entries"
                    if classes[b, h, qt, kt] == FULL:
                        assert block.all() and block.shape[1] == block_k, f"free tile {(b, h, qt, kt)} has masked entries"
    return classes


def test_causal_document_skips_off_document_tiles_and_frees_inner_ones():
    idx = causal_document_mask([64, 64, 64, 64])
    classes = check_sound(idx, True, 256, 32, 32)
    fractions = tile_fractions(classes)
    # 8 x 8 tiles: 4 documents of 2 x 2 tiles: 4 diagonal-below (free) + 8 diagonal (partial); rest skipped.
    assert fractions == {"skipped": 52 / 64, "partial": 8 / 64, "free": 4 / 64}


def test_sliding_window_with_ragged_last_tile():
    check_sound(sliding_window_mask(100, 20), True, 100, 16, 32)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 70),
    st.sampled_from([(True, 1), (True, 2), (False, 2), (False, 4)]),
    st.sampled_from([8, 16, 32]),
    st.sampled_from([8, 16, 32]),
    st.randoms(use_true_random=False),
)
def test_random_intervals_classify_soundly(heads, seq, form, block_q, block_k, rnd):
    import torch

    causal, n = form
    # Sorted draws give real intervals often; unsorted ones exercise empty intervals.
    values = torch.tensor([[sorted(rnd.randint(0, seq) for _ in range(n)) if rnd.random() < 0.8
                            else [rnd.randint(0, seq) for _ in range(n)] for _ in range(seq)] for _ in range(heads)])
    check_sound(values.view(1, heads, seq, n).int(), causal, seq, block_q, block_k)
