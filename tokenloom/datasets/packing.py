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
among equals). `PackWindow` keeps the pending pieces in stream order and, beside them, sorted
keys (length, then age) so that "the largest that fits" is one bisection, not a scan. FlashMask can express only two intervals per column, so a piece whose windowed
audio is followed by more of its sample (`Positions.ends_row`) must be the last document of
its row: a row takes at most one such piece and places it last. The rest of a row is padding:
modality `PAD_MODALITY`, no targets, a causal segment of the row's last document.

Building rows (`gather`). A row is a list of pieces (a source of positions, start, stop). The
pieces of a whole batch of rows are written by one compiled loop per source
(`datasets/compiled.py`): a window's `Layout` writes them from its segment table, positions
already written out (`Positions`) are copied; one more loop pads the rows and numbers their
documents' segments. Each position of a batch is visited once, whatever the keys.

Fill ratio: a row's non-padding positions over `seq_len`; a batch's is the mean over its rows
(rows have equal lengths), which the stream yields as `fill_ratio` [B] beside the row keys.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from tokenloom.contract import PAD_MODALITY
from tokenloom.datasets.compiled import copy_pieces, empty_positions, finish_rows
from tokenloom.datasets.layout import Layout

# a piece of a row: an object holding position arrays (`Layout`, `Positions`) and [start, stop) of them
Piece = tuple[Any, int, int]
POSITION_FIELDS = ("ids", "labels", "modality", "target", "coords", "segment", "attention", "window")
_AGE_BITS = 40  # a window key is length << 40 | (2**40 - 1 - age): larger = longer, then older


def split_points(length: int, media: Sequence[tuple[int, int]], seq_len: int) -> list[int] | None:
    """Where a sample of `length` positions with media segments `media` ([start, stop) each) is cut
    into pieces of at most `seq_len` positions: [0, c1, ..., length].

    Cuts fall only outside media segments, each as late as the row allows; None when some media
    segment alone is longer than a row (no cut can keep it whole)."""
    if length <= seq_len:
        return [0, length]
    allowed = np.ones(length + 1, dtype=bool)  # allowed[c]: a cut before position c splits no media
    for start, stop in media:
        allowed[start + 1 : stop] = False
    cuts = np.flatnonzero(allowed)
    points = [0]
    while points[-1] < length:
        limit = points[-1] + seq_len
        k = int(np.searchsorted(cuts, limit, side="right")) - 1  # the last allowed cut within the row
        if cuts[k] <= points[-1]:
            return None
        points.append(int(cuts[k]))
    return points


class PackWindow:
    """The pieces pulled and not yet packed, in stream order, and the rule that packs the next row.

    A row: the oldest piece first, then best fit — the largest piece that still fits, the oldest
    among equals; at most one closing piece (`closes`), placed last. A pure function of the pieces
    and their order."""

    def __init__(self) -> None:
        self._pieces: dict[int, tuple[Hashable, Piece, bool]] = {}  # age -> (name, piece, closes), stream order
        self._keys: tuple[list[int], list[int]] = ([], [])  # sorted window keys: open pieces, closing pieces
        self._age = 0

    def __len__(self) -> int:
        return len(self._pieces)

    def names(self) -> list[Hashable]:
        """The pending pieces' names (`add`'s `name`), in stream order."""
        return [name for name, _, _ in self._pieces.values()]

    def add(self, name: Hashable, piece: Piece, closes: bool) -> None:
        length = piece[2] - piece[1]
        if length < 1:
            raise ValueError(f"an empty piece {name!r} cannot be packed")
        self._pieces[self._age] = (name, piece, closes)
        insort(self._keys[closes], (length << _AGE_BITS) | ((1 << _AGE_BITS) - 1 - self._age))
        self._age += 1

    def _remove(self, age: int) -> tuple[Piece, bool]:
        _, piece, closes = self._pieces.pop(age)
        keys = self._keys[closes]
        del keys[bisect_left(keys, ((piece[2] - piece[1]) << _AGE_BITS) | ((1 << _AGE_BITS) - 1 - age))]
        return piece, closes

    def _best(self, room: int, closing: bool) -> int | None:
        keys = self._keys[closing]
        k = bisect_left(keys, (room + 1) << _AGE_BITS) - 1  # the largest key of a piece <= room
        return None if k < 0 else keys[k]

    def take_row(self, seq_len: int) -> list[Piece]:
        """The next row's pieces, in row order (removed from the window)."""
        if not self._pieces:
            raise ValueError("no pending pieces to pack")
        first, closes = self._remove(next(iter(self._pieces)))
        room = seq_len - (first[2] - first[1])
        chosen, last = ([], first) if closes else ([first], None)
        while room > 0:
            key = self._best(room, False)
            if last is None:
                other = self._best(room, True)
                if other is not None and (key is None or other > key):
                    key = other
            if key is None:
                break
            piece, closes = self._remove((1 << _AGE_BITS) - 1 - (key & ((1 << _AGE_BITS) - 1)))
            room -= piece[2] - piece[1]
            if closes:
                last = piece
            else:
                chosen.append(piece)
        return chosen + ([last] if last is not None else [])


