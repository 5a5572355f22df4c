"""Token streams: a snapshot's shards read in a seeded order, split by rank, packed as groups.

Order. For epoch e, the data files are permuted with a generator seeded by (seed, e); the
files are taken in windows of `shuffle_window` and the samples of each window are permuted
again. This fixes one global sample order per (snapshot, seed, epoch), whatever the number
of readers; rank r of W takes global samples r, r+W, r+2W, ... With `holdout` > 0 a fixed
fraction of the samples (a hash of file name and row) forms the validation split and the
training split skips them.

Groups. A sample's flat tokens are read through its segments into *positions*: a text or image
token is one position, an audio frame (L codes, one per RVQ level, stored frame-major) is one
position holding a group of L ids (ARCHITECTURE.md, "Groups"). Rows carry `ids` [P, G] with G
= `group_size` slots (unused slots -1), and per position its modality, rotary coordinates
(t, h, w), document, segment and attention kind. Coordinates restart per sample: text and audio
advance t = h = w by one per position.

Images, one row group at a time (ARCHITECTURE.md, "No target is visible..."). An h x w image
becomes a learned start row (w `<row>` positions) followed by its h rows, each row its own
bidirectional segment: a position sees its own row and everything before it, never a later
row. Positions of the start row predict row 0, those of row r predict row r + 1 (same column),
and the last position of the last row predicts what follows the image. Begun at p, the start
row sits at (p, p, p + c), row r at (p, p + r + 1, p + c), and the text after the image
continues at p + max(h + 1, w), so the grid is kept (M-RoPE, as in Qwen2-VL).

Targets. Every other position predicts the whole group at the next position of its sample
(-100 across samples and for the given start rows); `target_modality` names the modality of
each target, so losses are counted per predicted modality.

Packing (`datasets/packing.py`). A rank's samples are cut into pieces only outside their image
and audio segments and packed best-fit from a window of the next `pack_window` pieces, so no
media segment ever crosses a row; a sample whose media segment alone exceeds a row is skipped
and counted. An audio sample whose windowed frames are followed by its transcript is the last
document of its row (FlashMask's two intervals per column), as before. `batches` yields each
row's fill ratio (non-padding positions / `seq_len`) as `fill_ratio` [B] beside the row keys.

State. `StreamState` is the next sample to pull (epoch, rank-local cursor), the pieces pulled
but not yet packed (each named by epoch, cursor and position range, in window order) and the
count of skipped samples. The window is rebuilt from it on resume, so a stream saved after N
rows and resumed yields exactly the rows an uninterrupted stream yields.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from tokenloom.catalog.uris import filesystem_and_path
from tokenloom.contract import (
    ATTENTION_IDS,
    DEFAULT_ATTENTION,
    IGNORE_INDEX,
    MODALITY_IDS,
    ROW_KEYS,
    SPECIAL_TOKENS,
)
from tokenloom.datasets.packing import PAD_ID, assemble, choose_row, fill_ratio, pack_row, split_points

__all__ = ["PAD_ID", "ROW_ID", "EpochOrder", "PendingPiece", "Positions", "ShardFile", "SourceSpec", "StreamConfig",
           "StreamExhausted", "StreamState", "TokenStream", "held_out", "pack_row", "sample_positions"]

ROW_ID = SPECIAL_TOKENS.index("<row>")  # the input id of an image's learned start row


class NoSampleFits(ValueError):
    """Every sample a rank streams has a media segment longer than a row."""


class StreamExhausted(Exception):
    """A stream of a fixed number of passes (`TokenStream(passes=N)`) has yielded its last row."""


@dataclass(frozen=True)
class ShardFile:
    path: str  # URI or local path of a Parquet data file
    num_rows: int


@dataclass
class SourceSpec:
    """One dataset of a training mixture (`[[stream.sources]]`): its name, weight and snapshot."""

    dataset: str = ""
    weight: float = 1.0
    at: str = ""  # a snapshot id or tag; empty: the current snapshot (and, with --follow, later ones)


@dataclass
class StreamConfig:
    seq_len: int = 256  # positions per row (an audio frame is one position)
    seed: int = 0
    shuffle_window: int = 4  # files whose samples are shuffled together
    group_size: int = 0  # id slots per position; 0: the manifest's audio levels (1 without audio)
    audio_window: int = 64  # frames an audio position attends to within its segment
    holdout: float = 0.0  # fraction of samples set aside for validation (a fixed hash of file and row)
    split: str = "train"  # "train" (samples not held out) or "val" (the held-out ones)
    pack_window: int = 128  # pending pieces (in stream order) that best-fit packing chooses from
    # canonical readers (datasets/loader.py): they fix the row order whatever the number of ranks,
    # which must divide them; a run resumes on any such number of ranks
    readers: int = 4
    sources: list[SourceSpec] = field(default_factory=list)  # a mixture; empty: the dataset trained on


@dataclass(frozen=True)
class PendingPiece:
    """A piece pulled into the packing window and not yet packed: positions [start, stop) of a
    rank-local sample."""

    epoch: int
    cursor: int
    start: int
    stop: int


@dataclass
class StreamState:
    epoch: int = 0
    cursor: int = 0  # the next rank-local sample (within the epoch) to pull into the packing window
    pending: tuple[PendingPiece, ...] = ()  # the packing window, in stream order
    skipped: int = 0  # samples skipped so far because a media segment is longer than a row

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "skipped": self.skipped,
                "pending": [[p.epoch, p.cursor, p.start, p.stop] for p in self.pending]}

    @staticmethod
    def from_dict(d: dict) -> StreamState:
        if "pending" not in d:
            raise ValueError(f"stream state {d} was written by the concatenate-and-chunk packer (it has no packing "
                             "window); it cannot be resumed exactly by the best-fit packer: start the run afresh")
        pending = tuple(PendingPiece(*(int(x) for x in p)) for p in d["pending"])
        return StreamState(int(d["epoch"]), int(d["cursor"]), pending, int(d.get("skipped", 0)))


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


def sample_positions(tokens: np.ndarray, segments: list[dict] | None, group_size: int, audio_window: int) -> Positions:
    """A sample's flat tokens and segments -> positions and their targets (see the module docstring)."""
    if not segments:
        segments = [{"modality": "text", "start": 0, "length": len(tokens), "grid": [], "attention": None}]
    ids, modality, coords, segment, attention, window = [], [], [], [], [], []
    image_targets: list[tuple[int, np.ndarray, int]] = []  # (first position, codes in raster order, width)
    media: list[tuple[int, int]] = []
    p, ends_row, seg_no, n_pos = 0, False, 0, 0
    for k, seg in enumerate(segments):
        kind_name = seg.get("attention") or DEFAULT_ATTENTION[seg["modality"]]
        start, length = int(seg["start"]), int(seg["length"])
        toks = tokens[start : start + length].astype(np.int64)
        mod = seg["modality"]
        seg_col = None
        if mod == "audio":
            frames, levels = (int(x) for x in seg["grid"])
            if frames * levels != length:
                raise ValueError(f"audio segment grid {seg['grid']} does not match its length {length}")
            if levels > group_size:
                raise ValueError(f"audio frames of {levels} levels do not fit groups of {group_size}; "
                                 "set stream.group_size from the vocabulary manifest")
            group = np.full((frames, group_size), -1, dtype=np.int64)
            group[:, :levels] = toks.reshape(frames, levels)
            t = p + np.arange(frames)
            xyz = np.stack([t, t, t], axis=1)
            n = frames
            p += frames
        elif mod == "image":
            # a learned start row (w <row> positions), then the h rows; each row is its own
            # segment, so attention is bidirectional within a row and causal across rows
            h, w = (int(x) for x in seg["grid"])
            if h * w != length:
                raise ValueError(f"image segment grid {seg['grid']} does not match its length {length}")
            n = (h + 1) * w
            group = np.full((n, group_size), -1, dtype=np.int64)
            group[:w, 0] = ROW_ID
            group[w:, 0] = toks
            r, c = np.divmod(np.arange(n), w)  # r = 0 is the start row, r = i + 1 the image's row i
            xyz = np.stack([np.full(n, p), p + r, p + c], axis=1)
            seg_col = seg_no + r
            image_targets.append((n_pos, toks, w))
            p += max(h + 1, w)
        else:
            group = np.full((length, group_size), -1, dtype=np.int64)
            group[:, 0] = toks
            t = p + np.arange(length)
            xyz = np.stack([t, t, t], axis=1)
            n = length
            p += length
        win = audio_window if kind_name == "window" else 0
        if win and n > win and k < len(segments) - 1:
            ends_row = True
        ids.append(group)
        modality.append(np.full(n, MODALITY_IDS[mod]))
        coords.append(xyz)
        segment.append(np.full(n, seg_no) if seg_col is None else seg_col)
        seg_no = int(segment[-1][-1]) + 1
        attention.append(np.full(n, ATTENTION_IDS[kind_name]))
        window.append(np.full(n, win))
        if mod in ("image", "audio"):
            media.append((n_pos, n_pos + n))
        n_pos += n
    ids_all, mod_all = np.concatenate(ids), np.concatenate(modality)
    labels, target = _targets(ids_all, mod_all, image_targets)
    return Positions(ids_all, mod_all, np.concatenate(coords).astype(np.int64), np.concatenate(segment),
                     np.concatenate(attention), np.concatenate(window), ends_row, labels, target, media)


