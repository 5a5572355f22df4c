"""The training loader: canonical readers, mixtures of datasets, and segments that follow new snapshots.

Why canonical readers (MosaicML Streaming's elastic determinism). If the order of rows depended
on the number of ranks, a run saved on two ranks could not resume on one with the rows it would
have seen. So the rows are made by a fixed number C of *canonical readers* (`stream.readers`),
whatever the world size W: reader c is a `TokenStream` split (c of C) of every source, packing
its own rows, and global row g is row g // C of reader g % C. Rank r of W (W divides C) takes the
global rows r, r + W, r + 2W, ... of each step's block of W x B rows, which all come from its own
readers c = r (mod W); the rows of a step are the same set for any W with the same W x B. The
state is the number of global rows consumed plus every reader's state, so any W dividing C can
resume it (`LoaderState`, gathered from all ranks into the checkpoint).

Mixtures (`[[stream.sources]]`, `--mix a=0.7,b=0.3`). Each source is a dataset (at a snapshot)
with a weight; a reader draws the source of each of its rows from a generator seeded by (seed,
stage, reader, row), so the draw is a pure function of the row's place, and the reader keeps one
stream (one cursor) per source. A source's ids must mean what the run's manifest says (the job
checks that every source's manifest is a prefix of the one the model uses).

Follow mode (`train --follow`). A snapshot committed to a source during training becomes a
*segment*: the files it added, read once (`TokenStream(passes=1)`, split over the readers like
everything else) before the reader draws from its sources again. A segment starts at the global
row where the trainer learnt of it (`Segment.from_row`), so a reader's rows before that never
change, segments are read in commit order, and every sample of a segment is trained exactly once.
Segments are part of the state, so a resumed run rebuilds them. A snapshot that deleted samples
(a replaced or removed input file) names them in its segment (`Segment.deleted`, sample ids): from
the segment on, the reader's streams of that source that existed before it (the source's own, and
earlier segments) never read them again (`TokenStream.exclude`); the segment's own new rows are
read, even where a new row keeps the id of a deleted one (a changed file's records).

Stages (context extension) are the trainer's: it builds a new `Loader` per stage with that
stage's `seq_len` and weights and the stage index, which seeds it.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from tokenloom.datasets import packing
from tokenloom.datasets.packing import PlannedRows, ahead_batches, gather_planned, interleave_rows
from tokenloom.datasets.planner import REMOVED, SKIPPED
from tokenloom.datasets.stream import (
    ShardFile,
    StreamConfig,
    StreamExhausted,
    StreamMark,
    StreamMarks,
    TokenStream,
)

__all__ = ["Loader", "LoaderState", "Segment", "Source", "draw_sources", "parse_mix"]


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: its name, the data files of the snapshot trained on, its weight."""

    name: str
    files: tuple[ShardFile, ...]
    weight: float = 1.0
    snapshot_id: int | None = None


@dataclass(frozen=True)
class Segment:
    """Files a snapshot committed during training added to `source`: read once, from global row
    `from_row` on, before the sources' own rows."""

    source: str
    snapshot_id: int
    files: tuple[ShardFile, ...]
    from_row: int
    deleted: tuple[str, ...] = ()  # sample ids the snapshot deleted

    def to_dict(self) -> dict:
        return {"source": self.source, "snapshot_id": self.snapshot_id, "from_row": self.from_row,
                "files": [[f.path, f.num_rows] for f in self.files], "deleted": list(self.deleted)}

    @staticmethod
    def from_dict(d: dict) -> Segment:
        return Segment(d["source"], int(d["snapshot_id"]), tuple(ShardFile(p, int(n)) for p, n in d["files"]),
                       int(d["from_row"]), tuple(d.get("deleted", ())))


