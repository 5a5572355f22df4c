"""Best-fit packing: media never crosses a row, exact resume of the packing window, fill ratio.

Samples are laid out by `tokenizers.sequence` (tests/multimodal_data.py). In the property test
every code of sample k carries k (text id k, visual code k, audio codes k), so a document run
of a row names its sample, and its cut points are checked against media spans computed here
from the shard's `segments` column, not from the packer's own bookkeeping.
"""

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_reference import reference_assemble, reference_choose_row
from multimodal_data import LAYOUT, MANIFEST, audio_sample, image_sample, text_sample, write_shard

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.contract import MODALITY_IDS, PAD_MODALITY
from tokenloom.datasets import StreamConfig, TokenStream
from tokenloom.datasets.layout import layout_table
from tokenloom.datasets.packing import gather
from tokenloom.datasets.planner import (
    COUNTERS,
    CURSOR,
    N_PEND,
    NEXT,
    PEND_COLUMNS,
    _cut,
    pending_at,
    plan_rows,
)
from tokenloom.datasets.stream import ROW_ID, EpochOrder, sample_positions
from tokenloom.model.unified import mask_indices
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, TextPart

IMAGE, AUDIO = MODALITY_IDS["image"], MODALITY_IDS["audio"]


def _marked_sample(k, kind, size, caption):
    """Sample k, every code of it carrying k: (kind, size) -> `<bos>... <eos>` by the shared layout."""
    parts = [TextPart(np.full(caption, k))]
    if kind == "image":
        h, w = size
        parts.insert(0, ImagePart(np.full((h, w), k)))
    elif kind == "audio":
        parts.insert(0, AudioPart(np.full((size[0], 2), k)))
    return LAYOUT.assemble(parts)


def _media_spans(segments):
    """[start, stop) positions of each image/audio segment, from the shard's segments (independent
    of the packer): an audio frame is one position, an h x w image is its start row and h rows."""
    spans, p = [], 0
    for seg in segments:
        if seg["modality"] == "image":
            h, w = seg["grid"]
            n = (h + 1) * w
        elif seg["modality"] == "audio":
            n = seg["grid"][0]
        else:
            n = seg["length"]
        if seg["modality"] != "text":
            spans.append((p, p + n))
        p += n
    return spans


def _sample_of(run_ids, run_mod):
    """Which marked sample a document run comes from: any text, visual or audio code names it."""
    for i, m in zip(run_ids, run_mod, strict=True):
        if m == IMAGE and i != ROW_ID:
            return int(i) - MANIFEST.visual.start
        if m == AUDIO:
            return int(i) - MANIFEST.audio[0].start
        if MANIFEST.text.start <= i < MANIFEST.text.stop:
            return int(i) - MANIFEST.text.start
    return None


sample_kinds = st.tuples(
    st.sampled_from(["text", "image", "audio"]),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),  # image h, w; audio frames = the first
    st.integers(1, 40),  # caption / transcript / text length
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(sample_kinds, min_size=2, max_size=40), seq_len=st.integers(8, 96),
       pack_window=st.integers(1, 24), audio_window=st.sampled_from([2, 4, 64]), seed=st.integers(0, 3))
