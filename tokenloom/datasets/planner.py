"""Choosing rows, compiled (numba): samples cut into pieces, the packing window, the row rule.

Why compiled. The stream used to pull samples into the packing window and take rows one at a
time in Python (~4 us per sample and ~2 us per row, plus building each row's piece list): at
`seq_len` 256 that alone cost more than reading the files. Here a window of samples is cut into
pieces in one call (`cut_samples`), and `plan_rows` refills the window and takes the rows of a
whole batch in one call, so Python runs per batch and per window of files.

The rules are `datasets/packing.py`'s (pieces cut only outside media, as late as the row allows;
a row: the oldest pending piece first, then the largest that fits, the oldest among equals, at
most one closing piece, placed last) and the stream's (`datasets/stream.py`: a whole epoch of
samples giving no piece packs what pends, or fails when nothing pends). The window is a table of
pending pieces in stream order, scanned for the best fit (at most `pack_window` plus one sample's
pieces); tests/layout_reference.py keeps the row rule as a plain scan and tests/test_packing.py
checks `plan_rows` against it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# the columns of the pending-piece table (`plan_rows`'s `pend`, int64 [capacity, PEND_COLUMNS]), in
# stream order: the piece's name (epoch, rank-local cursor, sample-local [start, stop)), the layout
# holding it (a source id of the stream), its first position in that layout, whether it closes its row
EPOCH, CURSOR, START, STOP, SRC, PPOS, CLOSES = range(7)
PEND_COLUMNS = 7
# `plan_rows`'s counters (int64 [COUNTERS]) and the reasons it returns
N_PEND, NEXT, SKIPPED, REMOVED, EMPTY_RUN, FIRST_SKIP = range(6)
COUNTERS = 6
DONE, NEED_SAMPLES, NOTHING_LEFT, NOTHING_FITS = range(4)


@njit(cache=True, nogil=True)
def _pick_row(pend, length, closes, head, n_phys, seq_len, out, n_out, logged, taken, row):
    """The next row from the pending pieces (`packing.py`'s rule: the oldest first, then the largest
    that fits, the oldest among equals, at most one closing piece, placed last), written to
    out[n_out:] as (source, position, length). Returns the pieces written.

    The pending pieces are pend[head:n_phys] in stream order, with their lengths and whether each
    closes its row alongside (contiguous, for the scans); a piece no longer pending (taken) has a
    length of seq_len + 1, so it never fits, and so do the pieces this takes. Each pick scans the
    lengths; a piece exactly as long as the room left is the pick as soon as the scan meets it:
    none is longer, none of that length is older. With a log (`plan_rows`' marks), each piece
    taken gets taken[logged[i]] = row."""
    log = len(taken) > 0
    dead = seq_len + 1
    n_chosen, last = 0, -1
    if closes[head]:
        last = head
    else:
        out[n_out, 0], out[n_out, 1], out[n_out, 2] = pend[head, SRC], pend[head, PPOS], length[head]
        n_chosen = 1
    room = seq_len - length[head]
    length[head] = dead
    if log:
        taken[logged[head]] = row
    while room > 0:
        best_open, best_close, open_len, close_len = -1, -1, 0, 0
        for i in range(head + 1, n_phys):
            li = length[i]
            if li > room:
                continue
            if closes[i]:
                if last < 0 and li > close_len:
                    best_close, close_len = i, li
                    if li == room:
                        break
            elif li > open_len:
                best_open, open_len = i, li
                if li == room:
                    break
        # a closing piece wins when longer, or as long and older (earlier in stream order)
        pick = best_close if best_close >= 0 and (best_open < 0 or close_len > open_len or (
            close_len == open_len and best_close < best_open)) else best_open
        if pick < 0:
            break
        room -= length[pick]
        if closes[pick]:
            last = pick
        else:
            m = n_out + n_chosen
            out[m, 0], out[m, 1], out[m, 2] = pend[pick, SRC], pend[pick, PPOS], length[pick]
            n_chosen += 1
        length[pick] = dead
        if log:
            taken[logged[pick]] = row
    if last >= 0:
        m = n_out + n_chosen
        out[m, 0], out[m, 1], out[m, 2] = pend[last, SRC], pend[last, PPOS], pend[last, STOP] - pend[last, START]
        n_chosen += 1
    return n_chosen


@njit(cache=True, nogil=True)
def _compact(pend, length, closes, logged, head, n_phys, seq_len):
    """Drop the taken pieces from pend[head:n_phys] (and their lengths, closes and log entries),
    keeping stream order, to the front. Returns how many pend."""
    kept = 0
    for i in range(head, n_phys):
        if length[i] <= seq_len:
            if kept != i:
                for col in range(PEND_COLUMNS):
                    pend[kept, col] = pend[i, col]
                length[kept], closes[kept], logged[kept] = length[i], closes[i], logged[i]
            kept += 1
    return kept


# taken pieces stay in `plan_rows`' table (skipped by the scans) until this many have gathered
_COMPACT_AFTER = 32


@njit(cache=True, nogil=True)
def plan_rows(pend, counters, rows, pack_window, seq_len, refill, epoch, first, src, base, closes, status,
              piece_ptr, piece_start, piece_stop, samples_per_epoch, out, row_ptr, marks_at, log, taken,
              mark_log, mark_counters):
    """Up to `rows` rows: before each, pending pieces are refilled from the window of samples (one
    sample at a time, in cursor order, while fewer than `pack_window` pend), then a row is taken.

    The window: rank-local cursors [first, first + len(status)) of `epoch`, from layout source `src`;
    per cursor its first position `base`, whether it closes its row, its status (0: its pieces are
    piece_ptr[k]..piece_ptr[k + 1] of (piece_start, piece_stop); 1: skipped, a media segment longer
    than a row; 2: removed, deleted by a later snapshot). counters[NEXT] is the next cursor to pull
    (it may be past this window: then nothing is pulled). Rows go to `out` as (source, position,
    length) pieces, row r's being out[row_ptr[r]:row_ptr[r + 1]] for the rows made this call. The
    pending table pend[:counters[N_PEND]] (its capacity `len(pend)` at least the pieces pending
    plus `pack_window` plus one sample's) is in stream order when this returns; within the call,
    taken pieces are dropped from it every `_COMPACT_AFTER` (`_pick_row` skips them).

    Marks (the caller's record of the state after each batch of rows planned ahead,
    `TokenStream.batches`): with marks_at (ascending row counts, from this call's first), every
    piece that pends in the call is logged once, in stream order: log[j] its row of the table,
    taken[j] the row (of this call) that took it, or `rows` when none did. After marks_at[m] rows
    the counters as they stand go to mark_counters[m] and the log's length to mark_log[m]: the
    pieces pending then are those of log[:mark_log[m]] with taken >= marks_at[m] (`pending_at`).
    A mark costs O(1) whatever the window; the log at most `len(pend)` entries plus those taken
    (the caller sizes it by `out`).

    Returns (rows made, reason): DONE; NEED_SAMPLES (the next cursor is past this window: the caller
    gives the next one and calls again); NOTHING_LEFT (no piece pends and `refill` is off: the
    passes are read); NOTHING_FITS (a whole epoch of samples gave no piece and none pends)."""
    cap = len(pend)
    length = np.empty(cap, dtype=np.int64)
    pend_closes = np.empty(cap, dtype=np.bool_)
    logging = len(marks_at) > 0
    logged = np.empty(cap, dtype=np.int64)  # each table row's log entry (when logging)
    n_log = 0
    n_phys = live = counters[N_PEND]
    head = 0
    for i in range(n_phys):
        length[i], pend_closes[i] = pend[i, STOP] - pend[i, START], pend[i, CLOSES] != 0
        if logging:
            for col in range(PEND_COLUMNS):
                log[n_log, col] = pend[i, col]
            taken[n_log], logged[i] = rows, n_log
            n_log += 1
    made = 0
    mark = 0
    while mark < len(marks_at) and marks_at[mark] <= 0:
        mark += 1
    reason = DONE
    while made < rows:
        while refill and live < pack_window:
            k = counters[NEXT] - first
            if k < 0 or k >= len(status):
                reason = NEED_SAMPLES
                break
            counters[NEXT] += 1
            if status[k] == 1:
                counters[SKIPPED] += 1
                if counters[FIRST_SKIP] < 0:
                    counters[FIRST_SKIP] = first + k
            elif status[k] == 2:
                counters[REMOVED] += 1
            if status[k] != 0 or piece_ptr[k + 1] == piece_ptr[k]:
                counters[EMPTY_RUN] += 1
                if counters[EMPTY_RUN] > samples_per_epoch:
                    if live:
                        break  # a whole epoch gave nothing more: pack what is pending
                    reason = NOTHING_FITS
                    break
                continue
            counters[EMPTY_RUN] = 0
            if n_phys + piece_ptr[k + 1] - piece_ptr[k] > cap:
                n_phys, head = _compact(pend, length, pend_closes, logged, head, n_phys, seq_len), 0
            for m in range(piece_ptr[k], piece_ptr[k + 1]):
                pend[n_phys, EPOCH], pend[n_phys, CURSOR] = epoch, first + k
                pend[n_phys, START], pend[n_phys, STOP] = piece_start[m], piece_stop[m]
                pend[n_phys, SRC], pend[n_phys, PPOS], pend[n_phys, CLOSES] = src, base[k] + piece_start[m], closes[k]
                length[n_phys], pend_closes[n_phys] = piece_stop[m] - piece_start[m], closes[k] != 0
                if logging:
                    for col in range(PEND_COLUMNS):
                        log[n_log, col] = pend[n_phys, col]
                    taken[n_log], logged[n_phys] = rows, n_log
                    n_log += 1
                n_phys += 1
                live += 1
        if reason != DONE:
            break
        counters[EMPTY_RUN] = 0
        if live == 0:
            reason = NOTHING_LEFT
            break
        n = _pick_row(pend, length, pend_closes, head, n_phys, seq_len, out, row_ptr[made], logged,
                      taken if logging else taken[:0], made)
        live -= n
        while head < n_phys and length[head] > seq_len:
            head += 1
        if n_phys - head - live >= _COMPACT_AFTER:
            n_phys, head = _compact(pend, length, pend_closes, logged, head, n_phys, seq_len), 0
        row_ptr[made + 1] = row_ptr[made] + n
        made += 1
        if mark < len(marks_at) and marks_at[mark] == made:
            mark_counters[mark] = counters
            mark_counters[mark, N_PEND] = live
            mark_log[mark] = n_log
            mark += 1
    counters[N_PEND] = _compact(pend, length, pend_closes, logged, head, n_phys, seq_len)
    return made, reason


@njit(cache=True, nogil=True)
def _cut(length, media, m0, m1, seq_len, piece_start, piece_stop, at, write):
    """Sample pieces of at most `seq_len` positions, cut only outside its media segments media[m0:m1]
    (sample-local [start, stop), in order), each cut as late as the row allows; written at `at` when
    `write`. Returns how many, or -1 when a media segment alone is longer than a row."""
    p, n = 0, 0
    while p < length:
        c = min(p + seq_len, length)
        if c < length:
            for m in range(m0, m1):  # a cut inside a media segment moves back to its start
                if media[m, 0] < c < media[m, 1]:
                    c = media[m, 0]
                    break
        if c <= p:
            return -1
        if write:
            piece_start[at + n], piece_stop[at + n] = p, c
        p, n = c, n + 1
    return n


@njit(cache=True, nogil=True)
def cut_samples(lengths, index, media_offsets, media, seq_len, status):
    """Every sample's pieces (`_cut`) for a window of samples: sample k is the layout's sample
    index[k]; status 0 samples are cut (status 1 where they cannot be), others give none. Returns
    (piece_ptr [K + 1], piece_start, piece_stop)."""
    K = len(lengths)
    piece_ptr = np.zeros(K + 1, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    for k in range(K):
        n = 0
        if status[k] == 0:
            i = index[k]
            n = _cut(lengths[k], media, media_offsets[i], media_offsets[i + 1], seq_len, empty, empty, 0, False)
            if n < 0:
                status[k], n = 1, 0
        piece_ptr[k + 1] = piece_ptr[k] + n
    piece_start = np.empty(piece_ptr[K], dtype=np.int64)
    piece_stop = np.empty(piece_ptr[K], dtype=np.int64)
    for k in range(K):
        if piece_ptr[k + 1] > piece_ptr[k]:
            i = index[k]
            _cut(lengths[k], media, media_offsets[i], media_offsets[i + 1], seq_len, piece_start, piece_stop,
                 piece_ptr[k], True)
    return piece_ptr, piece_start, piece_stop


@njit(cache=True, nogil=True)
def interleave_pieces(pieces, ptrs, at, part_rows, rows):
    """Rows planned in parts as one set of `rows` rows (`packing.interleave_rows`): part p's rows are
    part_rows[p] rows of pieces (its row pointers among `ptrs`, each part's own, one more than its
    rows; its pieces after the parts before it in `pieces`), its row i going to row at[i] (the
    parts' `at` one after the other). Returns (pieces, row_ptr) of the rows in order; raises unless
    every row is placed once."""
    start = np.full(rows, -1, dtype=np.int64)
    count = np.zeros(rows, dtype=np.int64)
    i, p0, off = 0, 0, 0
    for p in range(len(part_rows)):
        n = part_rows[p]
        for r in range(n):
            d = at[i + r]
            if d < 0 or d >= rows or start[d] >= 0:
                raise ValueError("interleaved rows must place every row once")
            start[d] = off + ptrs[p0 + r] - ptrs[p0]
            count[d] = ptrs[p0 + r + 1] - ptrs[p0 + r]
        off += ptrs[p0 + n] - ptrs[p0]
        p0 += n + 1
        i += n
    if i != rows:
        raise ValueError("interleaved rows must place every row once")
    row_ptr = np.zeros(rows + 1, dtype=np.int64)
    for r in range(rows):
        row_ptr[r + 1] = row_ptr[r] + count[r]
    out = np.empty((row_ptr[rows], 3), dtype=np.int64)
    for r in range(rows):
        s, q = start[r], row_ptr[r]
        for m in range(count[r]):
            out[q + m, 0], out[q + m, 1], out[q + m, 2] = pieces[s + m, 0], pieces[s + m, 1], pieces[s + m, 2]
    return out, row_ptr


def pending_at(log: np.ndarray, taken: np.ndarray, n_log: int, rows: int) -> np.ndarray:
    """The pending pieces (rows of `plan_rows`' table, in stream order) after `rows` rows of a call
    that logged `log` and `taken`, of which the first `n_log` had pended by then."""
    return log[:n_log][taken[:n_log] >= rows]
