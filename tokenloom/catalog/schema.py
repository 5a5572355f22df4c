"""The token-shard contract: one Arrow row per sample, validated before it is written.

A shard row carries everything a reader needs without consulting a tokenizer: the flat
unified ids, the modality spans that tile them, and the ids of the vocabulary manifest and
tokenizer bundles that gave them meaning. Validation is vectorized over a batch and returns
a reason per bad row, so one bad sample becomes a quarantine record instead of a failed job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from tokenloom.contract import ATTENTION_KINDS, MODALITIES, VIDEO

SEGMENT_TYPE = pa.struct(
    [
        pa.field("modality", pa.string()),
        pa.field("start", pa.int32()),
        pa.field("length", pa.int32()),
        pa.field("grid", pa.list_(pa.int32())),  # (h, w) for images, (frames, levels) for audio
        pa.field("attention", pa.string()),
    ]
)

SHARD_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("tokens", pa.list_(pa.int32())),
        pa.field("segments", pa.list_(SEGMENT_TYPE)),
        pa.field("num_tokens", pa.int32()),
        pa.field("modalities", pa.string()),  # the modality mix, e.g. "text" or "image+text": the partition key
        pa.field("vocab_id", pa.string()),
        pa.field("bundle_ids", pa.list_(pa.string())),
        pa.field("job_id", pa.string()),
        # hash of the sample's normalized content (text, decoded pixels, decoded samples): the
        # dataset's exact-duplicate index; null in files written before it existed
        pa.field("content_hash", pa.string()),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("source", pa.string()),
        pa.field("record", pa.string()),  # where in the source: line number, member name, ...
        pa.field("reason", pa.string()),
        pa.field("job_id", pa.string()),
    ]
)


# Valid records a quality filter dropped (not quarantined: the input was fine, it was not wanted).
FILTERED_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("record", pa.string()),
        pa.field("modality", pa.string()),
        pa.field("filter", pa.string()),  # the filter's name, e.g. "text.min_chars"
        pa.field("reason", pa.string()),  # e.g. "12 characters < min_chars 50"
        pa.field("job_id", pa.string()),
    ]
)

# Samples dropped as duplicates, each with the sample it duplicates (kept in this dataset).
DUPLICATES_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("record", pa.string()),
        pa.field("modality", pa.string()),
        pa.field("duplicate_of", pa.string()),  # sample_id of the kept sample
        pa.field("kind", pa.string()),  # "exact", "near-text", "near-image"
        pa.field("similarity", pa.float64()),  # 1.0 for exact; estimated Jaccard or 1 - hamming/bits
        pa.field("reason", pa.string()),
        pa.field("job_id", pa.string()),
    ]
)

# A job's dedup signatures of the samples it kept (`signatures_file`): later jobs of the dataset
# find near-duplicates of these without recomputing them.
SIGNATURES_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string()),
        pa.field("modality", pa.string()),
        pa.field("minhash", pa.list_(pa.uint32())),  # text: MinHash of word shingles, else null
        pa.field("phash", pa.uint64()),  # image: 64-bit perceptual hash, else null
    ]
)

# Side-file lists a job's snapshot summary may name (JSON lists of Parquet URIs, one schema each).
SIDE_TABLES = {"quarantine": ("quarantine_files", QUARANTINE_SCHEMA),
               "filtered": ("filtered_files", FILTERED_SCHEMA),
               "duplicates": ("duplicates_files", DUPLICATES_SCHEMA)}


def validate_shard_rows(table: pa.Table, vocab_size: int) -> list[str | None]:
    """Check each row of a shard table; return None for a good row, else the reason.

    Rules: ids inside [0, vocab_size); `num_tokens == len(tokens)`; segments sorted, starting
    at 0, contiguous and covering every token; known modality and attention kinds; the
    `modalities` column equal to the segments' modality mix.
    """
    missing = [f.name for f in SHARD_SCHEMA if f.name not in table.column_names]
    if missing:
        raise ValueError(f"shard table lacks columns {missing}; expected the schema {SHARD_SCHEMA.names}")
    reasons: list[str | None] = [None] * table.num_rows
    tokens_col = table.column("tokens").combine_chunks()
    offsets = tokens_col.offsets.to_numpy()
    flat = tokens_col.values.to_numpy(zero_copy_only=False)
    lengths = np.diff(offsets)
    num_tokens = table.column("num_tokens").to_numpy(zero_copy_only=False)

    bad_ids = (flat < 0) | (flat >= vocab_size)
    if bad_ids.any():
        row_of = np.searchsorted(offsets, np.flatnonzero(bad_ids), side="right") - 1
        for row in np.unique(row_of):
            first = flat[offsets[row] : offsets[row + 1]]
            worst = first[(first < 0) | (first >= vocab_size)][0]
            reasons[row] = f"token id {int(worst)} outside the vocabulary [0, {vocab_size})"
    for row in np.flatnonzero(lengths != num_tokens):
        reasons[row] = reasons[row] or f"num_tokens {num_tokens[row]} != len(tokens) {lengths[row]}"
    mixes = table.column("modalities").to_pylist()
    for row, segments in enumerate(table.column("segments").to_pylist()):
        if reasons[row] is None:
            reasons[row] = _segment_problem(segments or [], int(lengths[row]))
        if reasons[row] is None and mixes[row] != modality_mix(segments):
            reasons[row] = f"modalities {mixes[row]!r} does not match the segments ({modality_mix(segments)!r})"
    return reasons


def modality_mix(segments: Sequence[dict] | None) -> str:
    """The partition value of a sample: its distinct modalities, sorted, joined by '+'; a sample with
    timed segments (a video's frames and sound) also names `video`, so videos can be found by it."""
    names = {seg["modality"] for seg in segments or []}
    if any(len(seg.get("grid") or ()) >= 3 for seg in segments or []):
        names.add(VIDEO)
    return "+".join(sorted(names))


def _segment_problem(segments: Sequence[dict], length: int) -> str | None:
    if length == 0:
        return "empty token sequence"
    cursor = 0
    for seg in segments:
        if seg["modality"] not in MODALITIES:
            return f"unknown modality {seg['modality']!r}"
        if seg["attention"] not in ATTENTION_KINDS:
            return f"unknown attention kind {seg['attention']!r}"
        if seg["start"] != cursor or seg["length"] <= 0:
            return f"segments do not tile the sequence: span at {seg['start']} (len {seg['length']}), expected start {cursor}"
        cursor += seg["length"]
    if cursor != length:
        return f"segments cover {cursor} tokens but the sequence has {length}"
    return None

