"""The stream's per-position loops, compiled (numba): writing positions into rows (choosing the
rows is `datasets/planner.py`), and a window's segment table (`segment_table`, what
`datasets/layout.py` reads from the shards' columns).

Why compiled. Stated as whole-array numpy, the layout rules cost one pass over every position per
rule: ~20 passes of int64 arrays per window of files and ~15 per batch of rows, several times what
reading the same Parquet files costs (bench/bench_packing.py). Here each job is one compiled
call that writes every field of a position once, field by field over each run of positions a
segment and a piece share (plain copies, fills and ramps: a loop that wrote all fields of a
position at once was 1.3-1.4x slower per position, bench/RESULTS.md). The per-segment and per-piece bookkeeping (a few numbers
per segment or piece: `layout.py`, `packing.py`) stays in numpy with the callers; these loops
only expand it to positions.

The rules are those of `stream.py`'s and `layout.py`'s docstrings; tests/layout_reference.py keeps
them as plain Python, and tests/test_layout.py and tests/test_packing.py check these loops
against it. Compiled once per machine into numba's cache (`cache=True`, under `__pycache__`).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba import uint64 as _U

from tokenloom.contract import (
    ATTENTION_IDS,
    IGNORE_INDEX,
    MODALITY_IDS,
    PAD_MODALITY,
    ROW_DTYPE,
    SPECIAL_TOKENS,
)

ROW_ID = SPECIAL_TOKENS.index("<row>")  # the input id of an image's learned start row
PAD_ID = SPECIAL_TOKENS.index("<pad>")  # the input id of padding positions (no target uses them)
_IMAGE, _AUDIO = MODALITY_IDS["image"], MODALITY_IDS["audio"]
_CAUSAL = ATTENTION_IDS["causal"]


# the columns of a layout's segment table (`Layout.segments`, int64 [S, SEGMENT_COLUMNS]): modality,
# first position (in the layout), positions, first token (in the layout's tokens), base coordinate,
# video tick, first segment index within the sample, grid (h, w), attention kind, attention window
MOD, POS, NPOS, TOK, P0, TICK, SEG0, H, W, ATT, WIN = range(11)
SEGMENT_COLUMNS = 11


@njit(cache=True, nogil=True)
def _write_group(tokens, seg, k, j, out, q, empty):
    """The ids of position j of segment k into out[q] (unused slots `empty`)."""
    for slot in range(out.shape[1]):
        out[q, slot] = empty
    mod = seg[k, MOD]
    if mod == _IMAGE:
        pw = max(seg[k, W], 1)
        out[q, 0] = ROW_ID if j < pw else tokens[seg[k, TOK] + j - pw]
    elif mod == _AUDIO:
        levels = seg[k, W]
        for slot in range(levels):
            out[q, slot] = tokens[seg[k, TOK] + j * levels + slot]
    else:
        out[q, 0] = tokens[seg[k, TOK] + j]


@njit(cache=True, nogil=True)
def _label_across(tokens, seg, k, g, sample_last, labels, target, q):
    """The target of a segment's last position g (written at q): the first group of the sample's
    next non-empty segment, none at the sample's end or when that segment is an image (its start
    row is given, not predicted)."""
    for slot in range(labels.shape[1]):
        labels[q, slot] = IGNORE_INDEX
    target[q] = -1
    if g >= sample_last:
        return
    k2 = k + 1
    while seg[k2, NPOS] == 0:
        k2 += 1
    if seg[k2, MOD] != _IMAGE:
        _write_group(tokens, seg, k2, 0, labels, q, IGNORE_INDEX)
        target[q] = seg[k2, MOD]


@njit(cache=True, nogil=True)
def _fields(q0, q1, mod, att, win, d, free, ids, labels, modality, attention, window, docs):
    """What a segment and its piece fix for positions [q0, q1), field by field (unsigned indices:
    no wraparound test per access, so each loop is a plain fill), and -1 / IGNORE_INDEX in the id
    and label slots from `free` on (an audio frame's levels fill those before)."""
    a, b = _U(q0), _U(q1)
    for q in range(a, b):
        modality[q] = mod
    for q in range(a, b):
        attention[q] = att
    for q in range(a, b):
        window[q] = win
    for q in range(a, b):
        docs[q] = d
    for slot in range(free, ids.shape[1]):
        for q in range(a, b):
            ids[q, slot] = -1
        for q in range(a, b):
            labels[q, slot] = IGNORE_INDEX


@njit(cache=True, nogil=True)
def _ramp(coords, q0, q1, t0):
    """coords[q] = (t0 + q, t0 + q, t0 + q) for q in [q0, q1): text and audio advance t = h = w."""
    for q in range(_U(q0), _U(q1)):
        t = t0 + q
        coords[q, 0] = t
        coords[q, 1] = t
        coords[q, 2] = t


@njit(cache=True, nogil=True)
def _fill(out, q0, q1, value):
    for q in range(_U(q0), _U(q1)):
        out[q] = value


@njit(cache=True, nogil=True)
def expand_pieces(tokens, seg, sample_segments, offsets, pieces, key, dest, doc, ids, labels, modality, target,
                  coords, segment, attention, window, docs):
    """Pieces of a layout, written as positions: piece p (a row of `pieces`: source, start, length;
    only those whose source is `key`, all when `key` < 0) is the layout's positions [start, start +
    length) (within one sample), written at dest[p] with document doc[p]. The sample's segments are
    `seg` rows [sample_segments[i], sample_segments[i + 1]), its positions [offsets[i], offsets[i +
    1]); every field and the target of each position is computed here from them (no per-position
    layout kept): what the segment fixes (`_fields`), then each field over the positions of the
    segment within the piece in its own loop (an image a row at a time). A position's target is the next position's group of its own segment,
    except for image rows and a segment's last position (`_label_across`). `segment` gets each
    position's segment index within its sample."""
    for p in range(len(pieces)):
        if key >= 0 and pieces[p, 0] != key:
            continue
        a, b = pieces[p, 1], pieces[p, 1] + pieces[p, 2]
        i = np.searchsorted(offsets, a, side="right") - 1
        sample_last = offsets[i + 1] - 1
        shift, d = dest[p] - a, doc[p]
        for k in range(sample_segments[i], sample_segments[i + 1]):
            s0, npos = seg[k, POS], seg[k, NPOS]
            if s0 >= b:
                break
            lo, hi = max(a, s0), min(b, s0 + npos)
            mod, base, tick, seg0, h, w = seg[k, MOD], seg[k, P0], seg[k, TICK], seg[k, SEG0], seg[k, H], seg[k, W]
            att, win, tok = seg[k, ATT], seg[k, WIN], seg[k, TOK]
            if hi <= lo:
                continue
            _fields(lo + shift, hi + shift, mod, att, win, d, w if mod == _AUDIO else 1, ids, labels, modality,
                    attention, window, docs)
            # each field of the positions [lo, hi) of segment k in its own loop (plain copies and fills)
            if mod == _IMAGE:
                pw = max(w, 1)
                g = lo
                while g < hi:  # one image row (or the start row, r = 0) at a time
                    j = g - s0
                    r = j // pw
                    end = min(hi, s0 + (r + 1) * pw)
                    q0, q1 = _U(g + shift), _U(end + shift)
                    if r == 0:
                        _fill(ids[:, 0], q0, q1, ROW_ID)
                    else:
                        off = tok + j - pw - (g + shift)  # the code at position q: tokens[off + q]
                        for q in range(q0, q1):
                            ids[q, 0] = tokens[off + q]
                    c0 = base + j - r * pw - (g + shift)  # the column coordinate at q: c0 + q
                    for q in range(q0, q1):
                        coords[q, 0] = base + tick
                        coords[q, 1] = base + r
                        coords[q, 2] = c0 + q
                    _fill(segment, q0, q1, seg0 + r)
                    if r < h:  # the start row and rows 0..h-2: the next row's code in column c
                        off = tok + j - (g + shift)
                        for q in range(q0, q1):
                            labels[q, 0] = tokens[off + q]
                        _fill(target, q0, q1, _IMAGE)
                    else:  # the last row: no target, but its last position predicts what follows
                        _fill(labels[:, 0], q0, q1, IGNORE_INDEX)
                        _fill(target, q0, q1, -1)
                        if end == s0 + npos:
                            _label_across(tokens, seg, k, end - 1, sample_last, labels, target, end - 1 + shift)
                    g = end
            else:
                last = min(hi, s0 + npos - 1)  # positions before the segment's last predict within the segment
                q0, q1, ql = _U(lo + shift), _U(hi + shift), _U(max(lo, last) + shift)
                _ramp(coords, q0, q1, base + tick - s0 - shift)
                _fill(segment, q0, q1, seg0)
                _fill(target, q0, ql, mod)
                if mod == _AUDIO and w == ids.shape[1]:  # frames of all G levels: flat copies
                    flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)
                    off = tok + (lo - s0) * w - q0 * w  # the level-0 code of position q: tokens[off + q * w]
                    for i in range(q0 * w, q1 * w):
                        flat_ids[i] = tokens[off + i]
                    for i in range(q0 * w, ql * w):
                        flat_labels[i] = tokens[off + w + i]
                elif mod == _AUDIO:
                    for slot in range(w):
                        off = tok + (lo - s0) * w + slot - q0 * w
                        for q in range(q0, q1):
                            ids[q, slot] = tokens[off + q * w]
                        for q in range(q0, ql):
                            labels[q, slot] = tokens[off + w + q * w]
                else:
                    off = tok - s0 - shift  # the token at position q: tokens[off + q]
                    for q in range(q0, q1):
                        ids[q, 0] = tokens[off + q]
                    for q in range(q0, ql):
                        labels[q, 0] = tokens[off + q + 1]
                if last < hi:
                    _label_across(tokens, seg, k, last, sample_last, labels, target, last + shift)


