"""Samples as positions, many at once: the stream's layout rules as a table per segment.

Why a segment table. The stream reads a window of Parquet files and lays out every sample of it
(ids grouped per position, targets, rotary coordinates, segments, attention). Done one sample at a
time in Python that cost ~30x what reading the files costs; as whole-array numpy over every
position, ~20 passes of int64 arrays per window, still several times the read. Here a window's
segments come out of Arrow as columns and every per-segment fact (where its positions, tokens,
coordinates and segment indices start, its grid, attention and window) is computed by one
compiled pass over segments (`compiled.segment_table`), a few numbers each: as ~40 numpy calls it
cost the read-ahead thread a wait for the GIL at each call while the packer's thread ran Python
(bench/RESULTS.md). Positions are written only where they are used,
by one compiled loop (`datasets/compiled.py`): straight into a packed row, or into one sample's
`Positions`. Reading a window to its layout now costs what reading the files costs
(bench/bench_packing.py).

The rules (the module docstring of `datasets/stream.py` states them; `Positions` is one
sample's view). Per segment: a text token is one position; an audio frame of L codes (stored
frame-major) is one position holding L ids; an h x w image is a start row of w `<row>` positions
then its h rows, each row its own segment. Coordinates restart per sample: text and audio
advance (t, h, w) by one per position; an image begun at p puts row r (0 = the start row) at
(p, p + r, p + c) and the sample continues at p + max(h + 1, w). A video's timed segments (a third
grid entry: ms) share one base p, the video's first position: a frame at tick = ms // TIME_TICK_MS
puts row r at (p + tick, p + r, p + c), an audio frame j of a segment at tick at p + tick + j on all
three axes, and the sample continues one past the largest coordinate of the video. Targets: the next position's
group within the sample, except that nothing predicts a start row, the start row and rows 0..h-2
predict the next row's codes column by column, and of the last row only its last position
predicts (what follows the image).

`Layout` holds N samples' segment table, tokens and offsets; `Layout.sample(i)` writes one sample
out as `Positions`, `Layout.expand` writes pieces of samples into rows. `layout_table` builds one
from the shard contract's Arrow columns, whatever their chunks, widths and nulls;
`layout_chunks` from chunks in the plain form shard writers give, read from their Arrow buffers
(numpy views, one compiled call per chunk: what the stream's read-ahead thread uses, as it then
rarely waits for the GIL); `sample_positions` from one sample's tokens and segment dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.contract import (
    ATTENTION_IDS,
    ATTENTION_KINDS,
    DEFAULT_ATTENTION,
    MODALITIES,
    MODALITY_IDS,
    TIME_TICK_MS,
)
from tokenloom.datasets import compiled as C
from tokenloom.datasets.compiled import ROW_ID, empty_positions, expand_pieces

__all__ = ["ROW_ID", "Layout", "Positions", "layout_chunks", "layout_table", "sample_positions"]

TEXT, AUDIO = MODALITY_IDS["text"], MODALITY_IDS["audio"]
WINDOW = ATTENTION_IDS["window"]
_DEFAULT_ATTENTION = np.array([ATTENTION_IDS[DEFAULT_ATTENTION[m]] for m in MODALITIES])


@dataclass
class Positions:
    """One sample read as positions, with each position's target."""

    ids: np.ndarray  # [P, G] int64, unused slots -1
    modality: np.ndarray  # [P]
    coords: np.ndarray  # [P, 3] rotary (t, h, w)
    segment: np.ndarray  # [P] segment index within the sample
    attention: np.ndarray  # [P] ATTENTION_IDS
    window: np.ndarray  # [P] attention window (0 unless windowed)
    ends_row: bool  # a windowed segment is followed by more of this sample
    labels: np.ndarray | None = None  # [P, G] the group each position predicts, IGNORE_INDEX where none
    target: np.ndarray | None = None  # [P] the modality of that target, -1 where none
    media: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) positions of each image/audio segment

    def __len__(self) -> int:
        return len(self.modality)


