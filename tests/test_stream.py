"""Loader: deterministic order, exact resume per rank, exactly-once coverage, packing."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.contract import IGNORE_INDEX, PAD_MODALITY
from tokenloom.datasets import ShardFile, StreamConfig, TokenStream


@pytest.fixture
def shard_files(tmp_path):
    """5 files of varied sizes; sample k holds tokens [1000*k+0, 1000*k+1, ...] so it is recognisable."""
    files, k = [], 0
    rng = np.random.default_rng(0)
    for f in range(5):
        rows = []
        for _ in range(int(rng.integers(3, 9))):
            rows.append(list(range(1000 * k, 1000 * k + int(rng.integers(2, 40)))))
            k += 1
        path = tmp_path / f"f{f}.parquet"
        pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), path)
        files.append(ShardFile(str(path), len(rows)))
    return files


def _take(stream, n):
    return [next(stream) for _ in range(n)]


def _batches(stream, n, bs=3):
    it = stream.batches(bs)
    return [next(it) for _ in range(n)]


def test_same_seed_same_order_other_seed_other_order(shard_files):
    cfg = StreamConfig(seq_len=16, seed=3)
    a = [r["ids"][:, 0] for r in _take(iter(TokenStream(shard_files, cfg)), 12)]
    b = [r["ids"][:, 0] for r in _take(iter(TokenStream(shard_files, cfg)), 12)]
    c = [r["ids"][:, 0] for r in _take(iter(TokenStream(shard_files, StreamConfig(seq_len=16, seed=4))), 12)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_equals_uninterrupted_per_rank(shard_files, world):
    cfg = StreamConfig(seq_len=12, seed=1, shuffle_window=2)
    for rank in range(world):
        straight = TokenStream(shard_files, cfg, rank, world)
        expected = _batches(straight, 9)
        first = TokenStream(shard_files, cfg, rank, world)
        _batches(first, 4)
        saved = first.state_dict()
        resumed = TokenStream(shard_files, cfg, rank, world)
        resumed.load_state_dict(saved)
        for want, got in zip(expected[4:], _batches(resumed, 5), strict=True):
            for key in want:
                np.testing.assert_array_equal(want[key], got[key])



def _edited(state, **changes):
    d = state.to_dict()
    d.update(changes)
    return d


def test_a_state_the_stream_cannot_have_made_is_refused_in_one_line(shard_files):
    """A checkpoint of other data or settings, or edited by hand: before, a negative cursor made the
    planner loop forever, a pending piece of a sample not yet pulled read that sample twice, and a
    sample out of range failed with a bare IndexError."""
    cfg = StreamConfig(seq_len=16, seed=2, shuffle_window=2)
    stream = TokenStream(shard_files, cfg, 0, 2)
    _batches(stream, 3)
    state = stream.state  # a real one, with pieces pending
    assert state.pending and state.cursor > 0
    per_epoch = stream.samples_per_epoch(0)
    p = state.pending[0]
    bad = {
        "cursor -1 (< 0)": _edited(state, cursor=-1),
        "epoch -2 (< 0)": _edited(state, epoch=-2),
        "skipped -1 (< 0)": _edited(state, skipped=-1),
        f"sample {per_epoch + 1} of epoch": _edited(state, cursor=per_epoch + 1),
        "does not have": _edited(state, pending=[[p.epoch, per_epoch, p.start, p.stop]]),
        "not yet pulled": _edited(state, pending=[[state.epoch, state.cursor, 0, 1]]),
        "out of stream order or overlapping": _edited(state, pending=[[p.epoch, p.cursor, p.start, p.stop]] * 2),
    }
    for words, d in bad.items():
        resumed = TokenStream(shard_files, cfg, 0, 2)
        with pytest.raises(ValueError, match=r"saved for other data or stream settings") as caught:
            resumed.load_state_dict(d)
        assert words in str(caught.value) and "\n" not in str(caught.value), (words, caught.value)
    resumed = TokenStream(shard_files, cfg, 0, 2)
    resumed.load_state_dict(state.to_dict())  # the real one still loads, and goes on as the stream did
    for want, got in zip(_batches(stream, 2), _batches(resumed, 2), strict=True):
        np.testing.assert_array_equal(want["ids"], got["ids"])


def _epoch_sample_firsts(files, world):
    """The first token of every sample each rank starts in epoch 0."""
    seen = []
    for rank in range(world):
        s = TokenStream(files, StreamConfig(seq_len=8, seed=7), rank, world)
        for cursor in range(s.samples_per_epoch(0)):
            seen.append(int(s._sample(0, cursor)[0]))
    return seen


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_sample_read_exactly_once_per_epoch(shard_files, world):
    firsts = _epoch_sample_firsts(shard_files, world)
    total = sum(f.num_rows for f in shard_files)
    assert sorted(firsts) == [1000 * k for k in range(total)]


def test_global_order_does_not_depend_on_world_size(shard_files):
    def global_order(world):
        streams = [TokenStream(shard_files, StreamConfig(seq_len=8, seed=7), r, world) for r in range(world)]
        total = sum(f.num_rows for f in shard_files)
        return [int(streams[i % world]._sample(0, i // world)[0]) for i in range(total)]

    assert global_order(1) == global_order(2) == global_order(3)


def test_packing_keeps_documents_apart(shard_files):
    row = next(iter(TokenStream(shard_files, StreamConfig(seq_len=64, seed=0))))
    ids, labels, docs, pos = row["ids"][:, 0], row["labels"][:, 0], row["doc_ids"], row["coords"][:, 0]
    real = int((row["modality"] != PAD_MODALITY).sum())
    assert (row["modality"][real:] == PAD_MODALITY).all()  # padding only at the end
    for i in range(real - 1):
        if docs[i + 1] == docs[i]:
            assert labels[i] == ids[i + 1]  # next token of the same sample
            assert pos[i + 1] == pos[i] + 1
        else:
            assert labels[i] == IGNORE_INDEX and pos[i + 1] == 0
    for doc in np.unique(docs[:real]):  # a document run is consecutive tokens of one sample
        run = ids[:real][docs[:real] == doc]
        assert np.all(run // 1000 == run[0] // 1000) and np.all(np.diff(run) == 1)
    assert len(np.unique(docs)) > 1  # the row really packs several samples


def test_rows_hold_every_pulled_position_exactly_once(shard_files):
    """Packed positions = the pulled samples' positions minus the packing window, each once."""
    stream = TokenStream(shard_files, StreamConfig(seq_len=10, seed=2, pack_window=6), rank=1, world_size=2)
    n = stream.samples_per_epoch(0)
    packed = []
    while True:
        row = next(iter(stream))
        packed += row["ids"][row["modality"] != PAD_MODALITY, 0].tolist()
        state = stream.state
        if state.cursor >= n - 2 or state.epoch > 0:
            break
    assert state.epoch == 0
    pulled = np.concatenate([stream._sample(0, c) for c in range(state.cursor)]).tolist()
    pending = [t for p in state.pending for t in stream._sample(0, p.cursor)[p.start : p.stop].tolist()]
    assert len(packed) == len(set(packed))  # every token id is unique in this data, so no repeats
    assert sorted(packed + pending) == sorted(pulled)
    assert state.skipped == 0


