"""The whole-array layout against the one-sample-at-a-time loop it replaced (tests/layout_reference.py).

Samples of every kind (images of many shapes, audio of 1..3 levels in groups of 3, windowed and
overridden attention, text, samples with no segments, an image right after another) are laid
out together from an Arrow table, and every sample must equal the loop's layout of it alone:
the cross-sample offsets, running sums and target shifts are where a vectorized layout breaks.
"""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import reference_positions
from multimodal_data import LAYOUT, MANIFEST

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.datasets.layout import layout_table, sample_positions
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
    return tokens, None  # no segments: all text


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
