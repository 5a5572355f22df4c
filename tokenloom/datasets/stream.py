"""Token streams: a snapshot's shards read in a seeded order, split by rank, packed as groups.

Order. For epoch e, the data files are permuted with a generator seeded by (seed, e); the
files are taken in windows of `shuffle_window` and the samples of each window are permuted
again. This fixes one global sample order per (snapshot, seed, epoch), whatever the number
of readers; rank r of W takes global samples r, r+W, r+2W, ... With `holdout` > 0 a fixed
fraction of the samples (a hash of file name and row) forms the validation split and the
training split skips them.

Groups. A sample's flat tokens are read through its segments into *positions* (for a whole
window of files at once, the samples this rank takes: `datasets/layout.py`): a text or image
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
When a window of files is read, its samples are cut into pieces at once (`planner.cut_samples`);
rows are then chosen many at a time by `planner.plan_rows` (the pending pieces a table in stream
order) and written straight from the windows' segment tables (`packing.gather_planned`), so the
Python here runs per batch and per window, not per sample or per row. A window's layout stays in
memory while pieces of it pend, and the last shards read and windows laid out are kept (up to
256 MB of each) so that the canonical readers of a source, which read the same windows, decode
and lay out each file once. While a window's rows are packed, the next window (the next epoch's
first after the last) is read and laid out in a background thread (`stream.read_ahead`;
pyarrow's decoding and the compiled loops release the GIL), once for all the streams that ask for
it (a window in memory is not read again); each stream cuts its own samples of it into pieces
when it reaches it. A layout is a function of its files and rows alone, so the rows are the same
with it off, and in a long run reading costs the packer almost nothing (bench/RESULTS.md).
`prefetch` starts that read for the window the stream starts with, for a caller that has other
work to do before its first batch (a new training run builds its model and engine meanwhile).
`batches` plans and writes `packing.ahead_batches` batches at a time (a batch costs ~20 us of
Python and compiled calls whatever its size): one `plan_rows` call marks the planner's state after
each batch (`StreamMarks`, a `StreamMark` each when asked for), one gather writes them all, and
each batch is a view of its share. The epoch orders are shared (`epoch_order`): the canonical
readers of a source split one order.
`state` is the state after the last batch handed out, and whatever changes what comes next
(setting the state, `exclude`, `plan`) first rewinds to it, so the rows and the states are those
of planning one batch at a time.

Deletions (follow mode). `exclude(sample_ids)` drops samples a later snapshot deleted: from then
on, a pulled sample whose `sample_id` is excluded gives no piece and is counted (`removed`);
pieces already pulled stay. The exclusions are not part of the state: whoever excludes (the
loader, from its follow segments) excludes again on resume, at the same point.

State. `StreamState` is the next sample to pull (epoch, rank-local cursor), the pieces pulled
but not yet packed (each named by epoch, cursor and position range, in window order) and the
counts of skipped and removed samples. The window is rebuilt from it on resume, so a stream saved after N
rows and resumed yields exactly the rows an uninterrupted stream yields. The end of an epoch is named
as the next one's start (epoch + 1, cursor 0), whichever way the rows were planned.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow.fs import LocalFileSystem

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.catalog.uris import filesystem_and_path
from tokenloom.datasets.compiled import PAD_ID
from tokenloom.datasets.layout import ROW_ID, Layout, Positions, layout_chunks, layout_table, sample_positions
from tokenloom.datasets.packing import PlannedRows, ahead_batches, gather_planned, pack_row
from tokenloom.datasets.planner import (
    COUNTERS,
    FIRST_SKIP,
    N_PEND,
    NEXT,
    NOTHING_FITS,
    NOTHING_LEFT,
    PEND_COLUMNS,
    REMOVED,
    SKIPPED,
    SRC,
    STOP,
    cut_samples,
    pending_at,
    plan_rows,
)

__all__ = ["PAD_ID", "ROW_ID", "EpochOrder", "PendingPiece", "Positions", "ShardFile", "SourceSpec", "StreamConfig",
           "StreamExhausted", "StreamMark", "StreamMarks", "StreamState", "TokenStream", "epoch_order", "held_out",
           "pack_row", "sample_positions"]


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
    # read the next window of files in a background thread while this one's rows are packed (the
    # same rows either way; off: one thread, one window in memory at a time)
    read_ahead: bool = True
    # canonical readers (datasets/loader.py): they fix the row order whatever the number of ranks,
    # which must divide them; a run resumes on any such number of ranks
    readers: int = 4
    sources: list[SourceSpec] = field(default_factory=list)  # a mixture; empty: the dataset trained on


class StreamMark:
    """A stream's planner between two rows (`TokenStream.mark`, `plan`'s marks): the next sample to
    pull (`epoch`, `cursor`), the pending pieces (`pend`, rows of `planner.plan_rows`' table) and
    its `counters`, and the layouts those pieces come from. `TokenStream.rewind` goes back to it,
    `state_at` names it as a `StreamState`."""

    __slots__ = ("counters", "epoch", "pend", "sources")

    def __init__(self, epoch: int, sources: dict[int, Layout], pend: np.ndarray, counters: np.ndarray):
        self.epoch, self.sources, self.pend, self.counters = epoch, sources, pend, counters

    @property
    def cursor(self) -> int:
        return int(self.counters[NEXT])


class StreamMarks:
    """The marks one `TokenStream.plan` call recorded: mark m is the planner after marks_at[m] rows,
    made into a `StreamMark` only when asked for (`marks[m]`): the loader records one per batch and
    reader and asks for few (a checkpoint's state, a rewind). What a `plan_rows` call recorded is
    kept as it recorded it: the counters at each mark and its log of the pieces that pended (each
    with the row that took it), from which a mark's pending pieces are picked when asked for."""

    __slots__ = ("_count", "_parts")

    def __init__(self):
        self._parts: list[tuple] = []
        self._count = 0

    def _add(self, epoch: int, sources: dict[int, Layout], log: np.ndarray, taken: np.ndarray,
             mark_log: np.ndarray, counters: np.ndarray, at: np.ndarray) -> None:
        """The marks of one `plan_rows` call: after at[i] of its rows (`planner.pending_at`)."""
        self._parts.append((self._count, epoch, sources, log, taken, mark_log, counters, at))
        self._count += len(at)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, m: int) -> StreamMark:
        if not -self._count <= m < self._count:
            raise IndexError(f"mark {m} of {self._count}")
        m %= self._count
        for first, epoch, sources, log, taken, mark_log, counters, at in reversed(self._parts):
            if m >= first:
                i = m - first
                return StreamMark(epoch, sources, pending_at(log, taken, int(mark_log[i]), int(at[i])), counters[i])
        raise AssertionError("unreachable")


class PendingPiece(NamedTuple):
    """A piece pulled into the packing window and not yet packed: positions [start, stop) of a
    rank-local sample. (A named tuple: one is made per sample streamed.)"""

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
    removed: int = 0  # samples not read because a later snapshot deleted them (`TokenStream.exclude`)

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "skipped": self.skipped, "removed": self.removed,
                "pending": [[p.epoch, p.cursor, p.start, p.stop] for p in self.pending]}

    @staticmethod
    def from_dict(d: dict) -> StreamState:
        if "pending" not in d:
            raise ValueError(f"stream state {d} was written by the concatenate-and-chunk packer (it has no packing "
                             "window); it cannot be resumed exactly by the best-fit packer: start the run afresh")
        pending = tuple(PendingPiece(*(int(x) for x in p)) for p in d["pending"])
        return StreamState(int(d["epoch"]), int(d["cursor"]), pending, int(d.get("skipped", 0)),
                           int(d.get("removed", 0)))