@dataclass
class LoaderState:
    rows: int = 0  # global rows consumed (by all ranks together)
    readers: dict[int, dict] = field(default_factory=dict)  # reader -> its state (every reader, once gathered)
    segments: list[Segment] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "readers": {str(c): s for c, s in sorted(self.readers.items())},
                "segments": [s.to_dict() for s in self.segments]}

    @staticmethod
    def from_dict(d: dict) -> LoaderState:
        if "readers" not in d:
            raise ValueError("the checkpoint's stream state predates canonical readers (stream.readers); "
                             "it cannot be resumed exactly: start the run afresh")
        return LoaderState(int(d["rows"]), {int(c): s for c, s in d["readers"].items()},
                           [Segment.from_dict(s) for s in d.get("segments", [])])


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`a=0.7,b=0.3` -> [("a", 0.7), ("b", 0.3)], with a one-line error for anything else."""
    out = []
    for part in text.split(","):
        name, eq, weight = part.strip().partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not eq or not name or not value > 0:
            raise ValueError(f"--mix {text!r}: expected DATASET=WEIGHT[,DATASET=WEIGHT...] with weights > 0")
        out.append((name.strip(), value))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"--mix {text!r} names a dataset twice")
    return out


def draw_sources(weights: Sequence[float], seed: int, stage: int, reader: int, rows: np.ndarray) -> np.ndarray:
    """The source index of each of a reader's `rows`: a pure function of (seed, stage, reader, row)."""
    p = np.asarray(weights, dtype=np.float64)
    cdf = np.cumsum(p / p.sum())
    u = np.array([np.random.default_rng([seed, stage, reader, int(r)]).random() for r in rows])
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(p) - 1)


def _seed(seed: int, *parts: object) -> int:
    return zlib.crc32("/".join(str(p) for p in (seed, *parts)).encode())


class _ReaderMark(NamedTuple):
    """A reader between two rows: its rows so far, its segments, each stream's planner mark."""

    rows: int
    segments: list  # (Segment, TokenStream | None)
    streams: list[StreamMark]  # one per source
    segment_marks: list[StreamMark | None]  # one per segment, None once read to its end


class _ReaderBook(NamedTuple):
    """A reader's marks after each batch of the rows it planned ahead (`_Reader.plan_ahead`), made
    into `_ReaderMark`s only when asked for: after ends[j] of its rows, stream k stands at its mark
    before them (none of its rows yet) or at one its plan recorded."""

    rows: int  # the reader's rows before them
    ends: np.ndarray
    segments: list
    streams: list  # per stream: (its mark before, or None; at; the marks its plan recorded; done)

    def mark(self, j: int) -> _ReaderMark:
        streams = []
        for before, at, recorded, done in self.streams:
            d = int(done[j])  # its rows among the reader's first ends[j]
            streams.append(before if d == 0 else recorded[int(np.searchsorted(at, d))])
        return _ReaderMark(self.rows + int(self.ends[j]), self.segments, streams, [None] * len(self.segments))


class _Written:
    """Planned rows of consecutive batches (with each row's source, global index and segment),
    written when the first of those batches is asked for: planning runs further ahead than writing,
    which keeps a write's positions within the caches (`packing.AHEAD_POSITIONS`)."""

    __slots__ = ("batch_size", "batches", "config", "names", "places", "plan", "segments")

    def __init__(self, plan: PlannedRows, names: list[str], places: np.ndarray, batch_size: int,
                 config: StreamConfig, segments: np.ndarray | None = None):
        self.plan, self.names, self.places, self.batch_size, self.config = plan, names, places, batch_size, config
        self.segments = np.full(len(places), -1, dtype=np.int64) if segments is None else segments
        self.batches: list[dict] | None = None

    def batch(self, j: int) -> dict:
        if self.batches is None:
            rows = gather_planned(*self.plan, self.config.seq_len, max(1, self.config.group_size))
            self.batches = []
            for a in range(0, len(self.places), self.batch_size):
                part = slice(a, a + self.batch_size)
                view = {key: v[part] for key, v in rows.items()}
                view["source"], view["row"], view["segment"] = self.names[part], self.places[part], self.segments[part]
                self.batches.append(view)
            self.plan = None
        return self.batches[j]


class _LoaderMark(NamedTuple):
    """A loader between two batches: global rows consumed, each of its readers' marks."""

    rows: int
    readers: dict[int, _ReaderMark]


