"""Samples as positions, many at once: the stream's layout rules as whole-array operations.

Why whole arrays. The stream reads a window of Parquet files and lays out every sample of it
(ids grouped per position, targets, rotary coordinates, segments, attention); done one sample
at a time in Python, that cost ~30x what reading the files costs. Here a window's segments come
out of Arrow as columns, and every rule is an `np.repeat`/`cumsum`/mask over all positions of
all samples, so the cost per position is a few array passes whatever the sample mix.

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

`Layout` holds the flat arrays of N samples and their offsets; `Layout.sample(i)` is one sample
as `Positions` (views, no copy). `layout_table` builds one from the shard contract's Arrow
columns, `sample_positions` from one sample's tokens and segment dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tokenloom.contract import (
    ATTENTION_IDS,
    ATTENTION_KINDS,
    DEFAULT_ATTENTION,
    IGNORE_INDEX,
    MODALITIES,
    MODALITY_IDS,
    SPECIAL_TOKENS,
    TIME_TICK_MS,
)

__all__ = ["ROW_ID", "Layout", "Positions", "sample_positions", "layout_table"]

ROW_ID = SPECIAL_TOKENS.index("<row>")  # the input id of an image's learned start row
TEXT, IMAGE, AUDIO = MODALITY_IDS["text"], MODALITY_IDS["image"], MODALITY_IDS["audio"]
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
    """N samples' positions, flat: sample i holds positions [offsets[i], offsets[i + 1])."""

    ids: np.ndarray  # [P, G]
    labels: np.ndarray  # [P, G]
    modality: np.ndarray  # [P]
    target: np.ndarray  # [P]
    coords: np.ndarray  # [P, 3]
    segment: np.ndarray  # [P]
    attention: np.ndarray  # [P]
    window: np.ndarray  # [P]
    offsets: np.ndarray  # [N + 1]
    ends_row: np.ndarray  # [N] bool
    media_offsets: np.ndarray  # [N + 1]: sample i's media segments are rows [media_offsets[i], media_offsets[i+1])
    media: np.ndarray  # [M, 2] sample-local [start, stop) of every image/audio segment
    tokens: np.ndarray  # the samples' flat tokens (int32)
    token_offsets: np.ndarray  # [N + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def media_of(self, i: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.media[self.media_offsets[i] : self.media_offsets[i + 1]]]

    def sample_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.token_offsets[i] : self.token_offsets[i + 1]]

    def sample(self, i: int) -> Positions:
        s = slice(int(self.offsets[i]), int(self.offsets[i + 1]))
        return Positions(self.ids[s], self.modality[s], self.coords[s], self.segment[s], self.attention[s],
                         self.window[s], bool(self.ends_row[i]), self.labels[s], self.target[s], self.media_of(i))


def sample_positions(tokens: np.ndarray, segments: Sequence[dict] | None, group_size: int,
                  audio_window: int) -> Positions:
    """One sample's flat tokens and segment dicts -> its positions and targets."""
    tokens = np.asarray(tokens)
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