def test_no_media_segment_is_split_across_rows(kinds, seq_len, pack_window, audio_window, seed):
    samples = [_marked_sample(k, kind, size, cap) for k, (kind, size, cap) in enumerate(kinds)]
    with tempfile.TemporaryDirectory() as tmp:
        shard = write_shard(Path(tmp) / "s.parquet", samples)
        stream = TokenStream([shard], StreamConfig(seq_len=seq_len, group_size=2, audio_window=audio_window,
                                                   seed=seed, pack_window=pack_window))
        fits = [all(b - a <= seq_len for a, b in _media_spans(s)) for _, s in samples]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not any(fits):
                with pytest.raises(ValueError, match="raise seq_len"):
                    stream.next_row()
                return
            rows = [stream.next_row() for _ in range(len(kinds) // 2 + 1)]
    reference = [sample_positions(t, s, 2, audio_window) for t, s in samples]
    spans = [_media_spans(s) for _, s in samples]
    for row in rows:
        assert row["ids"].shape == (seq_len, 2)
        mask_indices({k: torch.from_numpy(v)[None] for k, v in row.items()})  # FlashMask can express the row
        real = row["modality"] != PAD_MODALITY
        for doc in np.unique(row["doc_ids"][real]):
            at = np.flatnonzero(real & (row["doc_ids"] == doc))
            ids, mod, xyz = row["ids"][at, 0], row["modality"][at], row["coords"][at]
            if mod[0] not in (IMAGE, AUDIO) and mod[-1] not in (IMAGE, AUDIO):
                continue  # a run that starts and ends in text cannot cut a media segment
            k = _sample_of(ids, mod)
            assert k is not None, "a run of only an image's start row: the image was cut after it"
            start = int(np.flatnonzero((reference[k].coords == xyz[0]).all(1))[0])
            stop = start + len(at)
            np.testing.assert_array_equal(reference[k].ids[start:stop, 0], ids)
            for a, b in spans[k]:
                assert not a < start < b and not a < stop < b, f"sample {k} cut inside media [{a}, {b})"
            if reference[k].ends_row:  # windowed audio then its transcript: the row's last document
                assert doc == row["doc_ids"].max()
    # exactly the pulled samples whose media exceeds a row were skipped; they were pulled in the
    # epoch's seeded order (one file, one rank: the permuted rows of its only window)
    pulled = stream.state.cursor if stream.state.epoch == 0 else None
    if pulled is not None:
        order = EpochOrder([shard], seed, 0, StreamConfig().shuffle_window).windows[0][1]
        too_long = sum(any(b - a > seq_len for a, b in spans[k]) for k in order[:pulled])
        assert stream.state.skipped == too_long


def _mixed_files(tmp_path, n_files=3):
    rng = np.random.default_rng(5)
    files = []
    for f in range(n_files):
        samples = []
        for _ in range(9):
            kind = rng.integers(3)
            if kind == 0:
                samples.append(image_sample(rng, int(rng.integers(1, 6)), int(rng.integers(2, 7)), int(rng.integers(1, 9))))
            elif kind == 1:
                samples.append(audio_sample(rng, int(rng.integers(2, 20)), int(rng.integers(1, 6))))
            else:
                samples.append(text_sample(rng, int(rng.integers(3, 90))))
        files.append(write_shard(tmp_path / f"m{f}.parquet", samples))
    return files


def _batches(stream, n, bs=2):
    it = stream.batches(bs)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("pack_window", [1, 16])
def test_resume_equals_uninterrupted_with_the_packing_window(tmp_path, world, pack_window):
    files = _mixed_files(tmp_path)
    cfg = StreamConfig(seq_len=40, group_size=2, audio_window=4, seed=3, shuffle_window=2, pack_window=pack_window)
    for rank in range(world):
        expected = _batches(TokenStream(files, cfg, rank, world), 24)  # runs past the end of epoch 0
        for stop in (1, 7, 15):
            first = TokenStream(files, cfg, rank, world)
            _batches(first, stop)
            saved = first.state_dict()
            assert pack_window == 1 or len(saved["pending"]) >= pack_window // 2  # the state really holds the window
            resumed = TokenStream(files, cfg, rank, world)
            resumed.load_state_dict(saved)
            for want, got in zip(expected[stop:], _batches(resumed, 24 - stop), strict=True):
                assert want.keys() == got.keys()
                for key in want:
                    np.testing.assert_array_equal(want[key], got[key])


def test_state_from_the_chunk_packer_is_refused_with_a_reason(tmp_path):
    stream = TokenStream(_mixed_files(tmp_path, 1), StreamConfig(seq_len=40, group_size=2))
    with pytest.raises(ValueError, match="concatenate-and-chunk"):
        stream.load_state_dict({"epoch": 0, "cursor": 3, "offset": 5})
    with pytest.raises(ValueError, match="other data or stream settings"):
        stream.load_state_dict({"epoch": 0, "cursor": 0, "skipped": 0, "pending": [[0, 0, 0, 10_000]]})


def test_fill_ratio_of_hand_built_rows():
    rng = np.random.default_rng(0)
    seven, three = sample_positions(*text_sample(rng, 7), 2, 4), sample_positions(*text_sample(rng, 3), 2, 4)
    image = sample_positions(*image_sample(rng, h=2, w=3, caption=2), 2, 4)  # <bos><boi> (1+2)x3 <eoi> 2 <eos>
    assert len(image) == 15
    rows = [([seven], 8), ([three, three], 8), ([image, three], 20), ([seven], 7)]
    batches = [gather([[(s, 0, len(s)) for s in samples]], seq_len, 2) for samples, seq_len in rows]
    got = [float(b["fill_ratio"][0]) for b in batches]  # counted while placing the pieces
    assert got == [7 / 8, 6 / 8, 18 / 20, 1.0]
    assert (batches[2]["modality"] == PAD_MODALITY).sum() == 2


@pytest.mark.parametrize(("length", "seq_len", "want"), [(7, 8, 7 / 8), (3, 8, 6 / 8), (5, 10, 1.0)])
def test_stream_yields_the_batch_fill_ratio(tmp_path, length, seq_len, want):
    """Samples of one length, so the rows do not depend on the order: every row holds the same."""
    rng = np.random.default_rng(1)
    shard = write_shard(tmp_path / "t.parquet", [text_sample(rng, length) for _ in range(11)])
    batch = next(TokenStream([shard], StreamConfig(seq_len=seq_len, pack_window=8)).batches(4))
    assert batch["fill_ratio"].shape == (4,) and batch["fill_ratio"].dtype == np.float64
    np.testing.assert_allclose(batch["fill_ratio"], want)
    np.testing.assert_allclose(batch["fill_ratio"].mean(), (batch["modality"] != PAD_MODALITY).mean())


def test_long_sample_is_cut_only_in_text_and_oversized_media_is_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(2)
    long_text_image = LAYOUT.assemble([TextPart(rng.integers(0, 100, 30)), ImagePart(rng.integers(0, 100, (3, 4))),
                                       TextPart(rng.integers(0, 100, 30))])  # 32 + 16 + 32 = 80 positions
    huge_image = image_sample(rng, h=6, w=6)  # 42 image positions > 32
    shard = write_shard(tmp_path / "l.parquet", [long_text_image, huge_image])
    stream = TokenStream([shard], StreamConfig(seq_len=32, group_size=1, pack_window=4))
    with pytest.warns(UserWarning, match="stream.seq_len to at least 42"):
        rows = [stream.next_row() for _ in range(3)]
    assert stream.state.skipped >= 1  # the huge image sample was pulled and skipped
    # cut before and after the image (text only): three full rows, the whole (3 + 1) x 4 image in the middle one
    assert [int((r["modality"] == IMAGE).sum()) for r in rows] == [0, 16, 0]
    assert all((r["modality"] != PAD_MODALITY).all() for r in rows)
    assert [int(r["coords"][0, 0]) for r in rows] == [0, 32, 32 + max(3 + 1, 4) + 16]  # coordinates carry on


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), seq_len=st.integers(4, 64), refill=st.integers(1, 40))
def test_the_window_takes_the_rows_the_plain_scan_chooses(seed, seq_len, refill):
    """The compiled row rule (`planner.plan_rows`, one row per call: the table of pending pieces
    in stream order as it leaves it) against the plain scan over the pending pieces, with closing
    pieces and a window refilled to `refill` pieces before each row, as the stream refills it."""
    rng = np.random.default_rng(seed)
    n = 30 * 40 + 1  # samples of one piece each: more than 30 rows can pull
    lengths, closes = rng.integers(1, seq_len + 1, n), (rng.random(n) < 0.15).astype(np.int64)
    pend, counters = np.zeros((64, PEND_COLUMNS), dtype=np.int64), np.zeros(COUNTERS, dtype=np.int64)
    out, row_ptr, no_marks = np.zeros((64, 3), dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros(0, np.int64)
    pending, age = [], 0
    for _ in range(30):
        while len(pending) < refill:
            pending.append((age, int(lengths[age]), bool(closes[age])))
            age += 1
        want = [pending[k] for k in reference_choose_row([p[1] for p in pending], [p[2] for p in pending], seq_len)]
        made, _ = plan_rows(pend, counters, 1, refill, seq_len, True, 0, 0, 0, np.arange(n), closes,
                            np.zeros(n, np.int64), np.arange(n + 1), np.zeros(n, np.int64), lengths, n, out, row_ptr,
                            no_marks, np.zeros((0, PEND_COLUMNS), np.int64), no_marks, no_marks,
                            np.zeros((0, COUNTERS), np.int64))
        assert made == 1
        got = out[: row_ptr[1]]
        assert got[:, 2].tolist() == [w[1] for w in want]
        assert got[:, 1].tolist() == [w[0] for w in want]  # the very pieces, by position
        taken = {w[0] for w in want}
        pending = [p for p in pending if p[0] not in taken]
        assert pend[: counters[N_PEND], CURSOR].tolist() == [p[0] for p in pending]  # the rest, in stream order


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), seq_len=st.integers(4, 64), window=st.integers(1, 48), rows=st.integers(1, 90),
       room=st.integers(0, 40))
