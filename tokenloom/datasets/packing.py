"""Packing: a sample's positions into rows of `seq_len`, never cutting an image or audio segment.

Why best-fit in a window. Concatenate-and-chunk fills every row but cuts wherever the row ends,
so an image's rows or an audio clip's frames could straddle two rows (two documents to the
mask, half an image to the model). Keeping media whole leaves holes; filling them from a
window of the next `pack_window` pieces in stream order keeps the fill ratio high while the
rows stay a pure function of the sample order and the window (no clocks, no hashes, no sorts
that depend on anything else), so the stream state that names the window resumes exactly.

Pieces. A sample that fits a row is one piece. A longer one is cut, greedily as late as
possible, only at positions outside its media segments (an image segment is its start row and
all of its rows); a cut piece keeps the sample's coordinates and targets, so its last position
still predicts the next piece's first one, as before. A media segment longer than a row cannot
be placed at all: `split_points` returns None and the stream skips the sample and counts it
(`StreamState.skipped`), with a warning that says which `stream.seq_len` would keep it. Skipping
rather than raising: one oversized image must not stop a long run; the count makes it visible.

A row. Its first piece is the oldest pending one (so every piece is packed within `pack_window`
rows); then, while any pending piece fits the rest of the row, the largest one (the earliest
among equals). FlashMask can express only two intervals per column, so a piece whose windowed
audio is followed by more of its sample (`Positions.ends_row`) must be the last document of
its row: a row takes at most one such piece and places it last. The rest of a row is padding:
modality `PAD_MODALITY`, no targets, a causal segment of the row's last document.

Fill ratio: a row's non-padding positions over `seq_len`; a batch's is the mean over its rows
(rows have equal lengths), which the stream yields as `fill_ratio` [B] beside the row keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenloom.contract import ATTENTION_IDS, IGNORE_INDEX, PAD_MODALITY, SPECIAL_TOKENS

if TYPE_CHECKING:
    from tokenloom.datasets.stream import Positions

PAD_ID = SPECIAL_TOKENS.index("<pad>")  # the input id of padding positions (no target uses them)

Piece = tuple["Positions", slice]  # a sample's positions and the slice of them that one row takes


def split_points(sample: Positions, seq_len: int) -> list[int] | None:
    """Where a sample is cut into pieces of at most `seq_len` positions: [0, c1, ..., len(sample)].

    Cuts fall only outside media segments, each as late as the row allows; None when some media
    segment alone is longer than a row (no cut can keep it whole)."""
    n = len(sample)
    if n <= seq_len:
        return [0, n]
    allowed = np.ones(n + 1, dtype=bool)  # allowed[c]: a cut before position c splits no media
    for start, stop in sample.media:
        allowed[start + 1 : stop] = False
    cuts = np.flatnonzero(allowed)
    points = [0]
    while points[-1] < n:
        limit = points[-1] + seq_len
        k = int(np.searchsorted(cuts, limit, side="right")) - 1  # the last allowed cut within the row
        if cuts[k] <= points[-1]:
            return None
        points.append(int(cuts[k]))
    return points


def choose_row(lengths: Sequence[int], closes: Sequence[bool], seq_len: int) -> list[int]:
    """Which pending pieces (indices, in stream order) make the next row, in row order.

    The oldest piece first, then best fit: the largest piece that still fits, the earliest among
    equals; at most one closing piece, placed last. A pure function of its arguments."""
    if not lengths:
        raise ValueError("no pending pieces to pack")
    lens = np.asarray(lengths, dtype=np.int64)
    closing = np.asarray(closes, dtype=bool)
    free = np.ones(len(lens), dtype=bool)
    chosen, last = [0], None
    free[0] = False
    room = seq_len - int(lens[0])
    if closing[0]:
        chosen, last = [], 0
    while room > 0:
        fits = free & (lens <= room) & (~closing if last is not None else True)
        if not fits.any():
            break
        k = int(np.argmax(np.where(fits, lens, -1)))  # argmax: the first of the largest
        free[k] = False
        room -= int(lens[k])
        if closing[k]:
            last = k
        else:
            chosen.append(k)
    return chosen + ([last] if last is not None else [])


def assemble(pieces: Sequence[Piece], seq_len: int, group_size: int) -> dict[str, np.ndarray]:
    """Pieces, in row order, as one row of `seq_len` positions, each piece its own document,
    padded after the last one (see the module docstring). Raises if they do not fit."""
    L, G = seq_len, group_size
    used = sum(sl.stop - sl.start for _, sl in pieces)
    if used > L:
        raise ValueError(f"{used} positions do not fit a row of {L}")
    ids = np.concatenate([s.ids[sl] for s, sl in pieces])
    docs = np.concatenate([np.full(sl.stop - sl.start, d) for d, (_, sl) in enumerate(pieces)])
    cat = {key: np.concatenate([getattr(s, key)[sl] for s, sl in pieces])
           for key in ("modality", "coords", "segment", "attention", "window")}
    labels = np.concatenate([s.labels[sl] for s, sl in pieces])
    target_modality = np.concatenate([s.target[sl] for s, sl in pieces])
    # a segment id unique within the row: (document, segment index) runs
    key = docs * 100_000 + cat["segment"]
    segment_ids = np.cumsum(np.r_[0, key[1:] != key[:-1]])
    row = {
        "ids": ids, "labels": labels, "modality": cat["modality"], "coords": cat["coords"], "doc_ids": docs,
        "segment_ids": segment_ids, "attention": cat["attention"], "window": cat["window"],
        "target_modality": target_modality,
    }
    if used < L:  # padding: a causal segment of the last document, no targets
        pad = L - used
        last_t = row["coords"][-1, 0]
        filler = np.full((pad, G), -1, dtype=np.int64)
        filler[:, 0] = PAD_ID
        row["ids"] = np.concatenate([row["ids"], filler])
        row["labels"] = np.concatenate([row["labels"], np.full((pad, G), IGNORE_INDEX, dtype=np.int64)])
        row["target_modality"] = np.r_[row["target_modality"], np.full(pad, -1)]
        row["modality"] = np.r_[row["modality"], np.full(pad, PAD_MODALITY)]
        row["coords"] = np.concatenate([row["coords"], np.repeat(last_t + 1 + np.arange(pad)[:, None], 3, 1)])
        row["doc_ids"] = np.r_[row["doc_ids"], np.full(pad, row["doc_ids"][-1])]
        row["segment_ids"] = np.r_[row["segment_ids"], np.full(pad, row["segment_ids"][-1] + 1)]
        row["attention"] = np.r_[row["attention"], np.full(pad, ATTENTION_IDS["causal"])]
        row["window"] = np.r_[row["window"], np.zeros(pad, dtype=np.int64)]
    return {k: np.asarray(v, dtype=np.int64) for k, v in row.items()}


def pack_row(samples: Sequence[Positions], seq_len: int) -> dict[str, np.ndarray]:
    """Whole samples, in order, as one row of `seq_len` positions (padded; raises if they do not fit)."""
    return assemble([(s, slice(0, len(s))) for s in samples], seq_len, samples[0].ids.shape[1])


def fill_ratio(modality: np.ndarray) -> np.ndarray:
    """Per row, the share of positions that are not padding: `modality` [B, L] -> [B] float64."""
    return (np.asarray(modality) != PAD_MODALITY).mean(axis=-1)