class _Reader:
    """Canonical reader `index` of `readers`: one stream per source and per pending segment."""

    def __init__(self, index: int, readers: int, sources: Sequence[Source], config: StreamConfig, stage: int):
        self.index, self.readers, self.config, self.stage = index, readers, config, stage
        self.names = [s.name for s in sources]
        self.weights = [s.weight for s in sources]
        self.streams: list[TokenStream] = []
        for k, s in enumerate(sources):
            seed = config.seed if (k, stage) == (0, 0) else _seed(config.seed, stage, s.name)
            try:
                self.streams.append(TokenStream(s.files, replace(config, seed=seed), rank=index, world_size=readers))
            except ValueError as exc:
                raise ValueError(f"source {s.name!r}: {exc} (stream.readers = {readers} canonical readers each "
                                 "need a share of its samples)") from None
        self.rows = 0
        self.segments: list[tuple[Segment, TokenStream | None]] = []  # None: read to its end

    def add(self, segment: Segment, state: dict | None = None) -> None:
        if segment.deleted:  # the streams of its source so far stop reading what it deleted
            self.streams[self.names.index(segment.source)].exclude(segment.deleted)
            for earlier, stream in self.segments:
                if earlier.source == segment.source and stream is not None:
                    stream.exclude(segment.deleted)
        if not segment.files:  # it only deleted
            self.segments.append((segment, None))
            return
        cfg = replace(self.config, seed=_seed(self.config.seed, "follow", segment.snapshot_id))
        stream = TokenStream(segment.files, cfg, rank=self.index, world_size=self.readers, passes=1)
        if state == "done":
            self.segments.append((segment, None))
            return
        if state is not None:
            stream.load_state_dict(state)
        self.segments.append((segment, stream))

    def next_plan(self) -> tuple[str, int, tuple[PlannedRows, int]]:
        """The reader's next row (row r of a plan of its streams, `datasets/packing.py`), the source
        it came from and its segment's snapshot (-1: none)."""
        g = self.index + self.readers * self.rows  # this row's global index
        for i, (segment, stream) in enumerate(self.segments):
            if stream is None or g < segment.from_row:
                continue
            try:
                plan = stream.plan(1)
            except StreamExhausted:
                self.segments[i] = (segment, None)
                continue
            self.rows += 1
            return segment.source, segment.snapshot_id, (plan, 0)
        k = 0 if len(self.streams) == 1 else int(draw_sources(self.weights, self.config.seed, self.stage, self.index,
                                                              np.array([self.rows]))[0])
        self.rows += 1
        return self.names[k], -1, (self.streams[k].plan(1), 0)

    def next_plans(self, count: int) -> list[tuple[str, int, tuple[PlannedRows, int]]]:
        """`next_plan` for the next `count` rows: row by row while a segment is being read, else
        `plan_ahead` (each source's stream plans its rows in one call; the same rows)."""
        if any(stream is not None for _, stream in self.segments):
            return [self.next_plan() for _ in range(count)]
        parts, drawn, _ = self.plan_ahead(count, np.array([count]))
        out: list = [None] * count
        for plan, mine in parts:
            for r, i in enumerate(mine.tolist()):
                out[i] = (self.names[int(drawn[i])], -1, (plan, r))
        return out

    def plan_ahead(self, count: int, ends: np.ndarray) -> tuple[list[tuple[PlannedRows, np.ndarray]], np.ndarray,
                                                              _ReaderBook]:
        """The reader's next `count` rows at once, no segment being read: each source's stream plans
        its rows in one call (the rows of `count` calls of `next_plan`). Returns the plans with the
        rows (0..count-1) each gives, the source of every row (an index of the sources), and the
        reader's marks after ends[j] rows for each j (ascending)."""
        drawn = (np.zeros(count, dtype=np.int64) if len(self.streams) == 1 else
                 draw_sources(self.weights, self.config.seed, self.stage, self.index, self.rows + np.arange(count)))
        parts, streams = [], []
        for k, stream in enumerate(self.streams):
            mine = np.arange(count) if len(self.streams) == 1 else np.flatnonzero(drawn == k)
            # its rows among the reader's first ends[j] (all of them with one stream: ends <= count)
            done = ends if len(self.streams) == 1 else np.searchsorted(mine, ends)
            before = stream.mark() if len(done) and done[0] == 0 else None
            marked = done > 0  # (done ascends) the counts marked, each once
            marked[1:] &= done[1:] != done[:-1]
            at = done[marked]
            recorded = StreamMarks()
            if len(mine):
                parts.append((stream.plan(len(mine), at, recorded), mine))
            streams.append((before, at, recorded, done))
        book = _ReaderBook(self.rows, ends, list(self.segments), streams)
        self.rows += count
        return parts, drawn, book

    def mark(self) -> _ReaderMark:
        return _ReaderMark(self.rows, list(self.segments), [s.mark() for s in self.streams],
                           [None if s is None else s.mark() for _, s in self.segments])

    def rewind(self, mark: _ReaderMark) -> None:
        self.rows, self.segments = mark.rows, list(mark.segments)
        for stream, m in zip(self.streams, mark.streams, strict=True):
            stream.rewind(m)
        for (_, stream), m in zip(self.segments, mark.segment_marks, strict=True):
            if stream is not None:
                stream.rewind(m)

    def state_dict(self, mark: _ReaderMark | None = None) -> dict:
        """The reader's state, or the one it had at `mark`."""
        if mark is not None:
            return {"rows": mark.rows,
                    "sources": {n: s.state_at(m).to_dict() for n, s, m in zip(self.names, self.streams, mark.streams,
                                                                                strict=True)},
                    "segments": [("done" if m is None else s.state_at(m).to_dict())
                                 for (_, s), m in zip(mark.segments, mark.segment_marks, strict=True)]}
        return {"rows": self.rows, "sources": {n: s.state_dict() for n, s in zip(self.names, self.streams,
                                                                                   strict=True)},
                "segments": [("done" if s is None else s.state_dict()) for _, s in self.segments]}

    def load_state_dict(self, state: dict, segments: Sequence[Segment]) -> None:
        if sorted(state["sources"]) != sorted(self.names):
            raise ValueError(f"the checkpoint's reader streamed sources {sorted(state['sources'])}, this run "
                             f"{sorted(self.names)}: resume with the same stream sources")
        self.rows = int(state["rows"])
        for name, stream in zip(self.names, self.streams, strict=True):
            stream.load_state_dict(state["sources"][name])
        self.segments = []
        for segment, seg_state in zip(segments, state["segments"], strict=True):
            self.add(segment, seg_state)