@dataclass
class Layout:
    """N samples laid out: sample i holds positions [offsets[i], offsets[i + 1]) and segments
    [sample_segments[i], sample_segments[i + 1]) of the segment table.

    Positions are not kept: a segment's row of the table (`datasets/compiled.py`'s columns) states
    all of its positions, and `compiled.expand_pieces` writes them where they are used (into a
    packed row, or `sample(i)` for one sample), so a window costs its tokens and a few numbers per
    segment, not ~20 per position."""

    segments: np.ndarray  # [S, SEGMENT_COLUMNS] int64
    sample_segments: np.ndarray  # [N + 1]
    offsets: np.ndarray  # [N + 1]
    ends_row: np.ndarray  # [N] bool
    media_offsets: np.ndarray  # [N + 1]: sample i's media segments are rows [media_offsets[i], media_offsets[i+1])
    media: np.ndarray  # [M, 2] sample-local [start, stop) of every image/audio segment
    tokens: np.ndarray  # the samples' flat tokens (int32)
    token_offsets: np.ndarray  # [N + 1]
    group_size: int = 1  # id slots per position

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.segments, self.sample_segments, self.offsets, self.ends_row,
                                      self.media_offsets, self.media, self.tokens, self.token_offsets))

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def media_of(self, i: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.media[self.media_offsets[i] : self.media_offsets[i + 1]]]

    def sample_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.token_offsets[i] : self.token_offsets[i + 1]]

    def sample(self, i: int) -> Positions:
        """Sample i's positions, written out (int64)."""
        P, G = self.length(i), self.group_size
        out = empty_positions(P, G)
        ids, labels, modality, target, coords, segment, attention, window, _ = out
        self.expand(np.array([[0, self.offsets[i], P]], dtype=np.int64), -1, np.zeros(1, dtype=np.int64),
                    np.zeros(1, dtype=np.int64), out)
        return Positions(ids, modality, coords, segment, attention, window, bool(self.ends_row[i]), labels, target,
                         self.media_of(i))

    def expand(self, pieces: np.ndarray, key: int, dest: np.ndarray, doc: np.ndarray, out: tuple) -> None:
        """Write pieces of this layout's positions (rows of `pieces`: source, start, length; those of
        source `key`, all when `key` < 0) at `dest` of the position arrays `out` (ids, labels,
        modality, target, coords, segment, attention, window, docs), `doc` into docs."""
        expand_pieces(self.tokens, self.segments, self.sample_segments, self.offsets, pieces, key, dest, doc, *out)