def read_layout(paths: Sequence[str], group_size: int, audio_window: int, parallel: bool = False) -> Layout:
    """The samples of Parquet token shards, in file and row order, laid out (`datasets/layout.py`).
    The layout is shared: the last ones made are kept (with the shards they were read from), so the
    canonical readers of a source, which read the same windows of files, lay each out once and
    each index the samples it takes (taking its rows out of the Arrow columns instead cost each
    reader more than laying the whole window out). `parallel`: decode the files in threads, one per
    core (pyarrow releases the GIL), for a caller that waits for them; the read-ahead thread reads
    them one after the other, leaving the other cores to the packer."""
    return _read_layout(_layout_key(paths, group_size, audio_window), parallel)


def _layout_key(paths: Sequence[str], group_size: int, audio_window: int) -> tuple:
    """A window's layout as the caches know it: its shards (`_file_key`) and the layout settings."""
    return tuple(_file_key(path) for path in paths), group_size, audio_window


def _read_layout(key: tuple, parallel: bool = False) -> Layout:
    return _LAYOUTS.get(key, lambda: _make_layout(key, parallel))


def _make_layout(key: tuple, parallel: bool = False) -> Layout:
    files, group_size, audio_window = key
    if parallel and len(files) > 1:
        tables = list(_pool("decode", os.cpu_count() or 1).map(_token_table, files))
    else:
        tables = [_token_table(f) for f in files]
    return _layout_of(tables, group_size, audio_window)


def _layout_ahead(order: EpochOrder, w: int, group_size: int, audio_window: int) -> Future:
    """Window w's layout, read in the background ("read-ahead" thread) unless it is in memory or
    being read: one read per window, whoever asks (the canonical readers of a source each read
    ahead the same next window; a task each cost a thread hand-off per reader and window,
    bench/RESULTS.md)."""
    try:
        key = _window_key(order, w, group_size, audio_window)
    except OSError as exc:  # a shard that cannot be read fails the window when it is reached, not before
        future = Future()
        future.set_exception(exc)
        return future
    return _LAYOUTS.ahead(key, lambda: _make_layout(key), _pool("read-ahead", 2))


def _layout_of(tables: Sequence[pa.Table], group_size: int, audio_window: int) -> Layout:
    if all("segments" in t.column_names and t.column("tokens").num_chunks == t.column("segments").num_chunks
           for t in tables):  # the plain form shard writers give, from the Arrow buffers
        layout = layout_chunks([pair for t in tables for pair in zip(t.column("tokens").chunks,
                                                                     t.column("segments").chunks, strict=True)],
                               group_size, audio_window)
        if layout is not None:
            return layout
    list_type = pa.list_(pa.int32())
    tokens = pa.chunked_array([c for t in tables for c in _as_type(t.column("tokens"), list_type).chunks], list_type)
    segments = None
    if any("segments" in t.column_names for t in tables):  # files without it (older writers) are all text
        segments_type = pa.list_(SEGMENT_TYPE)  # one type, whatever widths a writer chose
        segments = pa.chunked_array([c for t in tables for c in (
            _as_type(t.column("segments"), segments_type) if "segments" in t.column_names
            else pa.chunked_array([pa.nulls(len(t), segments_type)])
        ).chunks], segments_type)
    return layout_table(tokens, segments, group_size, audio_window)