def test_bad_arguments(shard_files, tmp_path):
    with pytest.raises(ValueError, match="outside world size"):
        TokenStream(shard_files, StreamConfig(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="no samples"):
        TokenStream([], StreamConfig())
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    s = TokenStream([ShardFile(str(broken), 3)], StreamConfig(seq_len=4))
    with pytest.raises(OSError, match="broken.parquet"):
        next(iter(s))


def test_holdout_splits_are_disjoint_fixed_and_cover_every_sample(shard_files):
    def firsts(split, seed, world=1):
        out = []
        for rank in range(world):
            s = TokenStream(shard_files, StreamConfig(seq_len=8, seed=seed, holdout=0.3, split=split), rank, world)
            out += [int(s._sample(0, c)[0]) for c in range(s.samples_per_epoch(0))]
        return sorted(out)

    train, val = firsts("train", 0), firsts("val", 0)
    total = sum(f.num_rows for f in shard_files)
    assert not set(train) & set(val) and sorted(train + val) == [1000 * k for k in range(total)]
    assert 0.1 < len(val) / total < 0.5
    assert firsts("val", 5, world=2) == val  # the split does not move with the seed or the ranks
    with pytest.raises(ValueError, match="holdout"):
        TokenStream(shard_files, StreamConfig(split="val"))


def test_audio_sample_ends_its_row_so_the_mask_fits(tmp_path):
    import torch
    from multimodal_data import audio_sample, text_sample, write_shard

    from tokenloom.model.unified import mask_indices

    rng = np.random.default_rng(0)
    samples = [audio_sample(rng, frames=12) if k % 2 else text_sample(rng, 20) for k in range(12)]
    stream = TokenStream([write_shard(tmp_path / "a.parquet", samples)], StreamConfig(seq_len=48, group_size=2,
                                                                                     audio_window=4))
    seen_audio_frames = 0
    for row in (next(iter(stream)) for _ in range(12)):
        audio_docs = np.unique(row["doc_ids"][row["modality"] == 2])
        for doc in audio_docs:  # an audio sample with a transcript is the row's last sample
            assert doc == row["doc_ids"].max()
        seen_audio_frames += int((row["modality"] == 2).sum())
        mask_indices({k: torch.from_numpy(v)[None] for k, v in row.items()})  # two intervals per column suffice
        pad = row["modality"] == 3
        assert (row["labels"][pad] == IGNORE_INDEX).all()
        if pad.any():
            assert (row["attention"][pad] == 0).all() and len(np.unique(row["segment_ids"][pad])) == 1
    assert seen_audio_frames > 0


def test_reading_ahead_gives_the_same_rows_and_reads_in_the_background(shard_files, monkeypatch):
    """`stream.read_ahead` reads the next window of files (and the next epoch's first) in a
    background thread while this one's rows are packed: over two epochs the rows are those of a
    stream that reads each window when it needs it, and files were read on that thread."""
    from tokenloom.datasets import stream as stream_module

    threads = []

    class Recorded(pq.ParquetFile):
        def read(self, *a, **k):
            threads.append(threading.current_thread().name)
            return super().read(*a, **k)

    monkeypatch.setattr(pq, "ParquetFile", Recorded)
    runs = {}
    for ahead in (False, True):
        stream_module.forget_read_tables()
        threads.clear()
        cfg = StreamConfig(seq_len=16, seed=2, shuffle_window=2, read_ahead=ahead)  # 3 windows per epoch
        stream = TokenStream(shard_files, cfg)
        runs[ahead] = (_batches(stream, 30), list(threads), stream.state.epoch)
    (plain, plain_threads, plain_epoch), (ahead, ahead_threads, _) = runs[False], runs[True]
    assert plain_epoch >= 1  # two epochs at least
    for want, got in zip(plain, ahead, strict=True):
        for key in want:
            np.testing.assert_array_equal(want[key], got[key], err_msg=key)
    assert not any(name.startswith("tokenloom-read-ahead") for name in plain_threads)
    assert any(name.startswith("tokenloom-read-ahead") for name in ahead_threads)


def test_threads_reading_one_shard_decode_it_once(tmp_path, monkeypatch):
    """The shard and layout caches are shared by the read-ahead threads of every reader: threads
    asking for a shard being decoded wait for it instead of decoding it again, and a shard that
    cannot be read gives each of them the same one-line error."""
    from tokenloom.datasets import stream as stream_module

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3]] * 5, pa.list_(pa.int32()))}), path)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    decodes = []

    class Slow(pq.ParquetFile):
        def __init__(self, source, *a, **k):
            decodes.append(str(source))
            time.sleep(0.2)  # long enough that every thread asks while the first decodes
            super().__init__(source, *a, **k)

    monkeypatch.setattr(pq, "ParquetFile", Slow)
    stream_module.forget_read_tables()
    with ThreadPoolExecutor(4) as pool:
        shard = stream_module._file_key(str(path))
        tables = list(pool.map(stream_module._token_table, [shard] * 4))
        layouts = list(pool.map(lambda p: stream_module.read_layout([p], 1, 4), [str(path)] * 4))
        errors = list(pool.map(lambda k: _error_of(stream_module._token_table, k),
                               [stream_module._file_key(str(broken))] * 4))
    # one decode each, the broken file's too: the threads that waited for it got its error
    assert decodes == [str(path), str(broken)]
    assert all(t is tables[0] for t in tables) and all(x is layouts[0] for x in layouts)
    assert tables[0].column("tokens").to_pylist() == [[1, 2, 3]] * 5 and len(layouts[0]) == 5
    assert all(isinstance(e, OSError) and "cannot read token shard" in str(e) for e in errors)
    assert stream_module._RECENT.reading == {} and stream_module._LAYOUTS.reading == {}  # none left waiting
    stream_module.forget_read_tables()