@njit(cache=True, nogil=True)
def copy_pieces(pieces, key, dest, doc, ids, labels, modality, target, coords, segment, attention, window,
                o_ids, o_labels, o_modality, o_target, o_coords, o_segment, o_attention, o_window, o_docs):
    """Pieces of one source (`expand_pieces`' `pieces` and `key`), positions already written out,
    into a flat batch: piece p's positions from its start to dest[p], each marked with doc[p]."""
    G = o_ids.shape[1]
    for k in range(len(pieces)):
        if key >= 0 and pieces[k, 0] != key:
            continue
        for i in range(pieces[k, 2]):
            a, b = pieces[k, 1] + i, dest[k] + i
            for slot in range(G):
                o_ids[b, slot] = ids[a, slot]
                o_labels[b, slot] = labels[a, slot]
            o_coords[b, 0], o_coords[b, 1], o_coords[b, 2] = coords[a, 0], coords[a, 1], coords[a, 2]
            o_modality[b], o_target[b], o_segment[b] = modality[a], target[a], segment[a]
            o_attention[b], o_window[b], o_docs[b] = attention[a], window[a], doc[k]


@njit(cache=True, nogil=True)
def finish_rows(used, row_ptr, seq_len, ids, labels, modality, target, coords, attention, window, docs,
                segment_ids):
    """Pad each row after its `used` positions (no targets, coordinates going on from the last
    one, the row's last document: its pieces are row_ptr[r]..row_ptr[r + 1]) and number its segments: `segment_ids` holds each
    position's segment index within its sample (as `expand_pieces` wrote it) and gets, in place, a
    new id at each change of (document, segment), padding a segment of its own, counting from 0
    per row."""
    G = ids.shape[1]
    for r in range(len(used)):
        row0, u = r * seq_len, used[r]
        last_t = coords[row0 + u - 1, 0]
        for col in range(u, seq_len):
            q = row0 + col
            ids[q, 0] = PAD_ID
            labels[q, 0] = IGNORE_INDEX
            for slot in range(1, G):
                ids[q, slot] = -1
                labels[q, slot] = IGNORE_INDEX
            t = last_t + 1 + col - u
            coords[q, 0], coords[q, 1], coords[q, 2] = t, t, t
            modality[q], target[q], attention[q], window[q] = PAD_MODALITY, -1, _CAUSAL, 0
            docs[q], segment_ids[q] = row_ptr[r + 1] - row_ptr[r] - 1, -1  # a sample's segments count from 0: -1 is padding's own
        sid, prev_doc, prev_seg = 0, docs[row0], segment_ids[row0]
        segment_ids[row0] = 0
        for q in range(_U(row0 + 1), _U(row0 + seq_len)):  # unsigned: no wraparound test per access
            d, s = docs[q], segment_ids[q]
            sid += (d != prev_doc) | (s != prev_seg)
            prev_doc, prev_seg = d, s
            segment_ids[q] = sid