def _as_type(column: pa.ChunkedArray, type_: pa.DataType) -> pa.ChunkedArray:
    """`column` as `type_`, cast only when it is not already (each pyarrow call releases the GIL and
    takes it back: the read-ahead thread then waits for the packer's thread, bench/RESULTS.md)."""
    return column if column.type == type_ else column.cast(type_)


class _Recent:
    """The values last made under their keys, at most `budget` bytes of them (the most recent one
    always), shared by threads (the read-ahead of every reader): a value being made is waited for,
    not made again, and an error making it reaches everyone who waited."""

    def __init__(self, size: Callable[[Any], int], budget: int = 256 << 20):
        self.size, self.budget = size, budget
        self.values: OrderedDict = OrderedDict()
        self.reading: dict[Any, Future] = {}
        self.lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        pending, mine = self._claim(key)
        if mine:
            self._make(key, make, pending)
        return pending.result()

    def ahead(self, key: Any, make: Callable[[], Any], pool: ThreadPoolExecutor) -> Future:
        """`get` in the background: the value's future, made by `pool` unless it is made or being
        made (then that read is shared)."""
        pending, mine = self._claim(key)
        if mine:
            pool.submit(self._make, key, make, pending)
        return pending

    def _claim(self, key: Any) -> tuple[Future, bool]:
        """The future of `key`'s value (done when made) and whether the caller is to make it."""
        with self.lock:
            if key in self.values:
                self.values.move_to_end(key)
                done = Future()
                done.set_result(self.values[key])
                return done, False
            pending = self.reading.get(key)
            if pending is not None:
                return pending, False
            pending = self.reading[key] = Future()
            return pending, True

    def _make(self, key: Any, make: Callable[[], Any], pending: Future) -> None:
        try:
            value = make()
        except BaseException as exc:
            with self.lock:
                del self.reading[key]
            pending.set_exception(exc)
            return
        with self.lock:
            del self.reading[key]
            self.values[key] = value
            while len(self.values) > 1 and sum(self.size(v) for v in self.values.values()) > self.budget:
                self.values.popitem(last=False)
        pending.set_result(value)

    def _after_fork(self) -> None:
        """In a forked child: no thread of the parent's will finish its reads."""
        self.reading, self.lock = {}, threading.Lock()

    def clear(self) -> None:
        with self.lock:
            self.values.clear()


def _file_key(path: str) -> tuple[str, int, int]:
    """A shard as the caches know it: path, size and modification time (a file rewritten at the same
    path is another shard)."""
    filesystem, inner = filesystem_and_path(path)
    try:
        info = filesystem.get_file_info(inner)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read token shard {path}: {exc}") from exc
    return path, info.size, info.mtime_ns


def _decoder(key: tuple[str, int, int]) -> Callable[[], pa.Table]:
    def decode() -> pa.Table:
        """One open file, its footer read once (`ParquetFile`: a third faster here than
        `pq.read_schema` then `pq.read_table`, whose dataset layer is Python that holds the GIL
        the packer's thread needs, bench/RESULTS.md). A local file is read as it is decoded:
        pre-buffering (Arrow's I/O threads coalescing the column chunks' reads, which pays for an
        object store's round trips) cost a local read ~15% more (bench/RESULTS.md)."""
        path = key[0]
        filesystem, inner = filesystem_and_path(path)
        try:
            with pq.ParquetFile(inner, filesystem=filesystem,
                                pre_buffer=not isinstance(filesystem, LocalFileSystem)) as shard:
                columns = ["tokens", "segments"] if "segments" in shard.schema_arrow.names else ["tokens"]
                return shard.read(columns=columns, use_threads=False)
        except (OSError, ValueError) as exc:
            raise OSError(f"cannot read token shard {path}: {exc}") from exc
    return decode


def _token_table(key: tuple[str, int, int]) -> pa.Table:
    """A shard's token columns (`_file_key`; the last ones decoded are kept, see `_Recent`)."""
    return _RECENT.get(key, _decoder(key))


_RECENT = _Recent(lambda table: table.nbytes)  # decoded shards
_LAYOUTS = _Recent(lambda layout: layout.nbytes)  # whole windows laid out
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}
for _cache in (_RECENT, _LAYOUTS):
    os.register_at_fork(after_in_child=_cache._after_fork)


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    """A named pool of threads: "read-ahead" reads windows ahead, "decode" decodes the files of a
    window the packer waits for (made again in a forked child, which has none)."""
    pool = _POOLS.get(name)
    if pool is None or pool[0] != os.getpid():
        pool = _POOLS[name] = (os.getpid(), ThreadPoolExecutor(max_workers=threads,
                                                                thread_name_prefix=f"tokenloom-{name}"))
    return pool[1]


def forget_read_tables() -> None:
    """Drop the shards and layouts kept by the last reads, and the windows' keys the live epoch
    orders hold (`_window_key`), once the reads under way (read-ahead) are done: a benchmark's cold
    read; tests that rewrite a file."""
    for _, pool in _POOLS.values():
        pool.shutdown(wait=True)
    _POOLS.clear()
    _RECENT.clear()
    _LAYOUTS.clear()
    with _ORDERS_LOCK:
        for order in list(_ORDERS.values()):
            order.keys.clear()


