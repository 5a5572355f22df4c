"""The whole-array layout against the one-sample-at-a-time loop it replaced (tests/layout_reference.py).

Samples of every kind (images of many shapes, audio of 1..3 levels in groups of 3, windowed and
overridden attention, text, samples with no segments, an image right after another) are laid
out together from an Arrow table, and every sample must equal the loop's layout of it alone:
the cross-sample offsets, running sums and target shifts are where a vectorized layout breaks.
"""

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import reference_positions
from multimodal_data import LAYOUT, MANIFEST

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.datasets.layout import layout_chunks, layout_table, sample_positions
from tokenloom.datasets.stream import read_layout
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, TextPart

GROUP = 3
KEYS = ("ids", "labels", "modality", "target", "coords", "segment", "attention", "window")


def _sample(rng, kind: int):
    text = lambda n: TextPart(rng.integers(0, MANIFEST.text.size, n))  # noqa: E731
    image = lambda: ImagePart(rng.integers(0, MANIFEST.visual.size, tuple(rng.integers(1, 6, 2))))  # noqa: E731
    audio = lambda: AudioPart(rng.integers(0, 50, (int(rng.integers(1, 14)), 2)))  # noqa: E731
    if kind == 0:
        return LAYOUT.assemble([text(int(rng.integers(0, 30)))])
    if kind == 1:
        return LAYOUT.assemble([image(), text(int(rng.integers(0, 6)))])
    if kind == 2:
        return LAYOUT.assemble([audio(), text(int(rng.integers(0, 6)))])
    if kind == 3:
        return LAYOUT.assemble([text(3), image(), image(), audio(), text(2)])
    if kind == 4:  # hand-made segments: audio of 1 or 3 levels, attention given explicitly
        levels, frames = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        tokens = rng.integers(16, 300, 2 + levels * frames + 3).astype(np.int32)
        segments = [{"modality": "text", "start": 0, "length": 2, "grid": [], "attention": "bidirectional"},
                    {"modality": "audio", "start": 2, "length": levels * frames, "grid": [frames, levels],
                     "attention": "window" if rng.random() < 0.7 else "causal"},
                    {"modality": "text", "start": 2 + levels * frames, "length": 3, "grid": None, "attention": None}]
        return tokens, segments
    tokens = rng.integers(16, 200, int(rng.integers(1, 20))).astype(np.int32)
    return tokens, (None if kind == 5 else [])  # no segments (null, or an empty list): all text


def _check(got, want):
    for key in KEYS:
        np.testing.assert_array_equal(getattr(got, key), want[key], err_msg=key)
    assert got.ends_row == want["ends_row"]
    assert got.media == [(int(a), int(b)) for a, b in want["media"]]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 25), window=st.integers(1, 8))
def test_a_table_of_samples_lays_out_as_each_sample_alone(seed, n, window):
    rng = np.random.default_rng(seed)
    samples = [_sample(rng, int(rng.integers(0, 6))) for _ in range(n)]
    table = pa.table({"tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
                      "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE))})
    cut = int(rng.integers(0, n))  # a sliced table: Arrow offsets that do not start at zero
    layout = layout_table(table.column("tokens").slice(cut), table.column("segments").slice(cut), GROUP, window)
    assert len(layout) == n - cut
    for i, (tokens, segments) in enumerate(samples[cut:]):
        want = reference_positions(tokens, segments, GROUP, window)
        _check(layout.sample(i), want)
        _check(sample_positions(tokens, segments, GROUP, window), want)
        np.testing.assert_array_equal(layout.sample_tokens(i), tokens)


LAYOUT_ARRAYS = ("segments", "sample_segments", "offsets", "ends_row", "media_offsets", "media", "tokens",
                 "token_offsets")


def _plain(segments) -> bool:
    """A sample in the form shard writers give it (what `layout_chunks` reads from the buffers)."""
    return bool(segments) and all(s.get("grid") is not None for s in segments)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 25), window=st.integers(1, 8), chunks=st.integers(1, 4))
