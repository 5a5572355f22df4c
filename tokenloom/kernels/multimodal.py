"""TokenLoom's multimodal mask: segment metadata -> FlashMask `startend_row_indices` (causal=False).

The packer emits, per batch row, segments that tile the sequence (modality, start, length,
attention kind, optional window, optional document id). Inside one document a query token in a
segment of kind

    causal         sees every key before it and itself (text);
    bidirectional  sees every key before its segment and all of its segment (an image);
    window         sees every key before its segment and, inside the segment, the last `window`
                   keys up to itself (audio: a causal local window, conditioned on its context).

Keys of another document are never seen; positions after the last segment are padding, seen by
no one and seeing nothing (their output is zero). For key column j in segment [a, b) of document
[s, e) the masked rows are therefore

    [0, a) for bidirectional, else [0, j)      (before the segment, or causal)
    [min(j + window, b), b) for window kinds   (the segment's rows past the window)
    [e, S)                                     (later documents and padding)

which are at most two intervals unless a window segment ends before its document does and j > 0.
That case raises ValueError with the way out: end the windowed segment at its document's end,
give it a window >= its length, or put each document in its own batch row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

MODALITIES = ("text", "image", "audio")
ATTENTION_KINDS = ("causal", "bidirectional", "window")
DEFAULT_ATTENTION = {"text": "causal", "image": "bidirectional", "audio": "window"}


@dataclass(frozen=True)
class Segment:
    """One modality span of a packed sequence, as the packer describes it."""

    modality: str
    start: int
    length: int
    attention: str | None = None
    window: int | None = None
    document: int = 0

    @property
    def kind(self) -> str:
        return self.attention or DEFAULT_ATTENTION[self.modality]


def as_segment(item: Segment | Mapping) -> Segment:
    """Accept a Segment or a mapping with the shard contract's keys (extra keys such as grid are ignored)."""
    if isinstance(item, Segment):
        segment = item
    elif isinstance(item, Mapping):
        missing = [key for key in ("modality", "start", "length") if key not in item]
        if missing:
            raise ValueError(f"segment {dict(item)} lacks {missing}")
        attention = item.get("attention", item.get("attention_kind", item.get("kind")))
        document = item.get("document", item.get("document_id", 0))
        segment = Segment(
            str(item["modality"]), int(item["start"]), int(item["length"]), attention, item.get("window"), int(document)
        )
    else:
        raise TypeError(f"a segment must be a Segment or a mapping, got {type(item).__name__}")
    if segment.modality not in MODALITIES:
        raise ValueError(f"segment modality must be one of {MODALITIES}, got {segment.modality!r}")
    if segment.kind not in ATTENTION_KINDS:
        raise ValueError(f"segment attention must be one of {ATTENTION_KINDS}, got {segment.kind!r}")
    if segment.length < 1 or segment.start < 0:
        raise ValueError(f"segment needs start >= 0 and length >= 1, got {segment}")
    if segment.kind == "window" and (segment.window is None or int(segment.window) < 1):
        raise ValueError(
            f"a {segment.modality} segment attends within a window: give window >= 1 (or another attention kind), got {segment}"
        )
    return segment


def _row_columns(segments: list[Segment], row: int) -> dict[str, torch.Tensor]:
    """Per column of one batch row: its segment's bounds, kind, window and its document's bounds."""
    position = 0
    seen_documents: set[int] = set()
    doc_spans: list[list[int]] = []
    for k, segment in enumerate(segments):
        if segment.start != position:
            raise ValueError(
                f"batch row {row}: segments must tile the sequence in order from 0; segment {k} starts at "
                f"{segment.start}, expected {position}"
            )
        position += segment.length
        if doc_spans and segments[k - 1].document == segment.document:
            doc_spans[-1][1] = position
        else:
            if segment.document in seen_documents:
                raise ValueError(
                    f"batch row {row}: document {segment.document} is split by another document; packed documents "
                    "must be contiguous"
                )
            seen_documents.add(segment.document)
            doc_spans.append([segment.start, position])
    lengths = torch.tensor([s.length for s in segments])
    doc_of_segment = []
    for segment in segments:
        doc_of_segment.append(next(i for i, (lo, hi) in enumerate(doc_spans) if lo <= segment.start < hi))
    doc_bounds = torch.tensor(doc_spans)[torch.tensor(doc_of_segment)]
    return {
        "seg_start": torch.tensor([s.start for s in segments]).repeat_interleave(lengths),
        "seg_end": torch.tensor([s.start + s.length for s in segments]).repeat_interleave(lengths),
        "kind": torch.tensor([ATTENTION_KINDS.index(s.kind) for s in segments]).repeat_interleave(lengths),
        "window": torch.tensor([int(s.window or 0) for s in segments]).repeat_interleave(lengths),
        "doc_start": doc_bounds[:, 0].repeat_interleave(lengths),
        "doc_end": doc_bounds[:, 1].repeat_interleave(lengths),
        "segment": torch.arange(len(segments)).repeat_interleave(lengths),
    }


