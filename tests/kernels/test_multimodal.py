"""The multimodal builders against the segment rules written as a predicate, and their refusals.

The property tests check both directions: when the rules' mask needs at most two masked row
intervals in every column the builder must reproduce it exactly, and when some column needs three
it must raise ValueError. `build_multimodal_mask` is checked from segment lists, `mask_from_columns`
from per-position columns laid out as the stream lays them out (padding as a causal segment of the
last document, or marked with doc id -1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.contract import ATTENTION_IDS
from tokenloom.kernels import Segment, build_multimodal_mask, dense_allowed_mask, mask_from_columns


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


# -- from per-position columns ---------------------------------------------------------------------


def column_rules_allowed(seg, doc, kind, window) -> torch.Tensor:
    """bool [B, 1, P, P] from the documented rules on [B, P] columns, one (query, key) pair at a time.

    A segment is a run of equal segment ids inside a run of equal doc ids; its kind and window are
    read at its first position; a negative doc id is padding, which sees and is seen by nothing."""
    B, P = seg.shape
    out = torch.zeros(B, 1, P, P, dtype=torch.bool)
    for b in range(B):
        doc_run, seg_start, seg_end = [], [], []
        for t in range(P):
            new_doc = t == 0 or doc[b, t] != doc[b, t - 1]
            new_seg = new_doc or seg[b, t] != seg[b, t - 1]
            doc_run.append((doc_run[-1] if t else -1) + int(new_doc))
            seg_start.append(t if new_seg else seg_start[-1])
        for t in reversed(range(P)):
            last = t == P - 1 or seg_start[t + 1] != seg_start[t]
            seg_end.insert(0, t + 1 if last else seg_end[0])
        for i in range(P):
            a, e = seg_start[i], seg_end[i]
            k, w = int(kind[b, a]), int(window[b, a])
            for j in range(P):
                if doc[b, i] < 0 or doc[b, j] < 0 or doc_run[i] != doc_run[j]:
                    continue
                if k == ATTENTION_IDS["causal"]:
                    ok = j <= i
                elif k == ATTENTION_IDS["bidirectional"]:
                    ok = j < e
                else:
                    ok = j < a or i - w < j <= i
                out[b, 0, i, j] = ok
    return out


@st.composite
def column_batches(draw):
    """Rows of segments of random kinds, windows and documents; the row's tail either a causal
    segment of its last document (the stream's padding) or doc id -1 (the builder's)."""
    P = draw(st.integers(2, 24))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        seg, doc, kind, window = [], [], [], []
        used = draw(st.integers(1, P))
        k = d = 0
        while len(seg) < used:
            length = min(draw(st.integers(1, 7)), used - len(seg))
            name = draw(st.sampled_from(["causal", "bidirectional", "window", "window"]))
            w = draw(st.integers(1, 4)) if name == "window" else 0
            d += draw(st.integers(0, 1))
            k += 1
            seg += [k] * length
            doc += [d] * length
            kind += [ATTENTION_IDS[name]] * length
            window += [w] * length
        pad = P - used
        stream_style = draw(st.booleans())
        seg += [k + 1] * pad
        doc += [d if stream_style else -1] * pad
        kind += [ATTENTION_IDS["causal"]] * pad
        window += [0] * pad
        rows.append((seg, doc, kind, window))
    return [torch.tensor([r[c] for r in rows]) for c in range(4)]


@settings(max_examples=80, deadline=None)
@given(column_batches())
def test_columns_give_the_rules_mask_or_refuse_exactly_when_it_needs_three_intervals(columns):
    seg, doc, kind, window = columns
    B, P = seg.shape
    want = column_rules_allowed(seg, doc, kind, window)
    expressible = all(masked_runs(want[b, 0, :, j]) <= 2 for b in range(B) for j in range(P))
    if expressible:
        idx = mask_from_columns(seg, doc, kind, window)
        assert idx.dtype == torch.int32 and idx.shape == (B, 1, P, 4)
        assert torch.equal(dense_allowed_mask(idx, causal=False, seq_q=P), want)
    else:
        with pytest.raises(ValueError, match=r"batch row \d+, segment \d+ .*key column \d+.*three intervals"):
            mask_from_columns(seg, doc, kind, window)


def test_builder_is_the_column_function_on_the_segments_columns():
    rows = [[text(0, 5), image(5, 7), text(12, 3), audio(15, 9, 4), text(24, 6, doc=1), image(30, 4, doc=1)],
            [image(0, 4), text(4, 10), audio(14, 6, 2, doc=2)]]
    seg = torch.tensor([[0] * 5 + [1] * 7 + [2] * 3 + [3] * 9 + [4] * 6 + [5] * 4 + [6] * 3,
                        [0] * 4 + [1] * 10 + [2] * 6 + [3] * 17])
    doc = torch.tensor([[0] * 24 + [1] * 10 + [-1] * 3, [0] * 14 + [1] * 6 + [-1] * 17])
    c, b, w = ATTENTION_IDS["causal"], ATTENTION_IDS["bidirectional"], ATTENTION_IDS["window"]
    kind = torch.tensor([[c] * 5 + [b] * 7 + [c] * 3 + [w] * 9 + [c] * 6 + [b] * 4 + [c] * 3,
                         [b] * 4 + [c] * 10 + [w] * 6 + [c] * 17])
    window = torch.tensor([[0] * 15 + [4] * 9 + [0] * 13, [0] * 14 + [2] * 6 + [0] * 17])
    assert torch.equal(mask_from_columns(seg, doc, kind, window), build_multimodal_mask(rows, seq_len=37))


def test_columns_are_refused_with_the_row_and_column():
    seg = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    doc = torch.zeros_like(seg)
    window = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0]])
    kind = torch.tensor([[0, 0, 1, 1], [0, 2, 2, 2]])  # row 1's window segment has no width
    with pytest.raises(ValueError, match=r"batch row 1, segment 1 \(columns \[1, 4\)\) attends within a window"):
        mask_from_columns(seg, doc, kind, window)
    with pytest.raises(ValueError, match="attention id 7"):
        mask_from_columns(seg, doc, torch.full_like(seg, 7), window)
    with pytest.raises(ValueError, match="one shape"):
        mask_from_columns(seg, doc[:, :3], kind, window)
