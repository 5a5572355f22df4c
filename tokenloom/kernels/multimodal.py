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

Two entry points. `mask_from_columns` takes the per-position columns a packed stream row already
carries (segment ids, document ids, attention kind, window; [batch, positions] tensors) and
computes every column's intervals for the whole batch at once, without a Python loop over rows
or segments, so the trainer can call it once per micro-batch on any device.
`build_multimodal_mask` takes segment lists (the packer's and the tests' form), checks them,
turns them into those columns and calls it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tokenloom.contract import ATTENTION_IDS, ATTENTION_KINDS, DEFAULT_ATTENTION, MODALITIES


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


def _run_bounds(new_run: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """new_run bool [B, P] (True where a run of equal values starts) -> each position's run [start, end), [B, P].

    Loop-free: a start is carried forward by a running max of the start positions, an end
    backward by a running min over the flipped row."""
    P = new_run.shape[1]
    pos = torch.arange(P, device=new_run.device).expand_as(new_run)
    start = torch.where(new_run, pos, 0).cummax(dim=1).values
    last = torch.cat([new_run[:, 1:], torch.ones_like(new_run[:, :1])], dim=1)  # the last position of its run
    end = torch.where(last, pos + 1, P).flip(1).cummin(dim=1).values.flip(1)
    return start, end


def _run_starts(values: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ones_like(values[:, :1], dtype=torch.bool), values[:, 1:] != values[:, :-1]], dim=1)


def mask_from_columns(segment_ids: torch.Tensor, doc_ids: torch.Tensor, attention: torch.Tensor,
                      window: torch.Tensor) -> torch.Tensor:
    """Per-position columns of a batch -> FlashMask int32 [B, 1, P, 4] (LTS, LTE, UTS, UTE); use with causal=False.

    All four are [B, P] integer tensors, the layout of a packed stream row (datasets/stream.py):
    a segment is a run of equal `segment_ids` within a run of equal `doc_ids` (a document), its
    kind is `attention` (contract.ATTENTION_IDS) and, for the window kind, its width is `window`,
    both read at the segment's first position. A negative doc id marks padding: its columns are
    fully masked and its rows see nothing. Batched and loop-free (run bounds by running max/min),
    on the columns' device; the only host synchronisation is one check that every column fits.

    Raises ValueError, naming the batch row and the column, for an unknown attention id, a
    window below 1, or a column that would need three masked row intervals (module docstring).
    """
    shapes = {tuple(t.shape) for t in (segment_ids, doc_ids, attention, window)}
    if len(shapes) != 1 or segment_ids.dim() != 2 or segment_ids.shape[1] == 0:
        raise ValueError(f"mask_from_columns takes four [batch, positions] columns of one shape, got {sorted(shapes)}")
    B, P = segment_ids.shape
    doc = doc_ids.long()
    padding = doc < 0
    doc_new = _run_starts(doc)
    seg_new = doc_new | _run_starts(segment_ids.long())
    seg_start, seg_end = _run_bounds(seg_new)
    _, doc_end = _run_bounds(doc_new)
    kind = attention.long().gather(1, seg_start)
    width = window.long().gather(1, seg_start)
    j = torch.arange(P, device=doc.device).expand(B, P)

    windowed = ~padding & (kind == ATTENTION_IDS["window"])
    upper_end = torch.where(kind == ATTENTION_IDS["bidirectional"], seg_start, j)
    window_start = torch.where(windowed, torch.minimum(j + width, seg_end), seg_end)
    has_window = window_start < seg_end
    # The window piece merges with the document tail when the segment ends the document; it stands
    # alone in the lower slot when there is no tail; it takes the upper slot when that is empty (j = 0).
    merges = has_window & (seg_end == doc_end)
    alone = has_window & ~merges & (doc_end == P)
    takes_upper = has_window & ~merges & ~alone & (upper_end == 0)
    three = has_window & ~merges & ~alone & ~takes_upper
    unknown = ~padding & ((kind < 0) | (kind >= len(ATTENTION_KINDS)))
    no_width = windowed & (width < 1)
    if bool((three | unknown | no_width).any()):
        _raise_unfit(three, unknown, no_width, seg_new, seg_start, seg_end, doc_end, window_start, kind, width)

    full = torch.full_like(j, P)
    lts = torch.where(merges | alone, window_start, doc_end)
    lte = torch.where(alone, seg_end, full)
    uts = torch.where(takes_upper, window_start, 0)
    ute = torch.where(takes_upper, seg_end, upper_end)
    zero = torch.zeros_like(j)
    lts, lte = torch.where(padding, zero, lts), torch.where(padding, full, lte)
    uts, ute = torch.where(padding, zero, uts), torch.where(padding, zero, ute)
    return torch.stack([lts, lte, uts, ute], dim=-1).to(torch.int32).unsqueeze(1)