def _row_indices(segments: list[Segment], row: int, seq_len: int) -> torch.Tensor:
    c = _row_columns(segments, row)
    used = c["seg_start"].numel()
    j = torch.arange(used)
    windowed = c["kind"] == ATTENTION_KINDS.index("window")
    upper_end = torch.where(c["kind"] == ATTENTION_KINDS.index("bidirectional"), c["seg_start"], j)
    window_start = torch.where(windowed, torch.minimum(j + c["window"], c["seg_end"]), c["seg_end"])
    seg_end, doc_end = c["seg_end"], c["doc_end"]
    has_window = window_start < seg_end
    # The window piece merges with the document tail when the segment ends the document; it stands
    # alone in the lower slot when there is no tail; it takes the upper slot when that is empty (j = 0).
    merges = has_window & (seg_end == doc_end)
    alone = has_window & ~merges & (doc_end == seq_len)
    takes_upper = has_window & ~merges & ~alone & (upper_end == 0)
    bad = has_window & ~merges & ~alone & ~takes_upper
    if bool(bad.any()):
        col = int(bad.nonzero()[0])
        k = int(c["segment"][col])
        seg = segments[k]
        raise ValueError(
            f"batch row {row}, segment {k} ({seg.modality}, window {seg.window}, columns [{seg.start}, "
            f"{seg.start + seg.length})): key column {col} would need masked rows [0, {col}), "
            f"[{int(window_start[col])}, {int(seg_end[col])}) and [{int(doc_end[col])}, {seq_len}), three "
            "intervals, but FlashMask allows two per column. End the windowed segment at its document's end, "
            "give it a window >= its length, or put each document in its own batch row."
        )
    lower_start = torch.where(merges | alone, window_start, doc_end)
    lower_end = torch.where(alone, seg_end, torch.full_like(seg_end, seq_len))
    upper_start = torch.where(takes_upper, window_start, 0)
    upper_end = torch.where(takes_upper, seg_end, upper_end)
    padding = seq_len - used
    lts = torch.cat([lower_start, torch.zeros(padding, dtype=torch.int64)])
    lte = torch.cat([lower_end, torch.full((padding,), seq_len)])
    uts = torch.cat([upper_start, torch.zeros(padding, dtype=torch.int64)])
    ute = torch.cat([upper_end, torch.zeros(padding, dtype=torch.int64)])
    return torch.stack([lts, lte, uts, ute], dim=-1).to(torch.int32)


def build_multimodal_mask(
    batch_segments: Sequence[Sequence[Segment | Mapping]] | Sequence[Segment | Mapping],
    seq_len: int | None = None,
    document_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Segments per batch row -> int32 [B, 1, seq_len, 4] (LTS, LTE, UTS, UTE); use with causal=False.

    `batch_segments` may also be one row's flat list of segments. `document_ids`, if given, holds one
    id per segment per row and overrides the segments' `document`. `seq_len` defaults to the longest
    row; shorter rows are padded (padding is fully masked).
    """
    if len(batch_segments) > 0 and isinstance(batch_segments[0], Segment | Mapping):
        batch_segments = [batch_segments]  # type: ignore[list-item]
    if len(batch_segments) == 0 or any(len(row) == 0 for row in batch_segments):
        raise ValueError("build_multimodal_mask needs at least one batch row, each with at least one segment")
    rows = [[as_segment(item) for item in row] for row in batch_segments]
    if document_ids is not None:
        if len(document_ids) != len(rows) or any(len(d) != len(r) for d, r in zip(document_ids, rows, strict=True)):
            raise ValueError("document_ids must give one id per segment for every batch row")
        rows = [
            [Segment(s.modality, s.start, s.length, s.attention, s.window, int(d)) for s, d in zip(r, ids, strict=True)]
            for r, ids in zip(rows, document_ids, strict=True)
        ]
    used = [row[-1].start + row[-1].length for row in rows]
    total = max(used) if seq_len is None else int(seq_len)
    if total < max(used):
        raise ValueError(f"seq_len={total} is shorter than the segments, which cover {max(used)} positions")
    return torch.stack([_row_indices(row, r, total) for r, row in enumerate(rows)]).unsqueeze(1)