def empty_positions(P: int, G: int) -> tuple[np.ndarray, ...]:
    """Uninitialized int32 arrays (`contract.ROW_DTYPE`) for P positions of G slots: ids, labels,
    modality, target, coords, segment, attention, window, docs (every entry is written by
    `expand_pieces` or `copy_pieces`, and `finish_rows`). int32, not int64: writing the rows is the
    packer's largest cost, and half the bytes made the stream ~1.09x and the trainer's path ~1.07x
    as fast over a long run, a consumer that keeps its batches ~1.34x (bench/RESULTS.md). One
    allocation per key, not one block: a block of a whole batch is past malloc's mmap threshold, so
    a consumer that keeps its batches faulted in fresh pages for each (an epoch of kept batches: 97
    ms against 71-82 ms, bench/RESULTS.md)."""
    t = ROW_DTYPE
    return (np.empty((P, G), t), np.empty((P, G), t), np.empty(P, t), np.empty(P, t), np.empty((P, 3), t),
            np.empty(P, t), np.empty(P, t), np.empty(P, t), np.empty(P, t))


@njit(cache=True, nogil=True)
def place_pieces(pieces, row_ptr, seq_len):
    """Where each piece of planned rows goes: its flat destination in a [B * seq_len] batch and its
    document (its place in the row); and each row's used positions. Raises when a row overflows."""
    B = len(row_ptr) - 1
    dest = np.empty(len(pieces), dtype=np.int64)
    doc = np.empty(len(pieces), dtype=np.int64)
    used = np.zeros(B, dtype=np.int64)
    for r in range(B):
        if row_ptr[r + 1] <= row_ptr[r]:
            raise ValueError("every row needs at least one piece")
        at = r * seq_len
        for m in range(row_ptr[r], row_ptr[r + 1]):
            if pieces[m, 2] < 1:
                raise ValueError("an empty piece cannot be packed")
            dest[m], doc[m] = at, m - row_ptr[r]
            at += pieces[m, 2]
        used[r] = at - r * seq_len
        if used[r] > seq_len:
            raise ValueError("the pieces of a row do not fit it")
    return dest, doc, used


