"""The multimodal builder against the segment rules written as a predicate, and its refusals.

The property test checks both directions: when the rules' mask needs at most two masked row
intervals in every column the builder must reproduce it exactly, and when some column needs three
it must raise ValueError.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.kernels import Segment, build_multimodal_mask, dense_allowed_mask


def rules_allowed(rows: list[list[Segment]], seq_len: int) -> torch.Tensor:
    """bool [B, 1, S, S] straight from the documented rules, one (query, key) pair at a time."""
    out = torch.zeros(len(rows), 1, seq_len, seq_len, dtype=torch.bool)
    for b, segments in enumerate(rows):
        owner = {}
        for s in segments:
            for t in range(s.start, s.start + s.length):
                owner[t] = s
        for i in range(seq_len):
            for j in range(seq_len):
                si, sj = owner.get(i), owner.get(j)
                if si is None or sj is None or si.document != sj.document:
                    continue
                if si.kind == "causal":
                    ok = j <= i
                elif si.kind == "bidirectional":
                    ok = j < si.start + si.length
                else:
                    ok = j < si.start or i - si.window < j <= i
                out[b, 0, i, j] = ok
    return out


def masked_runs(column: torch.Tensor) -> int:
    masked = (~column).int()
    return int(masked[0]) + int((masked[1:] - masked[:-1]).eq(1).sum())


def text(start, length, doc=0):
    return Segment("text", start, length, document=doc)


def image(start, length, doc=0):
    return Segment("image", start, length, document=doc)


def audio(start, length, window, doc=0):
    return Segment("audio", start, length, window=window, document=doc)


def test_interleaved_documents_match_rules_with_padding():
    rows = [
        [text(0, 5), image(5, 7), text(12, 3), audio(15, 9, 4), text(24, 6, doc=1), image(30, 4, doc=1)],
        [image(0, 4), text(4, 10), audio(14, 6, 2, doc=2)],
    ]
    idx = build_multimodal_mask(rows, seq_len=37)
    assert idx.dtype == torch.int32 and idx.shape == (2, 1, 37, 4)
    assert torch.equal(dense_allowed_mask(idx, causal=False, seq_q=37), rules_allowed(rows, 37))


def test_accepts_mappings_and_document_ids():
    row = [
        {"modality": "text", "start": 0, "length": 4, "attention_kind": "causal", "grid": None},
        {"modality": "image", "start": 4, "length": 4},
        {"modality": "audio", "start": 8, "length": 5, "attention": "window", "window": 2},
    ]
    idx = build_multimodal_mask(row, document_ids=[[0, 0, 1]])
    want = rules_allowed([[text(0, 4), image(4, 4), audio(8, 5, 2, doc=1)]], 13)
    assert torch.equal(dense_allowed_mask(idx, causal=False, seq_q=13), want)


def test_audio_mid_document_followed_by_another_document_is_refused_with_reason():
    rows = [[text(0, 3), audio(3, 8, 2), text(11, 3), text(14, 4, doc=1)]]
    with pytest.raises(ValueError, match="three intervals.*own batch row"):
        build_multimodal_mask(rows)


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([text(1, 3)], "tile the sequence"),
        ([text(0, 3), text(3, 2, doc=1), text(5, 2)], "contiguous"),
        ([Segment("audio", 0, 4)], "window"),
        ([Segment("video", 0, 4)], "modality"),
        ([Segment("text", 0, 4, attention="sparse")], "attention"),
    ],
)
def test_bad_segments_are_refused(segments, message):
    with pytest.raises(ValueError, match=message):
        build_multimodal_mask([segments])


@st.composite
def segment_rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 2))):
        segments, pos, doc = [], 0, 0
        for _ in range(draw(st.integers(1, 5))):
            length = draw(st.integers(1, 6))
            modality = draw(st.sampled_from(["text", "image", "audio"]))
            window = draw(st.integers(1, 7)) if modality == "audio" else None
            doc += draw(st.integers(0, 1))
            segments.append(Segment(modality, pos, length, window=window, document=doc))
            pos += length
        rows.append(segments)
    return rows, max(r[-1].start + r[-1].length for r in rows) + draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(segment_rows())
def test_builder_raises_exactly_when_rules_need_three_intervals(case):
    rows, seq_len = case
    want = rules_allowed(rows, seq_len)
    expressible = all(masked_runs(want[b, 0, :, j]) <= 2 for b in range(len(rows)) for j in range(seq_len))
    if expressible:
        idx = build_multimodal_mask(rows, seq_len=seq_len)
        assert torch.equal(dense_allowed_mask(idx, causal=False, seq_q=seq_len), want)
    else:
        with pytest.raises(ValueError, match="three intervals"):
            build_multimodal_mask(rows, seq_len=seq_len)
