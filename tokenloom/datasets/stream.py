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

Packing. A rank's samples are concatenated and cut into rows of `seq_len` positions.
FlashMask expresses each key column's masked rows with at most two
intervals; a windowed audio segment that is followed by more of its own sample (its
transcript) needs three when another sample follows it in the row. Such a sample therefore
ends its row: the rest of the row is padding (modality 3, no targets), a causal segment of
that last sample, so its document reaches the row's end and the mask stays within two intervals.

State. `StreamState(epoch, cursor, offset)` is the position of the next row's first position:
the rank-local sample index inside the epoch and the position offset inside that sample. It
is three integers, so saving and resuming is exact and costs nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow.parquet as pq

from tokenloom.catalog.uris import filesystem_and_path
from tokenloom.contract import (
    ATTENTION_IDS,
    DEFAULT_ATTENTION,
    IGNORE_INDEX,
    MODALITY_IDS,
    PAD_MODALITY,
    ROW_KEYS,
    SPECIAL_TOKENS,
)

PAD_ID = SPECIAL_TOKENS.index("<pad>")  # the input id of padding positions (no target uses them)
ROW_ID = SPECIAL_TOKENS.index("<row>")  # the input id of an image's learned start row


@dataclass(frozen=True)
class ShardFile:
    path: str  # URI or local path of a Parquet data file
    num_rows: int


@dataclass
class StreamConfig:
    seq_len: int = 256  # positions per row (an audio frame is one position)
    seed: int = 0
    shuffle_window: int = 4  # files whose samples are shuffled together
    group_size: int = 0  # id slots per position; 0: the manifest's audio levels (1 without audio)
    audio_window: int = 64  # frames an audio position attends to within its segment
    holdout: float = 0.0  # fraction of samples set aside for validation (a fixed hash of file and row)
    split: str = "train"  # "train" (samples not held out) or "val" (the held-out ones)


@dataclass
class StreamState:
    epoch: int = 0
    cursor: int = 0  # rank-local sample index within the epoch
    offset: int = 0  # position offset within that sample

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> StreamState:
        return StreamState(int(d["epoch"]), int(d["cursor"]), int(d["offset"]))


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

    def __len__(self) -> int:
        return len(self.modality)


def sample_positions(tokens: np.ndarray, segments: list[dict] | None, group_size: int, audio_window: int) -> Positions:
    """A sample's flat tokens and segments -> positions and their targets (see the module docstring)."""
    if not segments:
        segments = [{"modality": "text", "start": 0, "length": len(tokens), "grid": [], "attention": None}]
    ids, modality, coords, segment, attention, window = [], [], [], [], [], []
    image_targets: list[tuple[int, np.ndarray, int]] = []  # (first position, codes in raster order, width)
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
        n_pos += n
    ids_all, mod_all = np.concatenate(ids), np.concatenate(modality)
    labels, target = _targets(ids_all, mod_all, image_targets)
    return Positions(ids_all, mod_all, np.concatenate(coords).astype(np.int64), np.concatenate(segment),
                     np.concatenate(attention), np.concatenate(window), ends_row, labels, target)


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


def pack_row(samples: Sequence[Positions], seq_len: int) -> dict[str, np.ndarray]:
    """Whole samples, in order, as one row of `seq_len` positions (padded; raises if they do not fit)."""
    used = sum(len(s) for s in samples)
    if used > seq_len:
        raise ValueError(f"{used} positions do not fit a row of {seq_len}")
    group = samples[0].ids.shape[1]
    return TokenStream._assemble([(s, slice(0, len(s)), d) for d, s in enumerate(samples)], seq_len, group)