def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def test_batches_planned_ahead_are_those_of_one_batch_at_a_time(tmp_path, monkeypatch):
    """`batches` plans and writes several batches at once and marks the planner after each (one
    compiled call for the rows, one for the positions): every batch and the state after it are
    those of planning one batch at a time, also when samples are excluded between two batches of a
    chunk, when the passes end inside one and when a state read inside one is resumed."""
    from multimodal_data import mixed_samples, write_shard

    from tokenloom.datasets import packing
    from tokenloom.datasets import stream as stream_module
    from tokenloom.datasets.stream import StreamExhausted

    files = [write_shard(tmp_path / f"m{f}.parquet", mixed_samples(seed=f, n=8), [f"m{f}-{k}" for k in range(24)])
             for f in range(3)]
    cfg = StreamConfig(seq_len=48, group_size=2, audio_window=4, seed=1, shuffle_window=2, pack_window=8)
    gathers = []
    real_gather = stream_module.gather_planned
    monkeypatch.setattr(stream_module, "gather_planned", lambda *a: gathers.append(1) or real_gather(*a))

    def run(ahead_positions):
        monkeypatch.setattr(packing, "AHEAD_POSITIONS", ahead_positions)
        gathers.clear()
        stream = TokenStream(files, cfg, passes=2)
        it, out, resumed = stream.batches(3), [], None
        for step in range(200):
            try:
                batch = next(it)
            except StreamExhausted:
                out.append((f"exhausted at {step}", stream.state))
                break
            out.append((batch, stream.state))
            if step == 5:
                stream.exclude([f"m1-{k}" for k in range(6)])
            if step == 10:
                resumed = TokenStream(files, cfg, passes=2, state=stream.state)
                resumed.exclude([f"m1-{k}" for k in range(6)])
                resumed = _batches(resumed, 6)
        return out, resumed, len(gathers)

    plain, plain_resumed, plain_gathers = run(1)
    ahead, ahead_resumed, ahead_gathers = run(48 * 3 * 4)  # 4 batches at a time
    assert plain[-1][0] == f"exhausted at {len(plain) - 1}" and len(plain) > 20, len(plain)
    assert ahead_gathers < plain_gathers / 2, "batches were not made ahead"
    assert len(ahead) == len(plain)
    for (want, want_state), (got, got_state) in zip(plain, ahead, strict=True):
        assert got_state == want_state
        if isinstance(want, str):
            assert got == want
            continue
        for key in want:
            np.testing.assert_array_equal(want[key], got[key], err_msg=key)
    for want, got, follows in zip(plain_resumed, ahead_resumed, plain[11:17], strict=True):
        for key in want:  # resumed from inside a chunk: the rows the uninterrupted stream gave
            np.testing.assert_array_equal(want[key], got[key], err_msg=key)
            np.testing.assert_array_equal(want[key], follows[0][key], err_msg=key)


