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
be placed at all: `planner.cut_samples` marks it and the stream skips the sample and counts it
(`StreamState.skipped`), with a warning that says which `stream.seq_len` would keep it. Skipping
rather than raising: one oversized image must not stop a long run; the count makes it visible.

A row. Its first piece is the oldest pending one (so every piece is packed within `pack_window`
rows); then, while any pending piece fits the rest of the row, the largest one (the earliest
among equals). FlashMask can express only two intervals per column, so a piece whose windowed
audio is followed by more of its sample (`Positions.ends_row`) must be the last document of
its row: a row takes at most one such piece and places it last. The rest of a row is padding:
modality `PAD_MODALITY`, no targets, a causal segment of the row's last document. The rule runs
compiled (`planner.plan_rows`: the pending pieces are a table in stream order, refilled from the
stream's samples and scanned for the best fit), many rows per call, so choosing a row costs no
Python per sample or per row; `tests/layout_reference.py` keeps it as a plain scan.

Building rows (`gather`, `gather_planned`). A row is a list of pieces (a source of positions,
start, stop), or rows are arrays of (source, start, length) as the stream plans them
(`PlannedRows`; the loader joins its readers' rows with `interleave_rows`). The pieces of a whole
batch of rows are written by one compiled loop per source (`datasets/compiled.py`): a window's
`Layout` writes them from its segment table, positions already written out (`Positions`) are
copied; one more loop pads the rows and numbers their documents' segments. Each position of a
batch is visited once, whatever the keys.

Fill ratio: a row's non-padding positions over `seq_len`; a batch's is the mean over its rows
(rows have equal lengths). `gather` counts it while placing the pieces and returns it as
`fill_ratio` [B] beside the row keys, as the stream and the loader yield it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tokenloom.datasets.compiled import copy_pieces, empty_positions, finish_rows, place_pieces
from tokenloom.datasets.layout import Layout
from tokenloom.datasets.planner import interleave_pieces

# a piece of a row: an object holding position arrays (`Layout`, `Positions`) and [start, stop) of them
Piece = tuple[Any, int, int]


def gather(rows: Sequence[Sequence[Piece]], seq_len: int, group_size: int) -> dict[str, np.ndarray]:
    """Rows of pieces, each piece its own document, as a batch [B, seq_len, ...] under the row keys,
    padded after each row's last piece (see the module docstring), and `fill_ratio` [B]. Raises if a
    row does not fit."""
    if not rows or any(not row for row in rows):
        raise ValueError("every row needs at least one piece")
    owners: dict[int, int] = {}
    sources: dict[int, Any] = {}
    table = []
    for row in rows:
        for obj, start, stop in row:
            k = owners.setdefault(id(obj), len(owners))
            sources[k] = obj
            table.append((k, start, stop - start))
    row_ptr = np.r_[0, np.cumsum([len(row) for row in rows])].astype(np.int64)
    return gather_planned(sources, np.array(table, dtype=np.int64).reshape(-1, 3), row_ptr, seq_len, group_size)


def gather_planned(sources: dict[int, Any], pieces: np.ndarray, row_ptr: np.ndarray, seq_len: int,
                   group_size: int) -> dict[str, np.ndarray]:
    """`gather` for rows given as arrays: pieces [n, 3] (source key in `sources`, start, length), row
    r's at pieces[row_ptr[r]:row_ptr[r + 1]]. Besides the row keys, `fill_ratio` [B]: each row's
    non-padding share, counted while placing the pieces."""
    B, L = len(row_ptr) - 1, seq_len
    if B < 1:
        raise ValueError("every row needs at least one piece")
    dest, doc, used = place_pieces(pieces, row_ptr, L)
    # `segment_ids` first holds each position's segment within its sample, which `finish_rows`
    # turns into the row's segment ids
    ids, labels, modality, target, coords, segment_ids, attention, window, docs = empty_positions(B * L, group_size)
    outs = (ids, labels, modality, target, coords, segment_ids, attention, window, docs)
    # one compiled pass per source writes its pieces (a `Layout` expands them from its segment table,
    # `Positions` are copied), one more pads the rows and numbers their segments
    for k, obj in sources.items():
        key = k if len(sources) > 1 else -1
        if isinstance(obj, Layout):
            obj.expand(pieces, key, dest, doc, outs)
        else:
            copy_pieces(pieces, key, dest, doc, obj.ids, obj.labels, obj.modality, obj.target, obj.coords, obj.segment,
                        obj.attention, obj.window, *outs)
    finish_rows(used, row_ptr, L, ids, labels, modality, target, coords, attention, window, docs,
                segment_ids)
    G = ids.shape[1]
    return {"ids": ids.reshape(B, L, G), "labels": labels.reshape(B, L, G), "modality": modality.reshape(B, L),
            "target_modality": target.reshape(B, L), "coords": coords.reshape(B, L, 3),
            "doc_ids": docs.reshape(B, L), "segment_ids": segment_ids.reshape(B, L),
            "attention": attention.reshape(B, L), "window": window.reshape(B, L), "fill_ratio": used / L}


class PlannedRows(NamedTuple):
    """Rows as arrays (what `TokenStream.plan` gives and `gather_planned` builds): pieces [n, 3]
    (source key in `sources`, start, length), row r's at pieces[row_ptr[r]:row_ptr[r + 1]]."""

    sources: dict[int, Any]
    pieces: np.ndarray
    row_ptr: np.ndarray


# Batches are planned and written this many positions at a time, at least (`ahead_batches`): a
# batch costs ~20 us of Python and compiled-call overhead whatever its size, as much as writing
# ~3,000 positions (bench/RESULTS.md), so small batches are made several at a time.
AHEAD_POSITIONS = 1 << 14
# The loader plans this many such writes at a time (its canonical readers' streams each plan their
# rows in one call): planning runs further ahead than writing, whose positions stay within the
# caches (a write of 32K positions at once was 1.25x slower, bench/RESULTS.md).
PLAN_GROUPS = 4


def ahead_batches(batch_size: int, seq_len: int) -> int:
    """How many batches of `batch_size` rows of `seq_len` to plan and write at a time."""
    return max(1, AHEAD_POSITIONS // max(1, batch_size * seq_len))


def interleave_rows(parts: Sequence[tuple[PlannedRows, np.ndarray]], rows: int) -> PlannedRows:
    """One set of `rows` planned rows from several plans: row i of a part's plan becomes row at[i]
    (every row placed once). The loader's rows, which its canonical readers' streams planned. Source
    keys are made unique (each plan numbers its own), one per source object; when every plan names
    the one layout the readers share (the usual case), the pieces keep their keys (`gather_planned`
    reads none with one source)."""
    first = next(iter(parts[0][0].sources.values()))
    single = all(len(plan.sources) == 1 and next(iter(plan.sources.values())) is first for plan, _ in parts)
    sources: dict[int, Any] = {0: first} if single else {}
    key_of: dict[int, int] = {}  # one key per source object: readers share a window's layout
    tables = []
    for plan, _ in parts:
        pieces = plan.pieces[plan.row_ptr[0] : plan.row_ptr[-1]]
        if not single:  # each plan's keys to new ones, through a lookup
            keys = list(plan.sources)
            lookup = np.zeros(max(keys) + 1, dtype=np.int64)
            for k in keys:
                obj = plan.sources[k]
                if id(obj) not in key_of:
                    key_of[id(obj)] = len(sources)
                    sources[len(sources)] = obj
                lookup[k] = key_of[id(obj)]
            pieces = pieces.copy()
            pieces[:, 0] = lookup[pieces[:, 0]]
        tables.append(pieces)
    pieces, row_ptr = interleave_pieces(np.concatenate(tables), np.concatenate([plan.row_ptr for plan, _ in parts]),
                                        np.concatenate([at for _, at in parts]).astype(np.int64, copy=False),
                                        np.array([len(plan.row_ptr) - 1 for plan, _ in parts], dtype=np.int64), rows)
    return PlannedRows(sources, pieces, row_ptr)


def pack_row(samples: Sequence[Any], seq_len: int) -> dict[str, np.ndarray]:
    """Whole samples (`Positions`), in order, as one row of `seq_len` positions (padded; raises if
    they do not fit)."""
    batch = gather([[(s, 0, len(s)) for s in samples]], seq_len, samples[0].ids.shape[1])
    return {k: v[0] for k, v in batch.items() if k != "fill_ratio"}