def _targets(ids: np.ndarray, modality: np.ndarray, images: list[tuple[int, np.ndarray, int]]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Each position's target group and its modality.

    Text and audio: the next position's group (audio: a frame's L codes). No position predicts an
    image's start row (it is given). In an image, the w positions of the start row predict row 0
    and those of row r predict row r + 1, column by column; the last row predicts nothing except
    at its last position, which predicts what follows the image (its `<eoi>`). So no target is
    visible to the position that predicts it: rows see only themselves and the rows above."""
    P, G = ids.shape
    labels = np.full((P, G), IGNORE_INDEX, dtype=np.int64)
    target = np.full(P, -1, dtype=np.int64)
    labels[:-1] = ids[1:]
    target[:-1] = modality[1:]
    given = np.r_[ids[1:, 0] == ROW_ID, False]  # predicting a start row position
    labels[given], target[given] = IGNORE_INDEX, -1
    for first, codes, w in images:
        n = len(codes)
        labels[first : first + n] = IGNORE_INDEX
        labels[first : first + n, 0] = codes
        target[first : first + n] = MODALITY_IDS["image"]
        last_row = slice(first + n, first + n + w - 1)  # all of the last row but its last position
        labels[last_row], target[last_row] = IGNORE_INDEX, -1
    labels[labels < 0] = IGNORE_INDEX
    return labels, target


def _read_samples(path: str) -> list[tuple[np.ndarray, list[dict] | None]]:
    filesystem, inner = filesystem_and_path(path)
    try:
        schema = pq.read_schema(inner, filesystem=filesystem)
        columns = ["tokens", "segments"] if "segments" in schema.names else ["tokens"]
        table = pq.read_table(inner, columns=columns, filesystem=filesystem)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read token shard {path}: {exc}") from exc
    col = table.column("tokens").combine_chunks()
    offsets = col.offsets.to_numpy()
    flat = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    segments = table.column("segments").to_pylist() if "segments" in columns else [None] * len(col)
    return [(flat[offsets[i] : offsets[i + 1]], segments[i]) for i in range(len(col))]


def held_out(file: ShardFile, fraction: float) -> np.ndarray:
    """Which rows of a file belong to the validation split: a fixed function of the file's name and
    the row, so the split never changes with seeds, epochs or the number of ranks."""
    if fraction <= 0:
        return np.zeros(file.num_rows, dtype=bool)
    key = zlib.crc32(file.path.rsplit("/", 1)[-1].encode())
    return np.random.default_rng([key, 7919]).random(file.num_rows) < fraction


class EpochOrder:
    """The global sample order of one epoch, as windows of (file, row) pairs of one split."""

    def __init__(self, files: Sequence[ShardFile], seed: int, epoch: int, window: int, holdout: float = 0.0,
                 split: str = "train"):
        rng = np.random.default_rng([seed, epoch])
        self.files = [files[i] for i in rng.permutation(len(files))]
        self.windows: list[tuple[list[int], np.ndarray]] = []  # (file indices, rows of the window in order)
        self.window_starts: list[int] = []
        start = 0
        for w0 in range(0, len(self.files), window):
            members = list(range(w0, min(w0 + window, len(self.files))))
            mask = np.concatenate([held_out(self.files[i], holdout) for i in members])
            rows = np.flatnonzero(mask if split == "val" else ~mask)
            self.windows.append((members, rows[rng.permutation(len(rows))]))
            self.window_starts.append(start)
            start += len(rows)
        self.total = start


class TokenStream:
    """An endless iterator of packed rows for one data-parallel rank."""

    def __init__(self, files: Sequence[ShardFile], config: StreamConfig, rank: int = 0, world_size: int = 1,
                 state: StreamState | None = None, passes: int = 0):
        """`passes`: 0 for an endless stream (epoch after epoch); N > 0 reads the split N times and
        then raises `StreamExhausted` (a rank may then have no sample at all: it is exhausted at once)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if passes < 0:
            raise ValueError(f"passes must be >= 0 (0: endless), got {passes}")
        self.passes = passes
        files = [f for f in files if f.num_rows > 0]
        if not files and not passes:
            raise ValueError("the snapshot has no samples to stream")
        if not passes and sum(f.num_rows for f in files) < world_size:
            raise ValueError(f"{sum(f.num_rows for f in files)} samples cannot feed {world_size} ranks")
        if config.split not in ("train", "val") or not 0.0 <= config.holdout < 1.0:
            raise ValueError(f"stream.split must be train or val and stream.holdout in [0, 1), got "
                             f"{config.split!r}, {config.holdout}")
        if config.split == "val" and config.holdout <= 0:
            raise ValueError("the validation split needs stream.holdout > 0")
        if config.seq_len < 2:
            raise ValueError(f"stream.seq_len must be at least 2, got {config.seq_len}")
        self.files, self.config, self.rank, self.world = list(files), config, rank, world_size
        self.group_size = max(1, config.group_size)
        if config.pack_window < 1:
            raise ValueError(f"stream.pack_window must be at least 1, got {config.pack_window}")
        self._order: EpochOrder | None = None
        self._cache: dict[int, list] = {}  # window index -> samples in window order
        self._window: list[tuple[PendingPiece, Positions]] = []  # the packing window (`StreamState.pending`)
        self._epoch = self._cursor = self._skipped = 0
        self._warned = False  # one warning per stream about skipped samples; the count says the rest
        self.state = state or StreamState()

    # -- sample access ------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order = EpochOrder(self.files, self.config.seed, epoch, self.config.shuffle_window,
                                     self.config.holdout, self.config.split)
            if self._order.total < self.world and not self.passes:
                raise ValueError(f"the {self.config.split} split has {self._order.total} samples, too few for "
                                 f"{self.world} ranks")
            self._order_epoch = epoch
            self._cache.clear()
        return self._order

    def samples_per_epoch(self, epoch: int = 0) -> int:
        total = self._epoch_order(epoch).total
        return (total - self.rank + self.world - 1) // self.world

    def _raw(self, epoch: int, cursor: int) -> list:
        order = self._epoch_order(epoch)
        global_index = cursor * self.world + self.rank
        w = int(np.searchsorted(order.window_starts, global_index, side="right") - 1)
        if w not in self._cache:
            self._cache.clear()  # one window in memory at a time
            members, perm = order.windows[w]
            samples = [s for i in members for s in _read_samples(order.files[i].path)]
            self._cache[w] = [[samples[j], None] for j in perm]
        return self._cache[w][global_index - order.window_starts[w]]

    def _sample(self, epoch: int, cursor: int) -> np.ndarray:
        """The flat tokens of a rank-local sample."""
        return self._raw(epoch, cursor)[0][0]

    def _positions(self, epoch: int, cursor: int) -> Positions:
        entry = self._raw(epoch, cursor)
        if entry[1] is None:
            tokens, segments = entry[0]
            entry[1] = sample_positions(tokens, segments, self.group_size, self.config.audio_window)
        return entry[1]

    # -- packing --------------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        """No sample is left to pull (only ever true for a stream of a fixed number of passes)."""
        if not self.passes:
            return False
        while self._epoch < self.passes and self._cursor >= self.samples_per_epoch(self._epoch):
            self._epoch, self._cursor = self._epoch + 1, 0
        return self._epoch >= self.passes

    def _pull(self) -> None:
        """Move the next sample into the packing window, as pieces (or skip it, counted)."""
        if self.exhausted:
            return
        while self._cursor >= self.samples_per_epoch(self._epoch):
            self._epoch, self._cursor = self._epoch + 1, 0
        at, self._cursor = PendingPiece(self._epoch, self._cursor, 0, 0), self._cursor + 1
        s = self._positions(at.epoch, at.cursor)
        points = split_points(s, self.config.seq_len)
        if points is None:
            self._skipped += 1
            longest = max(b - a for a, b in s.media)
            if not self._warned:
                warnings.warn(f"a sample (epoch {at.epoch}, rank {self.rank} sample {at.cursor}) has a media segment "
                              f"of {longest} positions, longer than stream.seq_len {self.config.seq_len}: media is "
                              f"never split across rows, so such samples are skipped and counted in the stream "
                              f"state's `skipped`; set stream.seq_len to at least {longest} to keep them", stacklevel=3)
                self._warned = True
            return
        for a, b in zip(points[:-1], points[1:], strict=True):
            self._window.append((PendingPiece(at.epoch, at.cursor, a, b), s))

    def next_row(self) -> dict[str, np.ndarray]:
        """The next packed row (see `datasets/packing.py`)."""
        in_a_row = 0  # samples pulled in a row that gave no piece
        while len(self._window) < self.config.pack_window and not self.exhausted:
            before = len(self._window)
            self._pull()
            in_a_row = 0 if len(self._window) > before else in_a_row + 1
            if in_a_row > self.samples_per_epoch(self._epoch) and not self._window:
                raise NoSampleFits(f"no sample of rank {self.rank} fits a row of stream.seq_len "
                                 f"{self.config.seq_len} (each has a media segment longer than that): raise seq_len")
        if not self._window:
            raise StreamExhausted(f"rank {self.rank} has read its {self.passes} pass(es)")
        chosen = choose_row([p.stop - p.start for p, _ in self._window],
                            [s.ends_row for _, s in self._window], self.config.seq_len)
        pieces = [(self._window[k][1], slice(self._window[k][0].start, self._window[k][0].stop)) for k in chosen]
        taken = set(chosen)
        self._window = [w for k, w in enumerate(self._window) if k not in taken]
        return assemble(pieces, self.config.seq_len, self.group_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield self.next_row()

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Batches of rows [B, ...] under the row keys, plus `fill_ratio` [B] float64: each row's
        non-padding share, whose mean is the batch's fill ratio."""
        while True:
            rows = [self.next_row() for _ in range(batch_size)]
            batch = {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}
            batch["fill_ratio"] = fill_ratio(batch["modality"])
            yield batch

    @property
    def state(self) -> StreamState:
        return StreamState(self._epoch, self._cursor, tuple(p for p, _ in self._window), self._skipped)

    @state.setter
    def state(self, state: StreamState) -> None:
        window = []
        for p in state.pending:
            s = self._positions(p.epoch, p.cursor)
            if not 0 <= p.start < p.stop <= len(s):
                raise ValueError(f"stream state names positions [{p.start}, {p.stop}) of a sample of {len(s)}: "
                                 "it was saved for other data or stream settings")
            window.append((p, s))
        self._epoch, self._cursor, self._skipped, self._window = state.epoch, state.cursor, state.skipped, window

    def state_dict(self) -> dict:
        return self.state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state = StreamState.from_dict(state)
