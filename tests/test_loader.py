"""The training loader: canonical readers (any world size resumes exactly), mixtures, follow segments.

Rows are compared by their bytes (ids and labels); samples are marked (every text id of sample k of
file f is a known id), so "exactly once" is counted from the rows themselves, not from the loader's
bookkeeping.
"""

import zlib
from dataclasses import replace

import numpy as np
import pytest
from multimodal_data import LAYOUT, MANIFEST, write_shard

from tokenloom.datasets import StreamConfig, TokenStream
from tokenloom.datasets.loader import Loader, LoaderState, Source, draw_sources, parse_mix
from tokenloom.datasets.stream import StreamExhausted
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, TextPart

CFG = StreamConfig(seq_len=48, group_size=2, audio_window=4, seed=3, shuffle_window=2, pack_window=8, readers=4)


MARKS = 7  # the last 7 text ids mark the samples of a followed snapshot; the other data never uses them


def _text(rng, n):
    return TextPart(rng.integers(0, MANIFEST.text.size - MARKS, n))


def _files(tmp_path, prefix="m", n_files=3, per_file=12, seed=5):
    rng = np.random.default_rng(seed)
    files = []
    for f in range(n_files):
        samples = []
        for _ in range(per_file):
            kind = rng.integers(3)
            if kind == 0:
                image = ImagePart(rng.integers(0, MANIFEST.visual.size, (int(rng.integers(1, 5)), int(rng.integers(2, 6)))))
                samples.append(LAYOUT.assemble([image, _text(rng, 3)]))
            elif kind == 1:
                samples.append(LAYOUT.assemble([AudioPart(rng.integers(0, 50, (int(rng.integers(2, 12)), 2))),
                                                _text(rng, 3)]))
            else:
                samples.append(LAYOUT.assemble([_text(rng, int(rng.integers(1, 68)))]))
        files.append(write_shard(tmp_path / f"{prefix}{f}.parquet", samples,
                                 [f"{prefix}{f}-{k}" for k in range(len(samples))]))
    return files


def _crc(batch, i):
    return zlib.crc32(batch["ids"][i].tobytes() + batch["labels"][i].tobytes())


def _global_rows(loaders, batch_size, steps):
    """{global row: crc} over `steps` steps of every rank's loader (stepping together)."""
    out = {}
    its = [ld.batches(batch_size) for ld in loaders]
    for _ in range(steps):
        for it in its:
            b = next(it)
            for i, g in enumerate(b["row"]):
                assert int(g) not in out
                out[int(g)] = _crc(b, i)
    return out


def _rank_loaders(sources, world, state=None, cfg=CFG):
    return [Loader(sources, cfg, cfg.readers, r, world, state=state) for r in range(world)]