class TokenStream:
    """An endless iterator of packed rows for one data-parallel rank."""

    def __init__(self, files: Sequence[ShardFile], config: StreamConfig, rank: int = 0, world_size: int = 1,
                 state: StreamState | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        files = [f for f in files if f.num_rows > 0]
        if not files:
            raise ValueError("the snapshot has no samples to stream")
        if sum(f.num_rows for f in files) < world_size:
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
        self.state = state or StreamState()
        self._order: EpochOrder | None = None
        self._cache: dict[int, list] = {}  # window index -> samples in window order

    # -- sample access ------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order = EpochOrder(self.files, self.config.seed, epoch, self.config.shuffle_window,
                                     self.config.holdout, self.config.split)
            if self._order.total < self.world:
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
    def next_row(self) -> dict[str, np.ndarray]:
        L, G = self.config.seq_len, self.group_size
        pieces: list[tuple[Positions, slice, int]] = []
        epoch, cursor, offset = self.state.epoch, self.state.cursor, self.state.offset
        taken, doc, after = 0, 0, None
        while taken < L + 1:  # L inputs plus the group that is the last input's target
            if cursor >= self.samples_per_epoch(epoch):
                epoch, cursor, offset = epoch + 1, 0, 0
                continue
            s = self._positions(epoch, cursor)
            if after is None and taken + len(s) - offset >= L:
                at = offset + L - taken
                after = StreamState(epoch, cursor, at) if at < len(s) else StreamState(epoch, cursor + 1, 0)
            stop = min(len(s), offset + L + 1 - taken)
            pieces.append((s, slice(offset, stop), doc))
            taken += stop - offset
            offset = stop
            if offset >= len(s):
                cursor, offset, doc = cursor + 1, 0, doc + 1
                if s.ends_row and taken < L:  # no other sample may follow this one in the row
                    after = StreamState(epoch, cursor, 0)
                    break
        self.state = after
        return self._assemble(pieces, L, G)

    @staticmethod
    def _assemble(pieces: list[tuple[Positions, slice, int]], L: int, G: int) -> dict[str, np.ndarray]:
        ids = np.concatenate([s.ids[sl] for s, sl, _ in pieces])
        docs = np.concatenate([np.full(sl.stop - sl.start, d) for _, sl, d in pieces])
        cat = {key: np.concatenate([getattr(s, key)[sl] for s, sl, _ in pieces])
               for key in ("modality", "coords", "segment", "attention", "window")}
        labels = np.concatenate([s.labels[sl] for s, sl, _ in pieces])[:L]
        target_modality = np.concatenate([s.target[sl] for s, sl, _ in pieces])[:L]
        n = len(docs)
        if len(labels) < L:
            labels = np.concatenate([labels, np.full((L - len(labels), G), IGNORE_INDEX, dtype=np.int64)])
            target_modality = np.r_[target_modality, np.full(L - len(target_modality), -1)]
        # a segment id unique within the row: (document, segment index) runs
        key = docs[:L] * 100_000 + cat["segment"][:L]
        segment_ids = np.cumsum(np.r_[0, key[1:] != key[:-1]])
        row = {
            "ids": ids[:L], "labels": labels, "modality": cat["modality"][:L], "coords": cat["coords"][:L],
            "doc_ids": docs[:L], "segment_ids": segment_ids, "attention": cat["attention"][:L],
            "window": cat["window"][:L], "target_modality": target_modality,
        }
        used = min(n, L)
        if used < L:  # padding: a causal segment of the last sample, no targets
            pad = L - used
            last_t = row["coords"][-1, 0]
            filler = np.full((pad, G), -1, dtype=np.int64)
            filler[:, 0] = PAD_ID
            row["ids"] = np.concatenate([row["ids"], filler])
            row["modality"] = np.r_[row["modality"], np.full(pad, PAD_MODALITY)]
            row["coords"] = np.concatenate([row["coords"], np.repeat(last_t + 1 + np.arange(pad)[:, None], 3, 1)])
            row["doc_ids"] = np.r_[row["doc_ids"], np.full(pad, row["doc_ids"][-1])]
            row["segment_ids"] = np.r_[row["segment_ids"], np.full(pad, row["segment_ids"][-1] + 1)]
            row["attention"] = np.r_[row["attention"], np.full(pad, ATTENTION_IDS["causal"])]
            row["window"] = np.r_[row["window"], np.zeros(pad, dtype=np.int64)]
        return {k: np.asarray(v, dtype=np.int64) for k, v in row.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield self.next_row()

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        while True:
            rows = [self.next_row() for _ in range(batch_size)]
            yield {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}

    def state_dict(self) -> dict:
        return self.state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state = StreamState.from_dict(state)