class Loader:
    """Batches of rows for one data-parallel rank, from `readers` canonical readers (see the module
    docstring). Each batch holds the row keys, `fill_ratio` [B], `source` [B] (each row's source
    name), `row` [B] (each row's global index) and `segment` [B] (the followed snapshot a row comes
    from, -1 for the sources' own rows).

    Batches are planned and written ahead as the stream's are (`TokenStream.batches`): while no
    followed segment is being read, `packing.PLAN_GROUPS` x `ahead_batches` of them are planned at a time,
    each reader's streams planning their rows in one call that marks their state after every batch,
    and written `ahead_batches` at a time when the first of those is asked for. The marks stay the
    planner's arrays (`StreamMarks`, `_ReaderBook`) until a state is asked for: a trainer asks at
    its checkpoints and logging steps, not at every batch. `state`, `skipped` and `removed` are
    those after the last batch handed out; `follow` and `load` first rewind to it, so the rows and
    states are those of one batch at a time."""

    def __init__(self, sources: Sequence[Source], config: StreamConfig, readers: int, rank: int = 0,
                 world_size: int = 1, stage: int = 0, state: LoaderState | None = None):
        if not sources:
            raise ValueError("the loader needs at least one source")
        if len({s.name for s in sources}) != len(sources):
            raise ValueError(f"stream sources name a dataset twice: {[s.name for s in sources]}")
        if any(not s.weight > 0 for s in sources):
            raise ValueError(f"stream source weights must be > 0, got {[(s.name, s.weight) for s in sources]}")
        if readers < 1 or readers % world_size:
            raise ValueError(f"stream.readers ({readers}) must be a multiple of the number of ranks ({world_size}): "
                             "the row order is fixed by the canonical readers, each rank reads readers/ranks of them")
        self.sources, self.config, self.readers = list(sources), config, readers
        self.rank, self.world, self.stage = rank, world_size, stage
        self.own = {c: _Reader(c, readers, sources, config, stage) for c in range(rank, readers, world_size)}
        self.rows = 0
        self.segments: list[Segment] = []
        # (batch j of them, the mark after it: global rows and each reader's marks, batch b of them)
        self._queued: deque[tuple[tuple[_Written, int], tuple[int, dict[int, _ReaderBook], int] | None]] = deque()
        self._consumed: tuple[int, dict[int, _ReaderBook], int] | None = None
        self._queued_rows = 0  # rows per batch of those queued
        if state is not None:
            self.load(state)

    def prefetch(self) -> list[Future]:
        """Start reading, in the background, the window of files every stream of this rank's readers
        reads next (`TokenStream.prefetch`: the canonical readers of a source share one read), so that
        a caller that does other work before the first batch (the trainer building its model and
        engine) waits for less of it. The batches are the same. Returns the reads' futures."""
        streams = [s for reader in self.own.values()
                   for s in [*reader.streams, *(t for _, t in reader.segments if t is not None)]]
        return [f for f in (s.prefetch() for s in streams) if f is not None]

    def follow(self, source: str, snapshot_id: int, files: Sequence[ShardFile],
               deleted: Sequence[str] = ()) -> Segment | None:
        """Read the files a new snapshot of `source` added once, from the next global row on, and
        stop reading the samples it `deleted` (every rank calls this at the same step). None when it
        added no sample and deleted none."""
        if source not in {s.name for s in self.sources}:
            raise ValueError(f"follow: {source!r} is not a source of this run")
        self._unqueue()
        files = tuple(f for f in files if f.num_rows > 0)
        if not files and not deleted:
            return None
        segment = Segment(source, int(snapshot_id), files, self.rows, tuple(sorted(set(deleted))))
        self.segments.append(segment)
        for reader in self.own.values():
            reader.add(segment)
        return segment

    def take_segments(self, other: Loader) -> None:
        """Continue `other`'s unfinished segments here (a new stage's loader): each reader keeps its
        cursor and packing window in them, from this loader's next row on. The pieces pending were
        cut for `other`'s row length, so this one's must be at least as long."""
        if other.config.seq_len > self.config.seq_len and other.segments:
            raise ValueError(f"a stage shortens rows from {other.config.seq_len} to {self.config.seq_len} while "
                             "follow-mode segments are still being read; such a stage cannot take them over")
        old = other.state()
        self._unqueue()
        self.segments = [replace(s, from_row=self.rows) for s in other.segments]
        for c, reader in self.own.items():
            reader.segments = []
            for segment, seg_state in zip(self.segments, old.readers[c]["segments"], strict=True):
                reader.add(segment, seg_state)

    def _next_rows(self, count: int) -> list[tuple[int, str, int, tuple[PlannedRows, int]]]:
        """This rank's share of the next `count` x world global rows: (global row, source, segment, the
        row: row r of a plan). Each reader plans its share in one call (readers are independent)."""
        places = [self.rows + self.rank + self.world * j for j in range(count)]
        mine: dict[int, list[int]] = {}
        for j, g in enumerate(places):
            mine.setdefault(g % self.readers, []).append(j)
        out: list = [None] * count
        for c, js in mine.items():
            reader = self.own[c]
            if reader.index + self.readers * reader.rows != places[js[0]]:
                raise RuntimeError(f"reader {reader.index} is at row {reader.rows}, global row {places[js[0]]} "
                                   "expected")
            for j, plan in zip(js, reader.next_plans(len(js)), strict=True):
                out[j] = (places[j], *plan)
        self.rows += count * self.world
        return out

    def batches(self, batch_size: int) -> Iterator[dict]:
        queued = self._queued
        while True:
            if not queued or self._queued_rows != batch_size:
                self._unqueue()
                self._queue(batch_size)
                self._queued_rows = batch_size
            (written, j), self._consumed = queued.popleft()
            yield written.batch(j)

    def _queue(self, batch_size: int) -> None:
        """Plan the next batches ahead while no segment is being read (see the class docstring), else
        plan and write the next batch. An error planning ahead rewinds and makes one batch the plain
        way, which raises it when it belongs to that batch."""
        if not any(t is not None for r in self.own.values() for _, t in r.segments):
            start, rows = {c: r.mark() for c, r in self.own.items()}, self.rows
            try:
                return self._queue_ahead(batch_size, ahead_batches(batch_size, self.config.seq_len))
            except Exception:
                self.rows = rows
                for c, reader in self.own.items():
                    reader.rewind(start[c])
        rows = self._next_rows(batch_size)
        parts: dict[int, tuple[PlannedRows, list[int]]] = {}
        for j, (*_, (plan, r)) in enumerate(rows):
            parts.setdefault(id(plan), (plan, [0] * len(plan.row_ptr[1:])))[1][r] = j
        written = _Written(interleave_rows([(plan, np.array(at)) for plan, at in parts.values()], len(rows)),
                           [s for _, s, _, _ in rows], np.array([g for g, *_ in rows], dtype=np.int64), batch_size,
                           self.config, np.array([seg for _, _, seg, _ in rows], dtype=np.int64))
        self._queued.append(((written, 0), None))  # handed out at once: no mark needed

    def _queue_ahead(self, batch_size: int, k: int) -> None:
        """`packing.PLAN_GROUPS` x k batches planned at once (each reader's streams in one call each),
        written k at a time when the first of them is asked for."""
        groups = packing.PLAN_GROUPS
        m = k * groups
        n, rows0 = m * batch_size, self.rows
        places = rows0 + self.rank + self.world * np.arange(n, dtype=np.int64)  # each row's global index
        parts, drawn, books = [], np.zeros(n, dtype=np.int64), {}
        batch_ends = np.arange(1, m + 1) * batch_size
        for c, reader in self.own.items():
            # the rows reader c makes (place % readers == c): every (readers / world)-th from the first
            step, off = self.readers // self.world, c - int(places[0])
            rows = np.arange(off // self.world % step, n, step) if off % self.world == 0 else np.zeros(0, np.int64)
            if len(rows) and reader.index + self.readers * reader.rows != places[rows[0]]:
                raise RuntimeError(f"reader {reader.index} is at row {reader.rows}, global row {places[rows[0]]} "
                                   "expected")
            reader_parts, drawn[rows], books[c] = reader.plan_ahead(len(rows), np.searchsorted(rows, batch_ends))
            parts += [(plan, rows[mine]) for plan, mine in reader_parts]
        self.rows = rows0 + n * self.world
        names = [self.sources[0].name] * n if len(self.sources) == 1 else \
            [self.sources[i].name for i in drawn.tolist()]
        plan = interleave_rows(parts, n)
        for g in range(groups):
            r0, r1 = g * k * batch_size, (g + 1) * k * batch_size
            group = _Written(PlannedRows(plan.sources, plan.pieces[plan.row_ptr[r0] : plan.row_ptr[r1]],
                                         plan.row_ptr[r0 : r1 + 1] - plan.row_ptr[r0]),
                             names[r0:r1], places[r0:r1], batch_size, self.config)
            for j in range(k):
                b = g * k + j
                self._queued.append(((group, j), (rows0 + (b + 1) * batch_size * self.world, books, b)))

    def _consumed_mark(self) -> _LoaderMark:
        """The mark after the last batch handed out (made from the readers' books when asked for)."""
        rows, books, b = self._consumed
        return _LoaderMark(rows, {c: book.mark(b) for c, book in books.items()})

    def _unqueue(self) -> None:
        """Drop the batches planned ahead and rewind every reader to the last one handed out."""
        if self._queued:
            self._queued.clear()
            mark = self._consumed_mark()
            self.rows = mark.rows
            for c, reader in self.own.items():
                reader.rewind(mark.readers[c])

    @property
    def skipped(self) -> int:
        """Samples this rank's readers skipped because a media segment is longer than a row."""
        if self._queued:
            return sum(int(m.counters[SKIPPED]) for r in self._consumed_mark().readers.values() for m in r.streams)
        return sum(s.state.skipped for r in self.own.values() for s in r.streams)

    @property
    def removed(self) -> int:
        """Samples this rank's readers left out because a followed snapshot deleted them."""
        if self._queued:
            return sum(int(m.counters[REMOVED]) for r in self._consumed_mark().readers.values()
                       for m in [*r.streams, *(t for t in r.segment_marks if t is not None)])
        return sum(s.state.removed for r in self.own.values()
                   for s in [*r.streams, *(t for _, t in r.segments if t is not None)])

    def state(self) -> LoaderState:
        """This rank's view: global rows, its own readers' states, the segments (after the last batch
        handed out)."""
        if self._queued:
            m = self._consumed_mark()
            return LoaderState(m.rows, {c: r.state_dict(m.readers[c]) for c, r in self.own.items()},
                               list(self.segments))
        return LoaderState(self.rows, {c: r.state_dict() for c, r in self.own.items()}, list(self.segments))

    def load(self, state: LoaderState) -> None:
        self._queued.clear()
        missing = sorted(set(self.own) - set(state.readers))
        if missing:
            raise ValueError(f"the stream state has no state for canonical readers {missing} (it was saved with "
                             f"another stream.readers): resume with the same stream.readers")
        extra = sorted(c for c in state.readers if not 0 <= c < self.readers)
        if extra:
            raise ValueError(f"the stream state has states of canonical readers {extra}, this run has "
                             f"{self.readers} (it was saved with another stream.readers): resume with the same "
                             "stream.readers")
        for c in self.own:
            made = int(state.readers[c]["rows"])
            if state.rows < 0 or made != max(0, -(-(state.rows - c) // self.readers)):
                raise ValueError(f"the stream state's canonical reader {c} made {made} rows, not its share of the "
                                 f"{state.rows} global rows consumed: the state is not one a loader saved")
        self.rows, self.segments = state.rows, list(state.segments)
        for c, reader in self.own.items():
            reader.load_state_dict(state.readers[c], self.segments)

    @staticmethod
    def merge(states: Sequence[LoaderState]) -> LoaderState:
        """One state from every rank's (the readers' union)."""
        readers: dict[int, dict] = {}
        for s in states:
            readers.update(s.readers)
        return LoaderState(states[0].rows, readers, list(states[0].segments))