def test_many_rows_in_one_call_are_those_of_the_plain_scan(seed, seq_len, window, rows, room):
    """`plan_rows` plans many rows per call, leaving taken pieces in its table (the scans skip them)
    until 32 gather or the table is full (`room` spare slots): its rows are those of the plain scan
    over a window refilled one sample at a time before each row, the table it leaves holds the
    pending pieces in stream order, and each mark (the state after some of its rows) names the
    pending pieces (picked from the call's log) and the next sample at that row."""
    rng = np.random.default_rng(seed)
    n = 1000  # samples of one piece each, some closing their row
    lengths, closes = rng.integers(1, seq_len + 1, n), (rng.random(n) < 0.15).astype(np.int64)
    base = np.r_[0, np.cumsum(lengths)[:-1]]  # each sample's first position in the layout
    pend, counters = np.zeros((window + 1 + room, PEND_COLUMNS), dtype=np.int64), np.zeros(COUNTERS, dtype=np.int64)
    out, row_ptr = np.zeros((rows * seq_len, 3), dtype=np.int64), np.zeros(rows + 1, dtype=np.int64)
    marks_at = np.unique(rng.integers(1, rows + 1, 5))
    log = np.zeros((len(out) + len(pend), PEND_COLUMNS), dtype=np.int64)  # what the stream gives it
    taken, mark_log = np.zeros(len(log), dtype=np.int64), np.zeros(len(marks_at), dtype=np.int64)
    mark_counters = np.zeros((len(marks_at), COUNTERS), dtype=np.int64)
    made, reason = plan_rows(pend, counters, rows, window, seq_len, True, 0, 0, 7, base, closes, np.zeros(n, np.int64),
                             np.arange(n + 1), np.zeros(n, np.int64), lengths, n, out, row_ptr, marks_at, log, taken,
                             mark_log, mark_counters)
    assert made == rows
    pending, pulled = [], 0
    for r in range(rows):
        while len(pending) < window:  # the stream's refill: one sample at a time, before each row
            pending.append(pulled)
            pulled += 1
        pick = reference_choose_row([lengths[k] for k in pending], [bool(closes[k]) for k in pending], seq_len)
        want = [pending[i] for i in pick]
        got = out[row_ptr[r] : row_ptr[r + 1]]
        assert got[:, 1].tolist() == base[want].tolist() and got[:, 2].tolist() == lengths[want].tolist()
        assert (got[:, 0] == 7).all()
        pending = [k for k in pending if k not in want]
        m = np.searchsorted(marks_at, r + 1)
        if m < len(marks_at) and marks_at[m] == r + 1:
            assert mark_counters[m, N_PEND] == len(pending) and mark_counters[m, NEXT] == pulled
            assert pending_at(log, taken, mark_log[m], r + 1)[:, CURSOR].tolist() == pending
    assert counters[N_PEND] == len(pending) and pend[: len(pending), CURSOR].tolist() == pending