@njit(cache=True, nogil=True)
def segment_table(sample, mod, start, length, grid0, grid1, att, time, token_offsets, n, group_size, audio_window,
                  default_attention, tick_ms, window_id):
    """The segment table of N samples (`layout.py`'s rules, in one pass per segment): segments
    grouped by sample in sample order, columns as `layout._Segments` holds them. Returns (error,
    k): error 0 and the table (`SEGMENT_COLUMNS` columns), the samples' first segments [N + 1],
    their first positions [N + 1], whether each ends its row [N], the first media segment of each
    sample [N + 1] and every media segment's sample-local [start, stop) [M, 2]; or the first
    failed check (1: a segment outside its sample, 2: an audio grid that does not match its
    length, 3: audio levels past `group_size`, 4: an image grid that does not match its length) and
    the segment that failed it, the checks in that order (the caller words the error). One call
    that holds no GIL: the read-ahead thread lays a window out without waiting for the packer's
    thread between steps."""
    S = len(mod)
    nothing = np.zeros(0, dtype=np.int64)
    for k in range(S):  # every segment within its sample (the expansion reads tokens unchecked)
        media = mod[k] == _IMAGE or mod[k] == _AUDIO
        sample_len = token_offsets[sample[k] + 1] - token_offsets[sample[k]]
        if start[k] < 0 or length[k] < 0 or start[k] + length[k] > sample_len or (
                media and (grid0[k] < 0 or grid1[k] < 0)):
            return 1, k, np.zeros((0, SEGMENT_COLUMNS), dtype=np.int64), nothing, nothing, \
                np.zeros(0, dtype=np.bool_), nothing, np.zeros((0, 2), dtype=np.int64)
    for check in range(2, 5):
        for k in range(S):
            if (check == 2 and mod[k] == _AUDIO and grid0[k] * grid1[k] != length[k]) or (
                    check == 3 and mod[k] == _AUDIO and grid1[k] > group_size) or (
                    check == 4 and mod[k] == _IMAGE and grid0[k] * grid1[k] != length[k]):
                return check, k, np.zeros((0, SEGMENT_COLUMNS), dtype=np.int64), nothing, nothing, \
                    np.zeros(0, dtype=np.bool_), nothing, np.zeros((0, 2), dtype=np.int64)
    table = np.empty((S, SEGMENT_COLUMNS), dtype=np.int64)
    sample_segments = np.zeros(n + 1, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    ends_row = np.zeros(n, dtype=np.bool_)
    media_offsets = np.zeros(n + 1, dtype=np.int64)
    n_media = 0
    for k in range(S):
        sample_segments[sample[k] + 1] += 1
        if mod[k] == _IMAGE or mod[k] == _AUDIO:
            media_offsets[sample[k] + 1] += 1
            n_media += 1
    for i in range(n):
        sample_segments[i + 1] += sample_segments[i]
        media_offsets[i + 1] += media_offsets[i]
    media = np.empty((n_media, 2), dtype=np.int64)
    # per segment: positions, coordinate advance, tick; a run of timed segments of one sample is one
    # video, all at its first position: its last segment advances past its largest coordinate
    advance = np.empty(S, dtype=np.int64)
    pos = 0
    for k in range(S):
        h, w = grid0[k], grid1[k]
        if mod[k] == _IMAGE:
            npos, adv = (h + 1) * w, max(h + 1, w)
        elif mod[k] == _AUDIO:
            npos, adv = h, h
        else:
            npos, adv = length[k], length[k]
        tick = time[k] // tick_ms if time[k] >= 0 else 0
        a = att[k] if att[k] >= 0 else default_attention[mod[k]]
        table[k, MOD], table[k, POS], table[k, NPOS] = mod[k], pos, npos
        table[k, TOK] = token_offsets[sample[k]] + start[k]
        table[k, TICK], table[k, H], table[k, W] = tick, h, w
        table[k, ATT], table[k, WIN] = a, audio_window if a == window_id else 0
        advance[k] = adv
        offsets[sample[k] + 1] += npos
        pos += npos
    k = 0
    while k < S:  # videos: runs of timed segments of one sample
        if time[k] < 0:
            k += 1
            continue
        stop, span = k, 0
        while stop < S and time[stop] >= 0 and sample[stop] == sample[k]:
            tick, npos = table[stop, TICK], table[stop, NPOS]
            # one past the segment's largest coordinate offset: a frame's rows r <= h and columns c < w
            # at its tick, audio frames at tick + j
            extent = max(tick, max(grid0[stop], grid1[stop] - 1)) + 1 if mod[stop] == _IMAGE else tick + npos
            span = max(span, extent)
            advance[stop] = 0
            stop += 1
        advance[stop - 1] = span
        k = stop
    for i in range(n):
        offsets[i + 1] += offsets[i]
    # per sample: coordinates and segment indices restart; a windowed segment followed by more of
    # the sample ends its row; media segments in sample-local positions
    m = 0
    for i in range(n):
        p0, seg0 = 0, 0
        for k in range(sample_segments[i], sample_segments[i + 1]):
            table[k, P0], table[k, SEG0] = p0, seg0
            p0 += advance[k]
            seg0 += grid0[k] + 1 if mod[k] == _IMAGE else 1
            npos, win = table[k, NPOS], table[k, WIN]
            if win > 0 and npos > win and k < sample_segments[i + 1] - 1:
                ends_row[i] = True
            if mod[k] == _IMAGE or mod[k] == _AUDIO:
                local = table[k, POS] - offsets[i]
                media[m, 0], media[m, 1] = local, local + npos
                m += 1
    return 0, -1, table, sample_segments, offsets, ends_row, media_offsets, media


@njit(cache=True, nogil=True)
def _name_index(data, a, b, names, name_offsets, first, stop):
    """The index (from `first`) of bytes data[a:b] among names first..stop-1 (`names` concatenated,
    name_offsets[i] where name i starts), -1 when none."""
    for j in range(first, stop):
        c0, c1 = name_offsets[j], name_offsets[j + 1]
        if c1 - c0 != b - a:
            continue
        same = True
        for c in range(b - a):
            if data[a + c] != names[c0 + c]:
                same = False
                break
        if same:
            return j - first
    return -1


@njit(cache=True, nogil=True)
def segment_columns(sample0, seg_offsets, mod_offsets, mod_data, start, length, grid_offsets, grid_values,
                    att_bits, att_bit0, att_offsets, att_data, names, name_offsets, n_modalities, at, out_sample,
                    out_mod, out_start, out_length, out_grid0, out_grid1, out_att, out_time):
    """One chunk of the shard contract's `segments` column, read from its Arrow buffers, into the
    segment columns that `layout._Segments` holds, from row `at` on (the chunk's samples numbered
    from `sample0`). The buffers: the list offsets of the chunk's N samples into the struct's
    fields (N + 1 of them); the fields' values (modality and attention as string offsets and bytes,
    grid as list offsets and values); `att_bits`, attention's validity bitmap from bit `att_bit0`
    (empty: none null). `names`: the modalities then the attention kinds, concatenated. Returns
    the rows written, or -1 when a sample has no segment or a name is not a known one (the caller
    reads such a chunk through pyarrow, which words the error). One call that holds no GIL, in
    place of ~30 pyarrow and numpy calls (`layout.layout_chunks`)."""
    row = at
    n_names = len(name_offsets) - 1
    for i in range(len(seg_offsets) - 1):
        if seg_offsets[i + 1] <= seg_offsets[i]:
            return -1
        for k in range(seg_offsets[i], seg_offsets[i + 1]):
            m = _name_index(mod_data, mod_offsets[k], mod_offsets[k + 1], names, name_offsets, 0, n_modalities)
            if m < 0:
                return -1
            a = -1
            if len(att_bits) == 0 or (att_bits[(att_bit0 + k) >> 3] >> ((att_bit0 + k) & 7)) & 1:
                a = _name_index(att_data, att_offsets[k], att_offsets[k + 1], names, name_offsets, n_modalities,
                                n_names)
                if a < 0:
                    return -1
            g0, g1 = grid_offsets[k], grid_offsets[k + 1]
            out_sample[row], out_mod[row], out_att[row] = sample0 + i, m, a
            out_start[row], out_length[row] = start[k], length[k]
            out_grid0[row] = grid_values[g0] if g1 - g0 >= 2 else 0
            out_grid1[row] = grid_values[g0 + 1] if g1 - g0 >= 2 else 0
            out_time[row] = grid_values[g0 + 2] if g1 - g0 >= 3 else -1
            row += 1
    return row - at