def test_chunks_read_from_their_arrow_buffers_lay_out_as_through_pyarrow(seed, n, window, chunks):
    """Samples of every kind (writers' plain form, explicit attention, none or null where the
    contract allows it, no segments, an empty segment list), cut into chunks that are slices of one
    table (offsets that do not start at zero, children shared): the buffers' layout equals
    `layout_table`'s, array by array, whenever the chunks are plain, and is refused (None) when a
    chunk is not."""
    rng = np.random.default_rng(seed)
    samples = [_sample(rng, int(rng.integers(0, 7))) for _ in range(n)]
    if rng.random() < 0.7:  # mostly the writers' form (as shards are): a segment each, every grid a list
        samples = [(t, [{**x, "grid": x.get("grid") or []} for x in s]) for t, s in
                   (_sample(rng, int(rng.integers(0, 5))) for _ in range(n))]
    table = pa.table({"tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
                      "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE))})
    cut = int(rng.integers(0, n))
    bounds = [cut, *sorted(int(b) for b in rng.integers(cut, n + 1, chunks - 1)), n]
    parts = [table.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    pairs = [(p.column("tokens").chunk(0), p.column("segments").chunk(0)) for p in parts]
    got = layout_chunks(pairs, GROUP, window)
    if all(_plain(segments) for _, segments in samples):
        assert got is not None
    if not all(_plain(segments) for _, segments in samples[cut:]):
        assert got is None
    if got is not None:
        want = layout_table(pa.chunked_array([t for t, _ in pairs]), pa.chunked_array([s for _, s in pairs]), GROUP,
                            window)
        for name in LAYOUT_ARRAYS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_window_that_is_not_plain_is_read_through_pyarrow_with_its_errors(tmp_path):
    """A shard whose samples are not all in the writers' plain form (here one without segments) is
    laid out all the same; an unknown modality is the same one-line error either way."""
    rng = np.random.default_rng(4)
    samples = [_sample(rng, kind) for kind in (0, 1, 2, 5)]
    path = tmp_path / "mixed.parquet"
    pa.parquet.write_table(pa.table({"tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
                                     "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE))}), path)
    layout = read_layout([str(path)], GROUP, 4)
    for i, (tokens, segments) in enumerate(samples):
        _check(layout.sample(i), reference_positions(tokens, segments, GROUP, 4))
    bad = tmp_path / "video.parquet"
    pa.parquet.write_table(pa.table({"tokens": pa.array([list(range(20, 32))], pa.list_(pa.int32())),
                                     "segments": pa.array([[{"modality": "video", "start": 0, "length": 12,
                                                             "grid": [], "attention": None}]],
                                                          pa.list_(SEGMENT_TYPE))}), bad)
    with pytest.raises(ValueError, match="unknown segment modality 'video'"):
        read_layout([str(bad)], 1, 4)
    text = {"modality": "text", "start": 0, "length": 3, "grid": [], "attention": None}
    tokens_type, segments_type = pa.list_(pa.int32()), pa.list_(SEGMENT_TYPE)
    assert layout_chunks([(pa.array([], tokens_type), pa.array([], segments_type))], 1, 4) is None  # no sample
    assert layout_chunks([(pa.array([[1, None, 3]], tokens_type), pa.array([[text]], segments_type))], 1, 4) is None


def test_a_table_without_segments_is_text():
    rng = np.random.default_rng(3)
    samples = [rng.integers(16, 200, k).astype(np.int32) for k in (5, 1, 9)]
    layout = layout_table(pa.chunked_array([pa.array([s.tolist() for s in samples[:2]], pa.list_(pa.int32())),
                                            pa.array([samples[2].tolist()], pa.list_(pa.int32()))]), None, 1, 4)
    for i, tokens in enumerate(samples):
        _check(layout.sample(i), reference_positions(tokens, None, 1, 4))


def test_bad_segments_say_what_is_wrong():
    tokens = np.arange(20, 32, dtype=np.int32)
    with pytest.raises(ValueError, match="image segment grid"):
        sample_positions(tokens, [{"modality": "image", "start": 0, "length": 12, "grid": [3, 3]}], 1, 4)
    with pytest.raises(ValueError, match="do not fit groups of 2"):
        sample_positions(tokens, [{"modality": "audio", "start": 0, "length": 12, "grid": [4, 3]}], 2, 4)
    with pytest.raises(ValueError, match=r"segment \[8, 20\) grid \[3, 4\] lies outside its sample's 12 tokens"):
        sample_positions(tokens, [{"modality": "image", "start": 8, "length": 12, "grid": [3, 4]}], 1, 4)
    with pytest.raises(ValueError, match="lies outside"):
        sample_positions(tokens, [{"modality": "text", "start": -1, "length": 4}], 1, 4)
    table = pa.table({"tokens": pa.array([tokens.tolist()], pa.list_(pa.int32())),
                      "segments": pa.array([[{"modality": "video", "start": 0, "length": 12, "grid": [],
                                              "attention": None}]], pa.list_(SEGMENT_TYPE))})
    with pytest.raises(ValueError, match="unknown segment modality 'video'"):
        layout_table(table.column("tokens"), table.column("segments"), 1, 4)