def sample_positions(tokens: np.ndarray, segments: Sequence[dict] | None, group_size: int,
                  audio_window: int) -> Positions:
    """One sample's flat tokens and segment dicts -> its positions and targets."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)  # as a shard holds them (one compiled signature)
    if not segments:
        segments = [{"modality": "text", "start": 0, "length": len(tokens), "grid": [], "attention": None}]
    unknown = [s["modality"] for s in segments if s["modality"] not in MODALITY_IDS]
    if unknown:
        raise ValueError(f"unknown segment modality {unknown[0]!r} (known: {', '.join(MODALITIES)})")
    grid = [list(s.get("grid") or []) + [0, 0, -1][len(s.get("grid") or []):] for s in segments]
    columns = _Segments(
        sample=np.zeros(len(segments), dtype=np.int64),
        modality=np.array([MODALITY_IDS[s["modality"]] for s in segments], dtype=np.int64),
        start=np.array([int(s["start"]) for s in segments], dtype=np.int64),
        length=np.array([int(s["length"]) for s in segments], dtype=np.int64),
        grid0=np.array([g[0] for g in grid], dtype=np.int64),
        grid1=np.array([g[1] for g in grid], dtype=np.int64),
        attention=np.array([ATTENTION_IDS[s["attention"]] if s.get("attention") else -1 for s in segments],
                           dtype=np.int64),
        time=np.array([g[2] for g in grid], dtype=np.int64))
    layout = _layout(tokens, np.array([0, len(tokens)], dtype=np.int64), columns, 1, group_size, audio_window)
    return layout.sample(0)


def layout_table(tokens: pa.Array | pa.ChunkedArray, segments: pa.Array | pa.ChunkedArray | None, group_size: int,
                 audio_window: int) -> Layout:
    """The shard contract's `tokens` (list<int32>) and `segments` (list<struct>, or None: all text)
    columns of N samples -> their `Layout`. A sample with no segments is one text segment."""
    tokens = _one_chunk(tokens)
    n = len(tokens)
    token_offsets = _list_offsets(tokens)
    flat = tokens.flatten().to_numpy(zero_copy_only=False)
    lengths = np.diff(token_offsets)
    if segments is None:
        columns = _all_text(lengths)
    else:
        segments = _one_chunk(segments)
        counts = np.diff(_list_offsets(segments))
        structs = segments.flatten()
        fields = dict(zip([f.name for f in structs.type], structs.flatten(), strict=True))
        modality = pc.index_in(fields["modality"], value_set=pa.array(MODALITIES))
        if modality.null_count:
            bad = fields["modality"].filter(pc.is_null(modality))[0].as_py()
            raise ValueError(f"unknown segment modality {bad!r} (known: {', '.join(MODALITIES)})")
        grid_offsets = _list_offsets(fields["grid"])
        grid_counts = np.diff(grid_offsets)
        grid_values = fields["grid"].flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        grid_values = np.r_[grid_values, 0, 0, 0]
        has2, has3 = grid_counts >= 2, grid_counts >= 3
        attention = pc.fill_null(pc.index_in(fields["attention"], value_set=pa.array(ATTENTION_KINDS)), -1)
        if pc.any(pc.and_(pc.is_valid(fields["attention"]), pc.equal(attention, -1))).as_py():
            raise ValueError(f"unknown segment attention (known: {', '.join(ATTENTION_KINDS)})")
        columns = _Segments(
            sample=np.repeat(np.arange(n, dtype=np.int64), counts),
            modality=modality.to_numpy(zero_copy_only=False).astype(np.int64),
            start=fields["start"].to_numpy(zero_copy_only=False).astype(np.int64),
            length=fields["length"].to_numpy(zero_copy_only=False).astype(np.int64),
            grid0=np.where(has2, grid_values[grid_offsets[:-1]], 0),
            grid1=np.where(has2, grid_values[grid_offsets[:-1] + 1], 0),
            attention=attention.to_numpy(zero_copy_only=False).astype(np.int64),
            time=np.where(has3, grid_values[grid_offsets[:-1] + 2], -1))
        if (counts == 0).any():  # samples without segments: one text segment over all their tokens
            columns = _merge(columns, _all_text(lengths, np.flatnonzero(counts == 0)))
    return _layout(flat.astype(np.int32, copy=False), token_offsets, columns, n, group_size, audio_window)


def layout_chunks(chunks: Sequence[tuple[pa.Array, pa.Array]], group_size: int, audio_window: int) -> Layout | None:
    """`layout_table` of the samples of (tokens, segments) chunk pairs, in order, read from their
    Arrow buffers: numpy views of them and one compiled call per chunk (`compiled.segment_columns`)
    in place of ~30 pyarrow and numpy calls for a window, each of which released the GIL and, in
    the read-ahead thread, waited to take it back from the packer's thread (bench/RESULTS.md).
    None unless every chunk is in the plain form shard writers give: the contract's types, no null
    but in `attention` (no null token either), every sample with a segment, known names, at least
    one sample (the caller then reads them with `layout_table`, which handles the rest and words
    the errors)."""
    tokens, token_offsets, views, n, at = [], [np.zeros(1, dtype=np.int64)], [], 0, 0
    for tc, sc in chunks:
        if tc.type != _TOKENS_TYPE or sc.type != _SEGMENTS_ARROW_TYPE or len(tc) != len(sc) or tc.null_count \
                or sc.null_count:
            return None
        if not len(tc):
            continue
        if tc.values.null_count:
            return None
        struct = sc.values
        if struct.null_count or struct.offset:
            return None
        mod, start, length, grid, att = (struct.field(i) for i in range(5))
        if mod.null_count or start.null_count or length.null_count or grid.null_count or grid.values.null_count:
            return None
        offsets = _offsets(tc)
        tokens.append(_values(tc.values, np.int32)[offsets[0] : offsets[-1]])
        token_offsets.append(offsets[1:] - offsets[0] + token_offsets[-1][-1])
        seg = _offsets(sc)
        views.append((n, seg, _offsets(mod), _bytes(mod), _values(start, np.int32), _values(length, np.int32),
                      _offsets(grid), _values(grid.values, np.int32), _bits(att), att.offset, _offsets(att),
                      _bytes(att)))
        n += len(tc)
        at += int(seg[-1] - seg[0])
    if not tokens:  # no sample at all
        return None
    columns = _Segments(*(np.empty(at, dtype=np.int64) for _ in range(8)))
    at = 0
    for view in views:
        written = C.segment_columns(*view, _NAMES, _NAME_OFFSETS, len(MODALITIES), at, columns.sample,
                                    columns.modality, columns.start, columns.length, columns.grid0, columns.grid1,
                                    columns.attention, columns.time)
        if written < 0:
            return None
        at += written
    flat = np.concatenate(tokens) if len(tokens) != 1 else tokens[0]
    return _layout(flat, np.concatenate(token_offsets), columns, n, group_size, audio_window)


_TOKENS_TYPE = pa.list_(pa.int32())
_SEGMENTS_ARROW_TYPE = pa.list_(SEGMENT_TYPE)
_NAMES = np.frombuffer("".join((*MODALITIES, *ATTENTION_KINDS)).encode(), dtype=np.uint8)
_NAME_OFFSETS = np.r_[0, np.cumsum([len(x.encode()) for x in (*MODALITIES, *ATTENTION_KINDS)])].astype(np.int64)


def _values(array: pa.Array, dtype) -> np.ndarray:
    """A primitive array's values (its slice), a view of its data buffer."""
    data = array.buffers()[1]
    if data is None:  # (an empty array may have none)
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype)[array.offset : array.offset + len(array)]