def test_marks_of_one_plan_across_windows_name_the_states_of_planning_that_far(tmp_path):
    """`plan(rows, marks_at, marks)` records the planner after marks_at[m] rows; a plan that reads
    several windows of files records its marks from several compiled calls. Each mark names (and
    rewinds to) the state a stream planning exactly that many rows reaches."""
    from multimodal_data import mixed_samples, write_shard

    from tokenloom.datasets.stream import StreamMarks

    files = [write_shard(tmp_path / f"w{f}.parquet", mixed_samples(seed=f, n=4), [f"w{f}-{k}" for k in range(12)])
             for f in range(4)]
    cfg = StreamConfig(seq_len=48, group_size=2, audio_window=4, seed=2, shuffle_window=1, pack_window=4)
    rows = 60
    marks_at = np.array([1, 2, 5, 9, 17, 18, 25, 33, rows - 1, rows])
    stream, marks = TokenStream(files, cfg), StreamMarks()
    stream.plan(rows, marks_at, marks)
    assert len(marks) == len(marks_at)
    end = stream.state_at(marks[-1])
    assert (end.epoch, end.cursor) > (0, 24), "the plan should read several windows (one file each)"
    with pytest.raises(IndexError):
        marks[len(marks_at)]
    for m, at in enumerate(marks_at.tolist()):
        fresh = TokenStream(files, cfg)
        fresh.plan(at)
        assert stream.state_at(marks[m]) == fresh.state == stream.state_at(marks[m - len(marks_at)])
    stream.rewind(marks[3])  # back to after 9 rows: the next rows are those after 9 rows
    fresh = TokenStream(files, cfg)
    fresh.plan(9)
    want, got = fresh.plan(7), stream.plan(7)
    np.testing.assert_array_equal(want.row_ptr, got.row_ptr)
    assert [(want.sources[int(s)] is got.sources[int(t)], a, b) for (s, a, b), (t, _, _) in
            zip(want.pieces.tolist(), got.pieces.tolist(), strict=True)] == \
        [(True, a, b) for _, a, b in want.pieces.tolist()]