def test_a_long_sample_is_cut_as_late_as_the_row_allows_outside_its_media():
    """30 positions, an image at [8, 14), rows of 10: the first cut would fall inside the image and
    moves back to its start; the rest fall where the rows end. A media segment longer than a row
    cannot be placed (-1), nor can one that starts a piece and does not fit it."""
    start, stop = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
    media = np.array([[8, 14]], dtype=np.int64)
    n = _cut(30, media, 0, 1, 10, start, stop, 0, True)
    assert list(zip(start[:n].tolist(), stop[:n].tolist(), strict=True)) == [(0, 8), (8, 18), (18, 28), (28, 30)]
    assert _cut(30, np.array([[2, 15]], dtype=np.int64), 0, 1, 10, start, stop, 0, False) == -1
    assert _cut(9, media[:0], 0, 0, 10, start, stop, 0, True) == 1 and (start[0], stop[0]) == (0, 9)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 6))
def test_gather_builds_each_row_as_the_plain_assembly(seed, rows):
    """A batch of rows gathered at once, pieces of several samples and cut samples, equals the
    per-row assembly of the same pieces: from samples' written-out `Positions` (copied) and from a
    window's `Layout` (expanded from its segment table where the row needs them)."""
    rng = np.random.default_rng(seed)
    raw = [(image_sample(rng, int(rng.integers(1, 4)), int(rng.integers(1, 5)), 3),
            audio_sample(rng, int(rng.integers(2, 9))), text_sample(rng, int(rng.integers(3, 30))))
           [int(rng.integers(3))] for _ in range(8)]
    samples = [sample_positions(tokens, segments, 2, 4) for tokens, segments in raw]
    table = pa.table({"tokens": pa.array([t.tolist() for t, _ in raw], pa.list_(pa.int32())),
                      "segments": pa.array([s for _, s in raw], pa.list_(SEGMENT_TYPE))})
    layout = layout_table(table.column("tokens"), table.column("segments"), 2, 4)
    seq_len = 48
    plan, from_layout = [], []
    for _ in range(rows):
        row, room = [], seq_len
        for s in rng.permutation(len(samples))[: int(rng.integers(1, 4))]:
            a = int(rng.integers(0, len(samples[s])))
            b = min(len(samples[s]), a + room)
            if b > a and room:
                row.append((s, a, b))
                room -= b - a
        row = row or [(0, 0, min(len(samples[0]), seq_len))]
        plan.append([(samples[s], a, b) for s, a, b in row])
        from_layout.append([(layout, int(layout.offsets[s]) + a, int(layout.offsets[s]) + b) for s, a, b in row])
    batches = gather(plan, seq_len, 2), gather(from_layout, seq_len, 2)
    for r, row in enumerate(plan):
        want = reference_assemble([(s, slice(a, b)) for s, a, b in row], seq_len, 2)
        for batch in batches:
            for key, value in want.items():
                np.testing.assert_array_equal(batch[key][r], value, err_msg=key)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), parts=st.integers(1, 5), shared=st.booleans())