def _offsets(array: pa.Array) -> np.ndarray:
    """A list or string array's offsets (its slice: len + 1 of them, into its unsliced values), a view."""
    offsets = array.buffers()[1]
    if offsets is None:  # (an empty array may have none)
        return np.zeros(1, dtype=np.int32)
    return np.frombuffer(offsets, dtype=np.int32)[array.offset : array.offset + len(array) + 1]


def _bytes(array: pa.Array) -> np.ndarray:
    data = array.buffers()[2]
    return np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)


def _bits(array: pa.Array) -> np.ndarray:
    """An array's validity bitmap (from bit `array.offset`), empty when none of it is null."""
    bitmap = array.buffers()[0]
    return np.frombuffer(bitmap, dtype=np.uint8) if array.null_count and bitmap is not None else \
        np.zeros(0, dtype=np.uint8)


@dataclass
class _Segments:
    """Segment columns, grouped by sample in sample order (`sample` non-decreasing)."""

    sample: np.ndarray
    modality: np.ndarray
    start: np.ndarray
    length: np.ndarray
    grid0: np.ndarray  # h for images, frames for audio
    grid1: np.ndarray  # w for images, levels for audio
    attention: np.ndarray  # ATTENTION_IDS, -1: the modality's default
    time: np.ndarray  # ms of a timed (video) segment, -1: untimed


def _one_chunk(column):
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _list_offsets(array: pa.ListArray) -> np.ndarray:
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.r_[0, np.cumsum(lengths)]


def _all_text(lengths: np.ndarray, which: np.ndarray | None = None) -> _Segments:
    which = np.arange(len(lengths), dtype=np.int64) if which is None else which
    zeros = np.zeros(len(which), dtype=np.int64)
    return _Segments(which, np.full(len(which), TEXT), zeros, lengths[which].astype(np.int64), zeros, zeros,
                     np.full(len(which), -1), np.full(len(which), -1))


def _merge(a: _Segments, b: _Segments) -> _Segments:
    order = np.argsort(np.r_[a.sample, b.sample], kind="stable")
    return _Segments(*(np.r_[getattr(a, k), getattr(b, k)][order] for k in _Segments.__dataclass_fields__))


def _layout(tokens: np.ndarray, token_offsets: np.ndarray, seg: _Segments, n: int, group_size: int,
            audio_window: int) -> Layout:
    error, k, table, sample_segments, offsets, ends_row, media_offsets, media = C.segment_table(
        seg.sample, seg.modality, seg.start, seg.length, seg.grid0, seg.grid1, seg.attention, seg.time,
        token_offsets, n, group_size, audio_window, _DEFAULT_ATTENTION, TIME_TICK_MS, WINDOW)
    if error:
        _raise(error, k, seg, group_size, np.diff(token_offsets))
    return Layout(table, sample_segments, offsets, ends_row, media_offsets, media, tokens, token_offsets,
                  group_size=group_size)


def _raise(error: int, k: int, seg: _Segments, group_size: int, sample_lengths: np.ndarray) -> None:
    """The error of `compiled.segment_table`'s failed check `error` at segment k, in words."""
    if error == 1:  # the compiled layout reads tokens without bounds checks: every segment must lie in its sample
        raise ValueError(f"segment [{int(seg.start[k])}, {int(seg.start[k] + seg.length[k])}) grid "
                         f"{[int(seg.grid0[k]), int(seg.grid1[k])]} lies outside its sample's "
                         f"{int(sample_lengths[seg.sample[k]])} tokens")
    if error == 2:
        raise ValueError(f"audio segment grid {[int(seg.grid0[k]), int(seg.grid1[k])]} does not match its length "
                         f"{int(seg.length[k])}")
    if error == 3:
        levels = int(seg.grid1[seg.modality == AUDIO].max())
        raise ValueError(f"audio frames of {levels} levels do not fit groups of {group_size}; "
                         "set stream.group_size from the vocabulary manifest")
    raise ValueError(f"image segment grid {[int(seg.grid0[k]), int(seg.grid1[k])]} does not match its length "
                     f"{int(seg.length[k])}")