def test_rows_are_the_same_for_every_world_size_dividing_the_readers(tmp_path):
    sources = [Source("d", tuple(_files(tmp_path)))]
    one = _global_rows(_rank_loaders(sources, 1), 4, 10)  # 40 rows
    two = _global_rows(_rank_loaders(sources, 2), 2, 10)  # 2 ranks x 2 rows per step: the same 40 rows
    four = _global_rows(_rank_loaders(sources, 4), 1, 10)
    assert sorted(one) == list(range(40))
    assert one == two == four
    assert len(set(one.values())) > 30, "rows differ from one another"
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        Loader(sources, CFG, 4, 0, 3)


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_a_state_saved_on_w_ranks_resumes_on_another_number_exactly(tmp_path, saved_world, resumed_world):
    sources = [Source("d", tuple(_files(tmp_path)))]
    rows_per_step = 4
    expected = _global_rows(_rank_loaders(sources, 1), rows_per_step, 14)  # runs into the second epoch
    first = _rank_loaders(sources, saved_world)
    got = _global_rows(first, rows_per_step // saved_world, 5)
    state = Loader.merge([ld.state() for ld in first])
    state = LoaderState.from_dict(state.to_dict())  # through the checkpoint's JSON form
    resumed = _rank_loaders(sources, resumed_world, state)
    got.update(_global_rows(resumed, rows_per_step // resumed_world, 9))
    assert got == expected


def test_a_state_of_other_readers_is_refused(tmp_path):
    sources = [Source("d", tuple(_files(tmp_path)))]
    state = Loader(sources, CFG, 4).state()
    with pytest.raises(ValueError, match="same stream.readers"):
        Loader(sources, StreamConfig(**{**CFG.__dict__, "readers": 8}), 8, state=state)
    with pytest.raises(ValueError, match="predates canonical readers"):
        LoaderState.from_dict({"epoch": 0, "cursor": 3, "pending": []})
    loader = Loader(sources, CFG, 8, state=None)  # 8 canonical readers, then resumed with 4 of them
    batches = loader.batches(4)
    next(batches)
    with pytest.raises(ValueError, match=r"readers \[4, 5, 6, 7\], this run has 4"):
        Loader(sources, CFG, 4, state=loader.state())
    moved = loader.state()
    moved.readers[1]["rows"] += 1  # a reader's rows that are not its share of the global rows
    with pytest.raises(ValueError, match="canonical reader 1 made 2 rows, not its share of the 4 global rows"):
        Loader(sources, replace(CFG, readers=8), 8, state=moved)


def test_mixture_draws_follow_the_weights():
    drawn = np.concatenate([draw_sources([0.7, 0.3], 11, 0, c, np.arange(2500)) for c in range(4)])
    assert len(drawn) == 10_000
    assert abs(np.mean(drawn == 0) - 0.7) < 0.02
    again = draw_sources([0.7, 0.3], 11, 0, 2, np.arange(2500))
    np.testing.assert_array_equal(again, drawn[5000:7500])  # a pure function of (seed, stage, reader, row)
    assert parse_mix("a=0.7, b=0.3") == [("a", 0.7), ("b", 0.3)]
    for bad in ("a", "a=0", "a=x", "a=1,a=2"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_a_mixture_streams_each_source_by_its_weight_and_resumes_every_cursor(tmp_path):
    a = Source("a", tuple(_files(tmp_path, "a", seed=1)), 0.75)
    b = Source("b", tuple(_files(tmp_path, "b", seed=2)), 0.25)
    loader = Loader([a, b], CFG, 4)
    it = loader.batches(8)
    batches = [next(it) for _ in range(100)]
    sources = np.array([s for batch in batches for s in batch["source"]])
    assert abs(np.mean(sources == "a") - 0.75) < 0.04  # 800 rows
    # the state holds each reader's cursor in each source: a resumed mixture continues exactly
    first = Loader([a, b], CFG, 4)
    it = first.batches(8)
    for _ in range(37):
        next(it)
    resumed = Loader([a, b], CFG, 4, state=LoaderState.from_dict(first.state().to_dict()))
    for want, got in zip(batches[37:60], [b for _, b in zip(range(23), resumed.batches(8), strict=False)],
                         strict=True):
        assert list(want["source"]) == list(got["source"])
        np.testing.assert_array_equal(want["ids"], got["ids"])


def _marked(tmp_path, n=9):
    """A shard whose sample k is k + 3 copies of one of the marking text ids."""
    samples = [LAYOUT.assemble([TextPart(np.full(k + 3, MANIFEST.text.size - 1 - (k % MARKS)))]) for k in range(n)]
    shard = write_shard(tmp_path / "new.parquet", samples)
    return shard, sum(k + 3 for k in range(n))


def _marked_count(batch):
    ids = batch["ids"][..., 0]
    return int(((ids >= MANIFEST.text.stop - MARKS) & (ids < MANIFEST.text.stop)).sum())


def test_a_followed_snapshot_is_read_once_from_the_next_row_and_resumes(tmp_path):
    base = tuple(_files(tmp_path, seed=8))
    base_marked = sum(_marked_count(b) for b in [next(Loader([Source("d", base)], CFG, 4).batches(40))])
    assert base_marked == 0, "the base data holds none of the marked ids"
    shard, marked_tokens = _marked(tmp_path)
    plain = Loader([Source("d", base)], CFG, 4)
    plain_rows = [next(plain.batches(2)) for _ in range(3)]
    loader = Loader([Source("d", base)], CFG, 4)
    it = loader.batches(2)
    before = [next(it) for _ in range(3)]
    for want, got in zip(plain_rows, before, strict=True):  # what was seen never changes
        np.testing.assert_array_equal(want["ids"], got["ids"])
    segment = loader.follow("d", 42, [shard])
    assert segment.from_row == 6
    after = [next(it) for _ in range(40)]
    assert sum(_marked_count(b) for b in after) == marked_tokens, "every sample of the snapshot exactly once"
    marked_rows = [int(g) for b in after for i, g in enumerate(b["row"]) if _marked_count({"ids": b["ids"][i]})]
    assert marked_rows and min(marked_rows) >= 6
    # resumed in the middle of the segment: the same rows as without the interruption
    again = Loader([Source("d", base)], CFG, 4)
    it2 = again.batches(2)
    for _ in range(3):
        next(it2)
    again.follow("d", 42, [shard])
    for _ in range(2):
        next(it2)
    resumed = Loader([Source("d", base)], CFG, 4, state=LoaderState.from_dict(again.state().to_dict()))
    it3 = resumed.batches(2)
    for want, got in zip(after[2:12], [next(it3) for _ in range(10)], strict=True):
        np.testing.assert_array_equal(want["ids"], got["ids"])


def test_samples_a_followed_snapshot_deleted_are_not_read_again_and_its_new_rows_are(tmp_path):
    """A snapshot replaced a file: its 8 old samples (marked OLD) are deleted and 4 new ones (NEW)
    reuse 4 of their ids. Once the rows pulled before the follow are out, no row holds an OLD
    token again, over several epochs (without the deletion they keep coming back); every NEW
    sample is read exactly once; a state saved after the follow resumes to the same rows."""
    old_id, new_id = MANIFEST.text.size - 1, MANIFEST.text.size - 2
    base = tuple(_files(tmp_path, seed=8)) + (write_shard(
        tmp_path / "doc-v1.parquet", [LAYOUT.assemble([TextPart(np.full(k + 3, old_id))]) for k in range(8)],
        [f"doc-{k}" for k in range(8)]),)
    replaced = write_shard(tmp_path / "doc-v2.parquet",
                           [LAYOUT.assemble([TextPart(np.full(k + 5, new_id))]) for k in range(4)],
                           [f"doc-{k}" for k in range(4)])

    def count(batch, local):  # positions holding this text id (rows hold unified ids)
        return int((batch["ids"][..., 0] == MANIFEST.text.start + local).sum())

    def run(deleted, steps=60):
        loader = Loader([Source("d", base)], CFG, 4)
        it = loader.batches(2)
        before = [next(it) for _ in range(3)]
        segment = loader.follow("d", 7, [replaced], deleted)
        return loader, it, before, [next(it) for _ in range(steps)], segment

    control = run(())[3]
    loader, it, before, after, segment = run([f"doc-{k}" for k in range(8)])
    assert segment.deleted == tuple(f"doc-{k}" for k in range(8)) and segment.from_row == 6
    drained = CFG.pack_window * 2  # a reader's pulled pieces are packed within pack_window of its rows
    assert sum(count(b, old_id) for b in control[drained:]) > 0, "without the deletion OLD samples come back"
    assert sum(count(b, old_id) for b in after[drained:]) == 0, "deleted samples are never read again"
    assert sum(count(b, new_id) for b in after) == sum(k + 5 for k in range(4)), "new rows once, ids reused or not"
    assert loader.removed > 0
    # resumed from a state saved after the follow: the same rows
    state = LoaderState.from_dict(loader.state().to_dict())
    assert state.segments[0].deleted == segment.deleted
    resumed = Loader([Source("d", base)], CFG, 4, state=state).batches(2)
    rest = [next(it) for _ in range(12)]
    for want, got in zip(rest, [next(resumed) for _ in range(12)], strict=True):
        np.testing.assert_array_equal(want["ids"], got["ids"])
    # a snapshot that only deleted is a segment too; one that did neither is none
    only = Loader([Source("d", base)], CFG, 4)
    assert only.follow("d", 8, [], ["doc-0"]).files == () and only.follow("d", 9, []) is None
    next(only.batches(2))


def test_a_one_pass_stream_ends_and_may_be_empty_for_a_rank(tmp_path):
    shard, marked_tokens = _marked(tmp_path, n=3)
    stream = TokenStream([shard], StreamConfig(seq_len=16, group_size=1), passes=1)
    rows = []
    with pytest.raises(StreamExhausted):
        while True:
            rows.append(stream.next_row())
    assert sum(_marked_count(r) for r in rows) == marked_tokens
    empty = TokenStream([shard], StreamConfig(seq_len=16, group_size=1), rank=3, world_size=4, passes=1)
    with pytest.raises(StreamExhausted):
        empty.next_row()


def test_a_stream_whose_every_sample_was_deleted_packs_what_is_pending_then_says_so(tmp_path):
    """Every sample of a stream excluded after a row: the pieces already pulled are still packed
    (what was pulled stays), then a one-line error names the deletion; it never spins."""
    from tokenloom.datasets.stream import NoSampleFits

    shard = write_shard(tmp_path / "only.parquet", [LAYOUT.assemble([TextPart(np.arange(k + 3))]) for k in range(6)],
                        [f"s-{k}" for k in range(6)])
    stream = TokenStream([shard], StreamConfig(seq_len=16, group_size=1, pack_window=8))
    stream.next_row()
    pending = len(stream.state.pending)
    assert pending > 0
    stream.exclude([f"s-{k}" for k in range(6)])
    rows = 0
    with pytest.raises(NoSampleFits, match="deleted by a later snapshot"):
        while rows < 50:
            stream.next_row()
            rows += 1
    assert 1 <= rows <= pending and stream.state.removed > 0


def test_a_later_snapshot_deleting_rows_of_a_segment_still_being_read_stops_them(tmp_path):
    """Snapshot 7 adds 48 marked samples (12 per canonical reader); after one batch (two readers
    have pulled a packing window of 8 each), snapshot 8 deletes them all: exactly what was pulled
    before the deletion is trained (2 x 8 samples of 3 marked tokens), nothing after."""
    new_id = MANIFEST.text.size - 3
    base = tuple(_files(tmp_path, seed=9))
    added = write_shard(tmp_path / "added.parquet", [LAYOUT.assemble([TextPart(np.full(3, new_id))])] * 48,
                        [f"n-{k}" for k in range(48)])
    loader = Loader([Source("d", base)], CFG, 4)
    it = loader.batches(2)
    for _ in range(3):
        next(it)
    loader.follow("d", 7, [added])
    first = next(it)  # global rows 6 and 7: readers 2 and 3 start the segment
    loader.follow("d", 8, [], [f"n-{k}" for k in range(48)])
    rest = [next(it) for _ in range(30)]
    marked = sum(int((b["ids"][..., 0] == MANIFEST.text.start + new_id).sum()) for b in [first, *rest])
    assert marked == 2 * CFG.pack_window * 3


def test_the_canonical_readers_decode_each_file_once(tmp_path, monkeypatch):
    """Four readers read the same windows of files, each taking its share of the rows: each file is
    decoded once for all of them (the stream keeps the last shards read), and a file rewritten at the
    same path is decoded again, never served from the old read."""
    import pyarrow.parquet as pq

    from tokenloom.datasets import stream as stream_module

    stream_module.forget_read_tables()
    reads = []

    class Recorded(pq.ParquetFile):
        def __init__(self, source, *a, **k):
            reads.append(str(source))
            super().__init__(source, *a, **k)

    monkeypatch.setattr(pq, "ParquetFile", Recorded)
    files = _files(tmp_path, n_files=4, per_file=12)
    cfg = StreamConfig(seq_len=64, group_size=2, audio_window=4, shuffle_window=2)
    loader = Loader([Source("m", tuple(files))], cfg, readers=4)
    batches = loader.batches(4)
    for _ in range(12):  # past the end of the first epoch of every reader
        next(batches)
    assert sorted(reads) == sorted(str(f.path) for f in files)
    before = [_crc(next(Loader([Source("m", tuple(files))], cfg, readers=4).batches(4)), i) for i in range(4)]
    rewritten = _files(tmp_path, n_files=4, per_file=12, seed=6)  # same paths, other samples
    after = [_crc(next(Loader([Source("m", tuple(rewritten))], cfg, readers=4).batches(4)), i) for i in range(4)]
    assert len(reads) > len(files) and after != before


def test_the_canonical_readers_read_each_window_ahead_once(tmp_path, monkeypatch):
    """Four readers each read ahead the window after theirs, the same window for all of them: it
    is read in the background once for all of them (one task per window, not one per reader: each
    costs the packer a thread hand-off), and the rows are those of reading each window when needed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tokenloom.datasets import stream as stream_module

    tasks = []
    submit = ThreadPoolExecutor.submit

    def recorded(self, fn, /, *args, **kwargs):
        def run(*a, **k):
            tasks.append(threading.current_thread().name)
            return fn(*a, **k)
        return submit(self, run, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", recorded)
    files = _files(tmp_path, n_files=4, per_file=12)
    cfg = StreamConfig(seq_len=64, group_size=2, audio_window=4, shuffle_window=2)  # 2 windows per epoch
    rows = {}
    for ahead in (True, False):
        stream_module.forget_read_tables()
        tasks.clear()
        loader = Loader([Source("m", tuple(files))], replace(cfg, read_ahead=ahead), readers=4)
        batches = loader.batches(4)
        rows[ahead] = [_crc(next(batches), i) for _ in range(30) for i in range(4)]
        epochs = max(r["sources"]["m"]["epoch"] for r in loader.state().readers.values())
        ahead_tasks = sum(name.startswith("tokenloom-read-ahead") for name in tasks)
        if ahead:
            # windows reached: 2 per epoch begun, and the next one read ahead
            assert 1 <= ahead_tasks <= 2 * (epochs + 1) + 1 and epochs >= 1
        else:
            assert ahead_tasks == 0
    assert rows[True] == rows[False]


@pytest.mark.parametrize("world", [1, 2])
def test_prefetch_reads_the_first_windows_before_the_first_batch(tmp_path, world):
    """`Loader.prefetch` (what the trainer calls before building its model and engine) reads the
    window of files each of the rank's readers starts with: once its reads are done, the files can
    be gone and the first batch is still made, the same as without prefetching. Without it, the
    first batch is where the files are read, and that fails when they are gone."""
    from pathlib import Path

    from tokenloom.datasets.stream import forget_read_tables

    files = _files(tmp_path, n_files=4, per_file=40)  # 2 windows of 2 files per epoch, 20 samples per reader
    sources = [Source("d", tuple(files))]
    forget_read_tables()
    want = [next(ld.batches(2)) for ld in _rank_loaders(sources, world)]
    forget_read_tables()
    loaders = _rank_loaders(sources, world)
    futures = [f for ld in loaders for f in ld.prefetch()]
    assert futures, "nothing was read ahead"
    for f in futures:
        f.result()
    gone = tmp_path / "gone"
    gone.mkdir()
    for f in files:
        Path(f.path).rename(gone / Path(f.path).name)
    got = [next(ld.batches(2)) for ld in loaders]
    for w, g in zip(want, got, strict=True):
        assert [_crc(g, i) for i in range(2)] == [_crc(w, i) for i in range(2)]
        assert list(g["row"]) == list(w["row"])
    forget_read_tables()
    with pytest.raises(OSError, match="cannot read token shard"):
        next(_rank_loaders(sources, world)[0].batches(2))


@pytest.mark.parametrize("world", [1, 2])
def test_batches_planned_ahead_are_those_of_one_batch_at_a_time(tmp_path, monkeypatch, world):
    """The loader plans and writes several batches at once (each reader's streams in one call that
    marks them after every batch): every rank's batches, its state, `skipped` and `removed` after
    each are those of one batch at a time, for a mixture, across a followed snapshot that adds and
    deletes samples between two batches of a chunk, and resumed from a state read inside one."""
    from tokenloom.datasets import loader as loader_module
    from tokenloom.datasets import packing

    a, b = tuple(_files(tmp_path, "a", seed=8)), tuple(_files(tmp_path, "b", seed=9))
    new, marked = _marked(tmp_path)
    sources = [Source("a", a, 0.7), Source("b", b, 0.3)]
    gathers = []
    real_gather = loader_module.gather_planned
    monkeypatch.setattr(loader_module, "gather_planned", lambda *a: gathers.append(1) or real_gather(*a))

    def run(ahead_positions, plan_groups):
        monkeypatch.setattr(packing, "AHEAD_POSITIONS", ahead_positions)
        monkeypatch.setattr(packing, "PLAN_GROUPS", plan_groups)
        gathers.clear()
        loaders = _rank_loaders(sources, world)
        its, out = [ld.batches(2) for ld in loaders], []
        for step in range(40):
            if step == 6:
                for ld in loaders:
                    ld.follow("a", 7, [new], ["a0-1", "a0-2", "a2-5"])
            if step == 25:  # resumed from the state after step 24's batches
                state = Loader.merge([ld.state() for ld in loaders])
                loaders = _rank_loaders(sources, world, LoaderState.from_dict(state.to_dict()))
                its = [ld.batches(2) for ld in loaders]
            for ld, it in zip(loaders, its, strict=True):
                out.append((next(it), ld.state().to_dict(), ld.skipped, ld.removed))
        return out, len(gathers)

    plain, plain_gathers = run(1, 1)  # one batch at a time
    ahead, ahead_gathers = run(48 * 2 * 4, 3)  # 12 batches planned at a time, written 4 at a time
    assert ahead_gathers < plain_gathers * 0.75, "batches were not made ahead"
    assert sum(_marked_count(batch) for batch, *_ in plain) == marked  # the followed rows, once
    for (want, *want_state), (got, *got_state) in zip(plain, ahead, strict=True):
        assert got_state == want_state
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(want[key], got[key], err_msg=key)