def gather(rows: Sequence[Sequence[Piece]], seq_len: int, group_size: int) -> dict[str, np.ndarray]:
    """Rows of pieces, each piece its own document, as a batch [B, seq_len, ...] under the row keys,
    padded after each row's last piece (see the module docstring). Raises if a row does not fit."""
    B, L, G = len(rows), seq_len, group_size
    pieces = [(r, d, p) for r, row in enumerate(rows) for d, p in enumerate(row)]
    if not pieces or any(not row for row in rows):
        raise ValueError("every row needs at least one piece")
    row_of = np.array([r for r, _, _ in pieces], dtype=np.int64)
    doc = np.array([d for _, d, _ in pieces], dtype=np.int64)
    start = np.array([p[1] for _, _, p in pieces], dtype=np.int64)
    n = np.array([p[2] - p[1] for _, _, p in pieces], dtype=np.int64)
    used = np.bincount(row_of, weights=n, minlength=B).astype(np.int64)
    if (used > L).any():
        raise ValueError(f"{int(used.max())} positions do not fit a row of {L}")
    ends = np.cumsum(n)
    first_piece = np.r_[0, np.cumsum(np.bincount(row_of, minlength=B))][:-1]
    in_row = ends - n - (ends - n)[first_piece][row_of]  # where each piece starts in its row
    dest = row_of * L + in_row
    owners: dict[int, int] = {}
    source_of = np.array([owners.setdefault(id(p[0]), len(owners)) for _, _, p in pieces], dtype=np.int64)
    objects = {owners[id(p[0])]: p[0] for _, _, p in pieces}
    ids, labels, modality, target, coords, segment, attention, window = empty_positions(B * L, G)
    docs, segment_ids = np.empty(B * L, np.int64), np.empty(B * L, np.int64)
    # one compiled pass per source writes its pieces (a `Layout` expands them from its segment table,
    # `Positions` are copied), one more pads the rows and numbers their segments
    outs = (ids, labels, modality, target, coords, segment, attention, window)
    for k, obj in objects.items():
        mine = source_of == k if len(objects) > 1 else slice(None)
        if isinstance(obj, Layout):
            obj.expand(start[mine], n[mine], dest[mine], doc[mine], outs, docs)
        else:
            copy_pieces(dest[mine], start[mine], n[mine], doc[mine], obj.ids, obj.labels, obj.modality, obj.target,
                        obj.coords, obj.segment, obj.attention, obj.window, *outs, docs)
    finish_rows(used, np.bincount(row_of, minlength=B) - 1, L, ids, labels, modality, target, coords, segment,
                attention, window, docs, segment_ids)
    out = {"ids": ids.reshape(B, L, G), "labels": labels.reshape(B, L, G), "modality": modality.reshape(B, L),
           "target_modality": target.reshape(B, L), "coords": coords.reshape(B, L, 3),
           "doc_ids": docs.reshape(B, L), "segment_ids": segment_ids.reshape(B, L),
           "attention": attention.reshape(B, L), "window": window.reshape(B, L)}
    return out


def pack_row(samples: Sequence[Any], seq_len: int) -> dict[str, np.ndarray]:
    """Whole samples (`Positions`), in order, as one row of `seq_len` positions (padded; raises if
    they do not fit)."""
    batch = gather([[(s, 0, len(s)) for s in samples]], seq_len, samples[0].ids.shape[1])
    return {k: v[0] for k, v in batch.items()}


def fill_ratio(modality: np.ndarray) -> np.ndarray:
    """Per row, the share of positions that are not padding: `modality` [B, L] -> [B] float64."""
    return (np.asarray(modality) != PAD_MODALITY).mean(axis=-1)