def read_sample_ids(paths: Sequence[str], rows: np.ndarray) -> np.ndarray:
    """The `sample_id` of `rows` (indices into the files' samples taken together, in any order)."""
    columns = []
    for path in paths:
        filesystem, inner = filesystem_and_path(path)
        if "sample_id" not in pq.read_schema(inner, filesystem=filesystem).names:
            raise ValueError(f"token shard {path} has no sample_id column: deleted samples cannot be told apart")
        columns.append(pq.read_table(inner, columns=["sample_id"], filesystem=filesystem).column("sample_id"))
    ids = pa.chunked_array([c for col in columns for c in col.chunks], pa.string())
    return np.asarray(ids.take(rows).to_pylist(), dtype=object)


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
        self.keys: dict[tuple, tuple] = {}  # (window, group size, audio window) -> its layout's key, `_window_key`


_ORDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the orders streams hold (`epoch_order`)
_ORDERS_LOCK = threading.Lock()


def _window_paths(order: EpochOrder, w: int) -> list[str]:
    """The files of window w of an epoch's order, in the order its layout holds their samples."""
    return [order.files[i].path for i in order.windows[w][0]]


def _window_key(order: EpochOrder, w: int, group_size: int, audio_window: int) -> tuple:
    """Window w's layout as the caches know it (`_layout_key`: a stat of each file), taken once per
    epoch order for every stream that reads the window (the canonical readers of a source share
    the order, `epoch_order`): they read the same version of its shards, and the stats are not
    taken again by each reader, for its read and its read-ahead (~1 ms per epoch of 4 readers,
    bench/RESULTS.md). A shard that cannot be stat'ed is asked again next time."""
    at = (w, group_size, audio_window)
    key = order.keys.get(at)
    if key is None:
        key = order.keys[at] = _layout_key(_window_paths(order, w), group_size, audio_window)
    return key


def epoch_order(files: tuple[ShardFile, ...], seed: int, epoch: int, window: int, holdout: float = 0.0,
                split: str = "train") -> EpochOrder:
    """`EpochOrder(...)`, shared: the canonical readers of a source (`datasets/loader.py`) each split
    the same order, which is made once for them. An order is kept while a stream holds it (each
    holds its current epoch's and the next one's; an order is a pure function of its arguments and
    is never changed once made)."""
    key = (files, seed, epoch, window, holdout, split)
    with _ORDERS_LOCK:
        order = _ORDERS.get(key)
        if order is None:
            order = _ORDERS[key] = EpochOrder(files, seed, epoch, window, holdout, split)
    return order


@dataclass
class _FileWindow:
    """A window of files of one epoch laid out (`layout`, all of its samples, shared by the streams
    that read it; source id `src` of this stream), and per rank-local cursor in [first, stop), at
    cursor - first: the sample's index in
    the layout, first position there, whether it closes its row, its status (0: pieces, 1: skipped,
    2: removed) and its pieces piece_ptr[k]..piece_ptr[k + 1] of (piece_start, piece_stop), as
    `planner.plan_rows` reads them."""

    epoch: int
    first: int
    stop: int
    src: int
    layout: Layout
    index: np.ndarray
    base: np.ndarray
    closes: np.ndarray
    status: np.ndarray
    piece_ptr: np.ndarray
    piece_start: np.ndarray
    piece_stop: np.ndarray
    most_pieces: int  # of one sample


def _cut_window(layout: Layout, paths: Sequence[str], index: np.ndarray, seq_len: int,
                excluded: frozenset[str]) -> tuple:
    """A rank's samples `index` of a window's layout as `_FileWindow`'s per-cursor columns from
    `base` on: a sample that fits a row is one piece, a longer one is cut outside its media or
    skipped; excluded samples are marked removed."""
    status = np.zeros(len(index), dtype=np.int64)
    if excluded:
        ids = read_sample_ids(paths, index)
        status[[k for k, sample_id in enumerate(ids) if sample_id in excluded]] = 2
    piece_ptr, piece_start, piece_stop = cut_samples(np.diff(layout.offsets)[index], index, layout.media_offsets,
                                                     layout.media.reshape(-1, 2), seq_len, status)
    return (layout.offsets[index], layout.ends_row[index].astype(np.int64), status, piece_ptr, piece_start,
            piece_stop, int(np.diff(piece_ptr).max(initial=1)))


_EMPTY = np.zeros(0, dtype=np.int64)
# no window: `plan_rows` only packs what pends (the passes are read)
_NO_SAMPLES = _FileWindow(0, 0, 0, -1, None, _EMPTY, _EMPTY, _EMPTY, _EMPTY, np.zeros(1, dtype=np.int64), _EMPTY,
                          _EMPTY, 0)
