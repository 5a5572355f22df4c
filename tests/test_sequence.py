"""The sample layout: parts -> tokens + segments -> parts, for every layout, and the contract it writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.catalog.schema import validate_shard_rows
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart, normalize
from tokenloom.tokenizers.vocab import VocabManifest

VOCAB = VocabManifest.build(300, visual_size=64, audio_levels=3, audio_codebook=32)
LAYOUT = SampleLayout(VOCAB)


def _array(draw, shape, high):
    return np.asarray(draw(st.lists(st.integers(0, high - 1), min_size=int(np.prod(shape)),
                                    max_size=int(np.prod(shape))))).reshape(shape)


@st.composite
def parts(draw):
    out = []
    for kind in draw(st.lists(st.sampled_from(["text", "image", "audio"]), max_size=6)):
        if kind == "text":
            out.append(TextPart(_array(draw, (draw(st.integers(0, 6)),), VOCAB.text.size)))
        elif kind == "image":
            out.append(ImagePart(_array(draw, (draw(st.integers(1, 4)), draw(st.integers(1, 4))), VOCAB.visual.size)))
        else:
            levels = draw(st.integers(1, len(VOCAB.audio)))
            out.append(AudioPart(_array(draw, (draw(st.integers(1, 5)), levels), 32)))
    return out


@settings(max_examples=300, deadline=None)
@given(parts())
def test_round_trip_of_every_layout(sample):
    tokens, segments = LAYOUT.assemble(sample)
    assert LAYOUT.disassemble(tokens, segments) == normalize(sample)
    again = LAYOUT.assemble(LAYOUT.disassemble(tokens, segments))
    assert np.array_equal(again[0], tokens) and again[1] == segments
    # what it writes passes the shard contract's own validation
    import pyarrow as pa

    from tokenloom.catalog.schema import SHARD_SCHEMA, modality_mix

    row = {"sample_id": "s", "source": "x", "tokens": tokens.tolist(), "segments": segments,
           "num_tokens": len(tokens), "modalities": modality_mix(segments), "vocab_id": VOCAB.id,
           "bundle_ids": [], "job_id": "j"}
    assert validate_shard_rows(pa.Table.from_pylist([row], schema=SHARD_SCHEMA), VOCAB.size) == [None]
    # media segments are exactly their codes; specials and text are text segments
    for seg in segments:
        if seg["modality"] != "text":
            assert seg["length"] == np.prod(seg["grid"])
        else:
            assert seg["attention"] == "causal"


def test_a_captioned_image_is_laid_out_as_the_contract_says():
    s = VOCAB.specials
    codes = np.array([[1, 2, 3], [4, 5, 6]])
    tokens, segments = LAYOUT.assemble([ImagePart(codes), TextPart(np.array([7, 8]))])
    v, t = VOCAB.visual.start, VOCAB.text.start
    assert tokens.tolist() == [s["<bos>"], s["<boi>"], *(v + codes.reshape(-1)), s["<eoi>"], t + 7, t + 8, s["<eos>"]]
    assert segments == [
        {"modality": "text", "start": 0, "length": 2, "grid": [], "attention": "causal"},
        {"modality": "image", "start": 2, "length": 6, "grid": [2, 3], "attention": "bidirectional"},
        {"modality": "text", "start": 8, "length": 4, "grid": [], "attention": "causal"},
    ]
    audio = np.array([[0, 1, 2], [3, 4, 5]])
    tokens, segments = LAYOUT.assemble([AudioPart(audio)])
    level = [r.start for r in VOCAB.audio]
    assert tokens[2:8].tolist() == [level[0], level[1] + 1, level[2] + 2, level[0] + 3, level[1] + 4, level[2] + 5]
    assert segments[1] == {"modality": "audio", "start": 2, "length": 6, "grid": [2, 3], "attention": "window"}


@pytest.mark.parametrize(("part", "message"), [
    (TextPart(np.array([300])), "text ids must be in"),
    (ImagePart(np.array([[64]])), "visual codes must be in"),
    (ImagePart(np.zeros(3, dtype=int)), "2-D grid"),
    (AudioPart(np.zeros((2, 4), dtype=int)), "4 levels; the manifest has 3"),
    (AudioPart(np.full((2, 3), 32)), "outside their level's codebook"),
])
def test_ids_outside_their_range_are_refused(part, message):
    with pytest.raises(ValueError, match=message):
        LAYOUT.assemble([part])


def test_malformed_rows_say_what_breaks_the_layout():
    tokens, segments = LAYOUT.assemble([ImagePart(np.ones((2, 2), dtype=int)), TextPart(np.array([1]))])
    broken = tokens.copy()
    broken[1] = VOCAB.specials["<boa>"]  # the image opened by the audio delimiter
    with pytest.raises(ValueError, match="image segment 1 is not opened"):
        LAYOUT.disassemble(broken, segments)
    broken = tokens.copy()
    broken[6] = VOCAB.specials["<eoa>"]
    with pytest.raises(ValueError, match="is not closed"):
        LAYOUT.disassemble(broken, segments)
    with pytest.raises(ValueError, match="start with <bos>"):
        LAYOUT.disassemble(tokens[1:], segments)
    bad_grid = [dict(seg) for seg in segments]
    bad_grid[1]["grid"] = [3, 2]
    bad_grid[1]["length"] = 4
    with pytest.raises(ValueError, match=r"grid \[3, 2\] does not match"):
        LAYOUT.disassemble(tokens, bad_grid)