def _excl_cumsum_within(values: np.ndarray, first_of_group: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Exclusive running sum of `values`, restarting at each group's first element."""
    total = np.cumsum(values) - values
    return total - total[first_of_group][group]


def _layout(tokens: np.ndarray, token_offsets: np.ndarray, seg: _Segments, n: int, group_size: int,
            audio_window: int) -> Layout:
    G = group_size
    mod, length, h, w = seg.modality, seg.length, seg.grid0, seg.grid1
    image, audio = mod == IMAGE, mod == AUDIO
    _check(seg, image, audio, G)
    S = len(mod)
    counts = np.bincount(seg.sample, minlength=n)
    first_seg = np.r_[0, np.cumsum(counts)][:-1]  # each sample's first segment
    last_seg = first_seg + counts - 1
    # positions, coordinate advance and segment indices each segment takes
    npos = np.where(image, (h + 1) * w, np.where(audio, h, length))
    advance = np.where(image, np.maximum(h + 1, w), npos)
    tick, advance = _video_clock(seg, image, npos, advance)
    segs_taken = np.where(image, h + 1, 1)
    p0 = _excl_cumsum_within(advance, first_seg, seg.sample)
    seg0 = _excl_cumsum_within(segs_taken, first_seg, seg.sample)
    attention = np.where(seg.attention >= 0, seg.attention, _DEFAULT_ATTENTION[mod])
    window = np.where(attention == WINDOW, audio_window, 0)
    seg_pos = np.r_[0, np.cumsum(npos)]
    offsets = np.r_[0, np.cumsum(np.bincount(seg.sample, weights=npos, minlength=n))].astype(np.int64)
    P = int(seg_pos[-1])
    # per position
    pseg = np.repeat(np.arange(S), npos)
    j = np.arange(P, dtype=np.int64) - seg_pos[:-1][pseg]
    p_image, p_audio = image[pseg], audio[pseg]
    p_w = np.maximum(w, 1)[pseg]
    tok0 = (token_offsets[seg.sample] + seg.start)[pseg]  # where each position's segment starts in `tokens`
    levels = np.where(audio, w, 1)[pseg]
    r, c = np.divmod(j, p_w)
    code = np.where(p_image, j - p_w, j * levels)  # the segment-relative token of slot 0
    start_row = p_image & (j < p_w)
    ids = np.full((P, G), -1, dtype=np.int64)
    ids[:, 0] = np.where(start_row, ROW_ID, tokens[np.where(start_row, tok0, tok0 + code)])
    for slot in range(1, G):
        has = p_audio & (levels > slot)
        ids[has, slot] = tokens[tok0[has] + code[has] + slot]
    modality = mod[pseg]
    base = p0[pseg]
    t = base + tick[pseg] + np.where(p_image, 0, j)
    coords = np.stack([t, np.where(p_image, base + r, t), np.where(p_image, base + c, t)], axis=1)
    segment = seg0[pseg] + np.where(p_image, r, 0)
    # targets: the next position's group within the sample
    labels = np.full((P, G), IGNORE_INDEX, dtype=np.int64)
    target = np.full(P, -1, dtype=np.int64)
    labels[:-1], target[:-1] = ids[1:], modality[1:]
    given = np.zeros(P, dtype=bool)
    given[:-1] = ids[1:, 0] == ROW_ID  # the next position is a start row: it is given
    nonempty = offsets[1:] > offsets[:-1]
    last = np.zeros(P, dtype=bool)
    last[offsets[1:][nonempty] - 1] = True
    off = given | last
    labels[off], target[off] = IGNORE_INDEX, -1
    p_h = h[pseg]
    predicts_row = p_image & (j < p_h * p_w)  # the start row and rows 0..h-2: the next row's code in column c
    labels[predicts_row] = IGNORE_INDEX
    labels[predicts_row, 0] = tokens[tok0[predicts_row] + j[predicts_row]]
    target[predicts_row] = IMAGE
    last_row = p_image & (j >= p_h * p_w) & (j < (p_h + 1) * p_w - 1)
    labels[last_row], target[last_row] = IGNORE_INDEX, -1
    labels[labels < 0] = IGNORE_INDEX
    # per sample: a windowed segment followed by more of the sample; media segments
    closes = (window > 0) & (npos > window) & (np.arange(S) < last_seg[seg.sample])
    ends_row = np.bincount(seg.sample[closes], minlength=n) > 0
    is_media = image | audio
    local = seg_pos[:-1] - offsets[seg.sample]
    media = np.stack([local[is_media], local[is_media] + npos[is_media]], axis=1)
    media_offsets = np.r_[0, np.cumsum(np.bincount(seg.sample[is_media], minlength=n))]
    return Layout(ids, labels, modality, target, coords, segment, attention[pseg], window[pseg], offsets, ends_row,
                  media_offsets, media, tokens, token_offsets)


def _video_clock(seg: _Segments, image: np.ndarray, npos: np.ndarray, advance: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each segment's tick on its video's clock (0 when untimed) and the coordinate advance with
    videos folded in: a run of timed segments of one sample is one video, all at its first
    position; its last segment advances past the video's largest coordinate, the others by 0."""
    timed = seg.time >= 0
    if not timed.any():
        return np.zeros(len(timed), dtype=np.int64), advance
    tick = np.where(timed, seg.time // TIME_TICK_MS, 0)
    same = seg.sample[1:] == seg.sample[:-1]
    prev_timed = np.r_[False, timed[:-1] & same]
    next_timed = np.r_[timed[1:] & same, False]
    video = np.cumsum(timed & ~prev_timed) - 1  # the video of each timed segment
    # one past the segment's largest coordinate offset: a frame's rows r <= h and columns c < w at its
    # tick, audio frames at tick + j
    extent = np.where(image, np.maximum(tick, np.maximum(seg.grid0, seg.grid1 - 1)), tick + npos - 1) + 1
    span = np.zeros(int(video[timed].max()) + 1, dtype=np.int64)
    np.maximum.at(span, video[timed], extent[timed])
    advance = np.where(timed, np.where(next_timed, 0, span[np.maximum(video, 0)]), advance)
    return tick, advance


def _check(seg: _Segments, image: np.ndarray, audio: np.ndarray, group_size: int) -> None:
    bad_audio = audio & (seg.grid0 * seg.grid1 != seg.length)
    if bad_audio.any():
        k = int(np.flatnonzero(bad_audio)[0])
        raise ValueError(f"audio segment grid {[int(seg.grid0[k]), int(seg.grid1[k])]} does not match its length "
                         f"{int(seg.length[k])}")
    if (audio & (seg.grid1 > group_size)).any():
        levels = int(seg.grid1[audio].max())
        raise ValueError(f"audio frames of {levels} levels do not fit groups of {group_size}; "
                         "set stream.group_size from the vocabulary manifest")
    bad_image = image & (seg.grid0 * seg.grid1 != seg.length)
    if bad_image.any():
        k = int(np.flatnonzero(bad_image)[0])
        raise ValueError(f"image segment grid {[int(seg.grid0[k]), int(seg.grid1[k])]} does not match its length "
                         f"{int(seg.length[k])}")