def _raise_unfit(three, unknown, no_width, seg_new, seg_start, seg_end, doc_end, window_start, kind, width):
    """The ValueError of `mask_from_columns` for the first offending column (rows in order)."""
    P = three.shape[1]
    segment = seg_new.long().cumsum(1) - 1  # the segment's ordinal within its row
    for problem in (unknown, no_width, three):
        if bool(problem.any()):
            b, col = (int(i) for i in problem.nonzero()[0])
            break
    k, a, e, w = int(segment[b, col]), int(seg_start[b, col]), int(seg_end[b, col]), int(width[b, col])
    where = f"batch row {b}, segment {k} (columns [{a}, {e}))"
    if bool(unknown[b, col]):
        raise ValueError(f"{where}: attention id {int(kind[b, col])} is not one of {ATTENTION_IDS}")
    if bool(no_width[b, col]):
        raise ValueError(f"{where} attends within a window: give window >= 1 (or another attention kind), got {w}")
    raise ValueError(
        f"batch row {b}, segment {k} (window {w}, columns [{a}, {e})): key column {col} would need masked rows "
        f"[0, {col}), [{int(window_start[b, col])}, {e}) and [{int(doc_end[b, col])}, {P}), three intervals, but "
        "FlashMask allows two per column. End the windowed segment at its document's end, give it a window >= its "
        "length, or put each document in its own batch row."
    )


def segment_columns(segments: Sequence[Segment], row: int, seq_len: int) -> dict[str, torch.Tensor]:
    """One batch row's segments -> its [seq_len] columns for `mask_from_columns` (positions after
    the last segment are padding, doc id -1); refuses segments that do not tile the row in order
    or a document split by another one."""
    position, doc_ordinal, documents = 0, [], []
    for k, segment in enumerate(segments):
        if segment.start != position:
            raise ValueError(
                f"batch row {row}: segments must tile the sequence in order from 0; segment {k} starts at "
                f"{segment.start}, expected {position}"
            )
        position += segment.length
        if not documents or documents[-1] != segment.document:
            if segment.document in documents:
                raise ValueError(
                    f"batch row {row}: document {segment.document} is split by another document; packed documents "
                    "must be contiguous"
                )
            documents.append(segment.document)
        doc_ordinal.append(len(documents) - 1)
    lengths = torch.tensor([s.length for s in segments])
    padding = seq_len - position

    def column(values: list[int], pad: int) -> torch.Tensor:
        return torch.cat([torch.tensor(values).repeat_interleave(lengths), torch.full((padding,), pad)])

    return {
        "segment_ids": column(list(range(len(segments))), len(segments)),
        "doc_ids": column(doc_ordinal, -1),
        "attention": column([ATTENTION_IDS[s.kind] for s in segments], ATTENTION_IDS["causal"]),
        "window": column([int(s.window or 0) for s in segments], 0),
    }


def build_multimodal_mask(
    batch_segments: Sequence[Sequence[Segment | Mapping]] | Sequence[Segment | Mapping],
    seq_len: int | None = None,
    document_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Segments per batch row -> int32 [B, 1, seq_len, 4] (LTS, LTE, UTS, UTE); use with causal=False.

    `batch_segments` may also be one row's flat list of segments. `document_ids`, if given, holds one
    id per segment per row and overrides the segments' `document`. `seq_len` defaults to the longest
    row; shorter rows are padded (padding is fully masked). The segments become per-position
    columns (`segment_columns`) and the intervals come from `mask_from_columns`.
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
    columns = [segment_columns(row, r, total) for r, row in enumerate(rows)]
    return mask_from_columns(*(torch.stack([c[key] for c in columns]) for key in
                               ("segment_ids", "doc_ids", "attention", "window")))