_NO_MARKS = _EMPTY  # `_plan` without marks
_NO_LOG = (np.zeros((0, PEND_COLUMNS), dtype=np.int64), _EMPTY)  # `plan_rows` without marks: no log


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
        self.files, self.config, self.rank, self.world = tuple(files), config, rank, world_size
        self.group_size = max(1, config.group_size)
        if config.pack_window < 1:
            raise ValueError(f"stream.pack_window must be at least 1, got {config.pack_window}")
        self._orders: dict[int, EpochOrder] = {}
        self._order_epoch = -1
        # the next window of files, being read in the background: ((epoch, window), Future[Layout])
        self._ahead: tuple[tuple[int, int], Future] | None = None
        # the window of files in memory (one at a time, besides pieces still pending from older ones)
        self._cache: _FileWindow | None = None
        # the packing window: pending pieces in stream order (`planner.plan_rows`' table), its counters,
        # and the layouts its pieces come from, by source id
        self._pend = np.zeros((config.pack_window + 16, PEND_COLUMNS), dtype=np.int64)
        self._log = _NO_LOG  # `plan_rows`' log of the pieces that pend in a call with marks (grown as needed)
        self._counters = np.zeros(COUNTERS, dtype=np.int64)
        self._sources: dict[int, Layout] = {}
        self._pieces_out = np.empty((0, 3), dtype=np.int64)  # `plan`'s pieces, reused from call to call
        self._next_src = 0
        self._epoch = self._cursor = 0
        self._excluded: frozenset[str] = frozenset()
        self._warned = False  # one warning per stream about skipped samples; the count says the rest
        # `batches`' rows planned and written ahead: (batch, the planner's mark after it), and the mark
        # after the last batch handed out (what `state` reports while batches are queued)
        self._queued: deque[tuple[dict[str, np.ndarray], tuple[StreamMarks, int]]] = deque()
        self._consumed: tuple[StreamMarks, int] | None = None  # (marks, m): mark m of them, made when asked for
        self._queued_rows = 0  # rows per batch of those queued
        self.state = state or StreamState()

    # -- sample access ------------------------------------------------------------------
    def _order_of(self, epoch: int) -> EpochOrder:
        """Epoch `epoch`'s order (the last two asked for are kept: the current epoch's and the next
        one's, which the read-ahead needs first; the streams of one order share it, `epoch_order`)."""
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(self.files, self.config.seed, epoch, self.config.shuffle_window,
                                self.config.holdout, self.config.split)
            if order.total < self.world and not self.passes:
                raise ValueError(f"the {self.config.split} split has {order.total} samples, too few for "
                                 f"{self.world} ranks")
            self._orders = {**{e: o for e, o in self._orders.items() if e == epoch - 1 or e == epoch + 1},
                            epoch: order}
        return order

    def _epoch_order(self, epoch: int) -> EpochOrder:
        order = self._order_of(epoch)
        if self._order_epoch != epoch:
            self._order_epoch = epoch
            self._per_epoch = self._samples_of(order)
            self._drop_cache()
        return order

    def _samples_of(self, order: EpochOrder) -> int:
        """The samples of an epoch's order this rank takes (global samples rank, rank + W, ...)."""
        return (order.total - self.rank + self.world - 1) // self.world

    def _drop_cache(self) -> None:
        """Forget the window in memory (pieces still pending keep their window's layout: its tokens
        and segment table)."""
        self._cache = None

    def exclude(self, sample_ids) -> None:
        """Never read these samples again (a later snapshot deleted them); see the module docstring."""
        more = self._excluded | frozenset(sample_ids)
        if more != self._excluded:
            self._unqueue()  # rows planned ahead must not have read what is now excluded
            self._excluded = more
            self._drop_cache()  # read the windows again, with their sample ids

    def samples_per_epoch(self, epoch: int = 0) -> int:
        if epoch != self._order_epoch:
            self._epoch_order(epoch)
        return self._per_epoch

    def _raw(self, epoch: int, cursor: int) -> tuple[Layout, int]:
        """The laid-out window holding a rank-local sample, and the sample's index in it."""
        window = self._window_of(epoch, cursor)
        return window.layout, window.index[cursor - window.first]

    def _window_of(self, epoch: int, cursor: int) -> _FileWindow:
        """The window of files holding a rank-local sample, laid out and cut into pieces (read when
        not in memory)."""
        cached = self._cache
        if cached is not None and cached.epoch == epoch and cached.first <= cursor < cached.stop:
            return cached
        order = self._epoch_order(epoch)
        w = self._window_index(order, cursor)
        self._drop_cache()
        paths, index = self._window_rows(order, w)  # index: rank-local cursor order -> sample of the layout
        if self._ahead is not None and self._ahead[0] == (epoch, w):
            layout, self._ahead = self._ahead[1].result(), None
        else:
            layout = _read_layout(_window_key(order, w, self.group_size, self.config.audio_window),
                                  parallel=True)  # shared
        cut = _cut_window(layout, paths, index, self.config.seq_len, self._excluded)  # its own samples
        self._read_ahead(epoch, w)
        g0 = order.window_starts[w]
        first = -(-(g0 - self.rank) // self.world)  # the window's first rank-local cursor
        src, self._next_src = self._next_src, self._next_src + 1
        self._sources[src] = layout
        self._cache = _FileWindow(epoch, first, first + len(index), src, layout, index, *cut)
        return self._cache

    def _window_index(self, order: EpochOrder, cursor: int) -> int:
        """The window of `order` that holds rank-local sample `cursor` (global sample cursor x W + rank)."""
        return int(np.searchsorted(order.window_starts, cursor * self.world + self.rank, side="right") - 1)

    def prefetch(self) -> Future | None:
        """Start reading, in the background, the window of files the next sample pulled comes from
        (one read per window, shared by every stream that reads it, as the read-ahead's), so that it
        overlaps whatever the caller does before asking for rows (the trainer builds its model and
        engine meanwhile). The rows are the same; a file that cannot be read fails the batch that
        needs it, as without. Returns the read's future (done when the window is in memory), or None
        with `stream.read_ahead` off, batches planned ahead, the window in memory or the passes read."""
        if self._queued or not self.config.read_ahead or (self.passes and self._exhausted()):
            return None
        epoch, cursor = self._epoch, self._cursor
        order = self._order_of(epoch)
        while cursor >= self._samples_of(order):
            epoch, cursor = epoch + 1, 0  # (an endless stream has samples every epoch)
            order = self._order_of(epoch)
        cached = self._cache
        if cached is not None and cached.epoch == epoch and cached.first <= cursor < cached.stop:
            return None
        w = self._window_index(order, cursor)
        if self._ahead is None or self._ahead[0] != (epoch, w):
            self._ahead = ((epoch, w), _layout_ahead(order, w, self.group_size, self.config.audio_window))
        return self._ahead[1]

    def _window_rows(self, order: EpochOrder, w: int) -> tuple[list[str], np.ndarray]:
        """Window w's files and the rows of them this rank takes, in the rank's order (indices into
        the files' samples taken together, as the window's layout holds them)."""
        perm = order.windows[w][1]
        # global samples r, r + W, ...: the window's j-th is global window_starts[w] + j
        mine = perm[(self.rank - order.window_starts[w]) % self.world :: self.world]
        return _window_paths(order, w), mine.copy()  # (the order is shared: a copy of its part)

    def _read_ahead(self, epoch: int, w: int) -> None:
        """Start reading the window after window w of `epoch` (the next epoch's first after the last)
        in the background, so that the files are decoded and laid out while this one's rows are
        packed (pyarrow and the compiled loops release the GIL); one read per window for all the
        streams that ask (`_layout_ahead`). The layout is the same whenever it is read; only the time
        it takes moves. This stream's samples of it are cut into pieces when it reaches it."""
        nxt = (epoch, w + 1) if w + 1 < len(self._order_of(epoch).windows) else (epoch + 1, 0)
        if not self.config.read_ahead or (self.passes and nxt[0] >= self.passes) or (
                self._ahead is not None and self._ahead[0] == nxt):
            return
        self._ahead = (nxt, _layout_ahead(self._order_of(nxt[0]), nxt[1], self.group_size, self.config.audio_window))

    def _sample(self, epoch: int, cursor: int) -> np.ndarray:
        """The flat tokens of a rank-local sample."""
        layout, i = self._raw(epoch, cursor)
        return layout.sample_tokens(i)

    # -- packing --------------------------------------------------------------------------
    @property
    def exhausted(self) -> bool:
        """No sample is left to pull (only ever true for a stream of a fixed number of passes)."""
        self._unqueue()
        return self._exhausted()

    def _exhausted(self) -> bool:
        if not self.passes:
            return False
        while self._epoch < self.passes and self._cursor >= self.samples_per_epoch(self._epoch):
            self._epoch, self._cursor = self._epoch + 1, 0
        return self._epoch >= self.passes

    def plan(self, rows: int, marks_at: np.ndarray = _NO_MARKS, marks: StreamMarks | None = None) -> PlannedRows:
        """The next `rows` rows as pieces (source id, position, length), row r's at
        pieces[row_ptr[r]:row_ptr[r + 1]], and the layouts they name (`planner.plan_rows` chooses
        them; this feeds it windows of samples, epoch after epoch, and turns its reasons into errors
        and warnings). The keys are the stream's source ids: plans of one stream share them. With
        `marks`, the planner's state after marks_at[m] rows (ascending, 1 to `rows`) is recorded there
        as each is reached (`marks[m]`; `rewind` goes back to one, `state_at` names it)."""
        self._unqueue()
        return self._plan(rows, marks_at, marks)

    def _plan(self, rows: int, marks_at: np.ndarray, marks: StreamMarks | None) -> PlannedRows:
        pieces, row_ptr = self._pieces_out, np.zeros(rows + 1, dtype=np.int64)
        made, counters = 0, self._counters
        while made < rows:
            refill = not (self.passes and self._exhausted())
            per_epoch = 0
            if refill:
                while self._cursor >= (per_epoch := self.samples_per_epoch(self._epoch)):
                    self._epoch, self._cursor = self._epoch + 1, 0
                window = self._cache  # (the window in memory, checked here: this runs per batch)
                if window is None or window.epoch != self._epoch or not window.first <= self._cursor < window.stop:
                    window = self._window_of(self._epoch, self._cursor)
                if int(counters[N_PEND]) + self.config.pack_window + window.most_pieces > len(self._pend):
                    self._reserve(int(counters[N_PEND]) + self.config.pack_window + window.most_pieces)
            else:
                window = _NO_SAMPLES
            need = row_ptr[made] + min(self.config.seq_len, len(self._pend)) * (rows - made)  # pieces a row can take
            if len(pieces) < need:
                pieces = np.concatenate([pieces[: row_ptr[made]], np.empty((2 * need, 3), dtype=np.int64)])
            counters[NEXT] = self._cursor
            at = marks_at if made == 0 and (not len(marks_at) or marks_at[-1] <= rows) else \
                marks_at[(marks_at > made) & (marks_at <= rows)] - made
            log, taken = _NO_LOG
            if len(at):  # the log holds every piece that pends in the call: the pending at most, and those taken
                size = len(pieces) - int(row_ptr[made]) + len(self._pend)
                if len(self._log[1]) < size:
                    self._log = (np.empty((2 * size, PEND_COLUMNS), dtype=np.int64), np.empty(2 * size, dtype=np.int64))
                log, taken = self._log
            mark_log, mark_counters = np.empty(len(at), dtype=np.int64), np.empty((len(at), COUNTERS), dtype=np.int64)
            n, reason = plan_rows(self._pend, counters, rows - made, self.config.pack_window, self.config.seq_len,
                                  refill, self._epoch, window.first, window.src, window.base, window.closes,
                                  window.status, window.piece_ptr, window.piece_start, window.piece_stop,
                                  per_epoch, pieces, row_ptr[made:], at, log, taken, mark_log, mark_counters)
            if marks is not None and len(at) and at[0] <= n:
                sources, epoch = dict(self._sources), self._epoch  # the layouts the marks' pieces may name
                count = int(np.searchsorted(at, n, side="right"))
                logged = int(mark_log[count - 1])  # (the buffer is the next call's: the part the marks read, copied)
                marks._add(epoch, sources, log[:logged].copy(), taken[:logged].copy(), mark_log[:count],
                           mark_counters[:count], at[:count])
            self._cursor = int(counters[NEXT])
            made += n
            if counters[FIRST_SKIP] >= 0 and not self._warned:
                self._warn_skipped(window)
            if reason == NOTHING_LEFT:
                raise StreamExhausted(f"rank {self.rank} has read its {self.passes} pass(es)")
            if reason == NOTHING_FITS:
                if counters[REMOVED]:
                    raise NoSampleFits(f"every sample of rank {self.rank} was deleted by a later snapshot or is "
                                       f"longer than stream.seq_len {self.config.seq_len}: nothing left to stream")
                raise NoSampleFits(f"no sample of rank {self.rank} fits a row of stream.seq_len "
                                   f"{self.config.seq_len} (each has a media segment longer than that): raise seq_len")
        self._pieces_out = pieces  # the next call writes over it (its rows were copied out below)
        used = dict(self._sources)  # (a copy: the next window read adds to `_sources`)
        # forget the layouts no piece pends from: source ids grow with the windows read and the
        # pending pieces are in stream order, so the first one's is the oldest still needed
        oldest = int(self._pend[0, SRC]) if counters[N_PEND] else self._next_src - 1
        if used and next(iter(used)) < oldest:
            self._sources = {k: v for k, v in used.items() if k >= oldest}
        return PlannedRows(used, pieces[: row_ptr[rows]].copy(), row_ptr)

    def _reserve(self, n: int) -> None:
        if n > len(self._pend):
            grown = np.zeros((2 * n, PEND_COLUMNS), dtype=np.int64)
            grown[: len(self._pend)] = self._pend
            self._pend = grown

    def _warn_skipped(self, window: _FileWindow) -> None:
        cursor = int(self._counters[FIRST_SKIP])
        if cursor < 0 or self._warned:
            return
        self._warned = True
        k = cursor - window.first
        longest = max((b - a for a, b in window.layout.media_of(int(window.index[k]))), default=0) \
            if 0 <= k < len(window.index) else 0
        warnings.warn(f"a sample (rank {self.rank} sample {cursor}) has a media segment of {longest} positions, "
                      f"longer than stream.seq_len {self.config.seq_len}: media is never split across rows, so such "
                      f"samples are skipped and counted in the stream state's `skipped`; set stream.seq_len to at "
                      f"least {longest} to keep them", stacklevel=4)

    def next_row(self) -> dict[str, np.ndarray]:
        """The next packed row (see `datasets/packing.py`)."""
        return {k: v[0] for k, v in self._gather(1).items() if k != "fill_ratio"}

    def _gather(self, rows: int) -> dict[str, np.ndarray]:
        return gather_planned(*self.plan(rows), self.config.seq_len, self.group_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield self.next_row()

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Batches of rows [B, ...] under the row keys, plus `fill_ratio` [B] float64: each row's
        non-padding share, whose mean is the batch's fill ratio.

        Rows are planned and written `ahead_batches(batch_size, seq_len)` batches at a time (one
        compiled pass for all of them; each batch a view of its share), with the planner's state
        marked after each batch: `state` is the state after the last batch handed out, and anything
        that changes what comes next (setting the state, `exclude`, `plan`) first rewinds to it, so
        the rows and the states are those of planning one batch at a time."""
        queued = self._queued
        while True:
            if not queued or self._queued_rows != batch_size:
                self._unqueue()
                self._queue(batch_size)
                self._queued_rows = batch_size
            batch, self._consumed = queued.popleft()
            yield batch

    def _queue(self, batch_size: int) -> None:
        """Plan and write the next batches (see `batches`): one `_plan` call marks the state after each.
        An error (the passes read, nothing fits) ends the batches before it: they are planned again
        from the start (the rows are a function of the state) and the error is raised when the batch
        that meets it is asked for, as one batch at a time would."""
        k = ahead_batches(batch_size, self.config.seq_len)
        start, marks = self.mark(), StreamMarks()
        try:
            plan = self._plan(k * batch_size, np.arange(1, k + 1) * batch_size, marks)
        except Exception:
            if not len(marks):
                raise
            k, marks = len(marks), StreamMarks()
            self._rewind(start)
            plan = self._plan(k * batch_size, np.arange(1, k + 1) * batch_size, marks)
        batch = gather_planned(*plan, self.config.seq_len, self.group_size)
        for j in range(len(marks)):
            self._queued.append(({k: v[j * batch_size : (j + 1) * batch_size] for k, v in batch.items()}, (marks, j)))

    def _consumed_mark(self) -> StreamMark:
        """The planner's mark after the last batch handed out (made when asked for)."""
        marks, m = self._consumed
        return marks[m]

    def _unqueue(self) -> None:
        """Drop the batches planned ahead and rewind the planner to the last one handed out."""
        if self._queued:
            self._queued.clear()
            self._rewind(self._consumed_mark())

    def mark(self) -> StreamMark:
        """The planner's state as it stands (copies of the pending pieces and counters: a few KB)."""
        counters = self._counters.copy()
        counters[NEXT] = self._cursor  # (the counter is the planner's copy, set at each call)
        return StreamMark(self._epoch, dict(self._sources), self._pend[: counters[N_PEND]].copy(), counters)

    def rewind(self, mark: StreamMark) -> None:
        """Back to a mark of this stream's planner (`mark`, `plan`'s marks); batches made ahead are
        dropped. The windows read since stay in memory."""
        self._queued.clear()
        self._rewind(mark)

    def _rewind(self, mark: StreamMark) -> None:
        self._reserve(len(mark.pend) + self.config.pack_window)
        self._pend[: len(mark.pend)] = mark.pend
        self._counters[:] = mark.counters
        self._epoch, self._cursor, self._sources = mark.epoch, mark.cursor, dict(mark.sources)
        if self._cache is not None:  # the window in memory may have been read after the mark: keep its layout
            self._sources.setdefault(self._cache.src, self._cache.layout)

    def state_at(self, mark: StreamMark) -> StreamState:
        """The state at a mark, in one form: the end of an epoch is named as the next one's start
        (the planner moves on there only when it next pulls a sample, so where it stands would depend
        on how many rows each call planned)."""
        c, epoch, cursor = mark.counters, mark.epoch, mark.cursor
        if not (self.passes and epoch >= self.passes):
            order = self._order_of(epoch)
            if cursor >= self._samples_of(order):
                epoch, cursor = epoch + 1, 0
        pending = tuple(PendingPiece(*p) for p in mark.pend[:, :STOP + 1].tolist())
        return StreamState(epoch, cursor, pending, int(c[SKIPPED]), int(c[REMOVED]))

    @property
    def state(self) -> StreamState:
        """The state after the last row handed out (batches planned ahead are not counted)."""
        return self.state_at(self._consumed_mark() if self._queued else self.mark())

    @state.setter
    def state(self, state: StreamState) -> None:
        self._queued.clear()
        self._check_state(state)
        rows = []
        for p in state.pending:
            window = self._window_of(p.epoch, p.cursor)
            k = p.cursor - window.first
            length = window.layout.length(int(window.index[k]))
            if not 0 <= p.start < p.stop <= length:
                raise ValueError(f"stream state names positions [{p.start}, {p.stop}) of a sample of "
                                 f"{length}: it was saved for other data or stream settings")
            rows.append([p.epoch, p.cursor, p.start, p.stop, window.src, int(window.base[k]) + p.start,
                         int(window.closes[k])])
        self._reserve(len(rows) + self.config.pack_window)
        self._pend[: len(rows)] = np.array(rows, dtype=np.int64).reshape(len(rows), PEND_COLUMNS)
        self._counters[:] = 0
        self._counters[N_PEND], self._counters[SKIPPED], self._counters[REMOVED] = len(rows), state.skipped, state.removed
        self._counters[FIRST_SKIP] = -1
        self._epoch, self._cursor = state.epoch, state.cursor

    def _check_state(self, state: StreamState) -> None:
        """Refuse, in one line, a state this stream cannot have made: a checkpoint of other data or
        settings (a smaller dataset, another split, holdout or number of ranks) or one edited by
        hand. Such a state would make the planner loop forever (a negative cursor), index outside a
        window, or read a sample twice (a pending piece of a sample not yet pulled)."""
        def refuse(what: str) -> None:
            raise ValueError(f"stream state {what}: it was saved for other data or stream settings")

        for name in ("epoch", "cursor", "skipped", "removed"):
            if getattr(state, name) < 0:
                refuse(f"has {name} {getattr(state, name)} (< 0)")
        if self.passes and state.epoch > self.passes:
            refuse(f"is at epoch {state.epoch} of a stream of {self.passes} pass(es)")
        if state.cursor > self.samples_per_epoch(state.epoch):
            refuse(f"is at sample {state.cursor} of epoch {state.epoch}, which has "
                   f"{self.samples_per_epoch(state.epoch)} on rank {self.rank} of {self.world}")
        previous = None
        for p in state.pending:
            if p.epoch < 0 or not 0 <= p.cursor < self.samples_per_epoch(p.epoch):
                refuse(f"has a pending piece of sample {p.cursor} of epoch {p.epoch}, which rank {self.rank} "
                       f"of {self.world} does not have")
            if (p.epoch, p.cursor) >= (state.epoch, state.cursor):
                refuse(f"has a pending piece of sample {p.cursor} of epoch {p.epoch}, not yet pulled at sample "
                       f"{state.cursor} of epoch {state.epoch}")
            if previous is not None and (p.epoch, p.cursor, p.start) < (previous.epoch, previous.cursor,
                                                                         previous.stop):
                refuse(f"has pending pieces out of stream order or overlapping ({tuple(previous)} then "
                       f"{tuple(p)})")
            previous = p

    def state_dict(self) -> dict:
        return self.state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state = StreamState.from_dict(state)