def test_interleaved_rows_are_each_part_row_at_its_place(seed, parts, shared):
    """The loader joins its readers' plans with `interleave_rows`: row i of a part becomes row at[i],
    with its pieces as they were (source objects kept, keys made unique across plans); a plan that
    places a row twice or leaves one out is refused."""
    from tokenloom.datasets.packing import PlannedRows, interleave_rows

    rng = np.random.default_rng(seed)
    layouts = [object() for _ in range(3)]
    sizes = rng.integers(0, 6, parts)
    sizes[0] += 1  # at least one row
    rows = int(sizes.sum())
    places = rng.permutation(rows)
    plans, want = [], {}
    for p, (n, at) in enumerate(zip(sizes, np.split(places, np.cumsum(sizes)[:-1]), strict=True)):
        keys = {10 * p + k: (layouts[0] if shared else layouts[k]) for k in range(1 if shared else 3)}
        counts = rng.integers(1, 4, n)
        pieces = np.stack([rng.choice(list(keys), counts.sum()), rng.integers(0, 99, counts.sum()),
                           rng.integers(1, 9, counts.sum())], axis=1) if n else np.zeros((0, 3), np.int64)
        lead = int(rng.integers(0, 3))  # a plan's rows may start past pieces of others (a slice of a plan)
        pieces = np.r_[np.full((lead, 3), 10 * p, dtype=np.int64), pieces.reshape(-1, 3)]
        row_ptr = lead + np.r_[0, np.cumsum(counts)].astype(np.int64)
        plans.append((PlannedRows(keys, pieces.astype(np.int64), row_ptr), at))
        for i, g in enumerate(at.tolist()):
            want[g] = [(keys[int(s)], int(a), int(b)) for s, a, b in pieces[row_ptr[i] : row_ptr[i + 1]]]
    got = interleave_rows(plans, rows)
    assert len(got.row_ptr) == rows + 1

    def source(key):  # one source: the pieces keep their plans' keys (`gather_planned` reads none)
        return got.sources[key] if len(got.sources) > 1 else next(iter(got.sources.values()))

    for g in range(rows):
        row = got.pieces[got.row_ptr[g] : got.row_ptr[g + 1]]
        assert [(source(int(s)), int(a), int(b)) for s, a, b in row] == want[g]
    assert len({id(v) for v in got.sources.values()}) == len(got.sources)  # one key per source object
    if rows > 1:
        twice = [(plan, at.copy()) for plan, at in plans]
        first = next(at for _, at in twice if len(at))
        first[0] = (first[0] + 1) % rows  # one row placed twice, another left out
        with pytest.raises(ValueError, match="every row once"):
            interleave_rows(twice, rows)
    with pytest.raises(ValueError, match="every row once"):
        interleave_rows(plans, rows + 1)
