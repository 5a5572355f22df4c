"""Snapshot statistics: computed from shard rows as they are written, merged, never rescanned.

Each write task summarizes its rows (per-modality token and sample counts, a histogram of
sequence lengths in power-of-two bins); the driver merges the task summaries into the job's,
which the commit stores in its snapshot. A snapshot's totals are the merge of the job
statistics along its ancestry, less the statistics of the rows jobs deleted (a changed file's
old samples, `catalog/replace.py`): exact without reading a data file, and independent of the
order in which concurrent writers landed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HIST_BINS = 24  # bin b counts sequences with 2**b <= num_tokens < 2**(b+1); bin 0 also holds 0-1


def empty_stats() -> dict:
    return {"samples": 0, "tokens": 0, "modalities": {}, "length_hist": [0] * HIST_BINS}


def shard_stats(table: pa.Table) -> dict:
    """Statistics of a table with the shard schema."""
    stats = empty_stats()
    if table.num_rows == 0:
        return stats
    lengths = table.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
    stats["samples"] = int(table.num_rows)
    stats["tokens"] = int(lengths.sum())
    bins = np.clip(np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64), 0, HIST_BINS - 1)
    stats["length_hist"] = np.bincount(bins, minlength=HIST_BINS).tolist()
    segments = pc.list_flatten(table.column("segments"))
    parents = pc.list_parent_indices(table.column("segments")).to_numpy(zero_copy_only=False)
    modality = np.asarray(pc.struct_field(segments, "modality").to_pylist(), dtype=object)
    seg_len = pc.struct_field(segments, "length").to_numpy(zero_copy_only=False).astype(np.int64)
    for name in sorted(set(modality.tolist())):
        hit = modality == name
        stats["modalities"][name] = {"tokens": int(seg_len[hit].sum()), "samples": int(np.unique(parents[hit]).size)}
    return stats


def merge_stats(*parts: dict) -> dict:
    out = empty_stats()
    for part in parts:
        out["samples"] += part["samples"]
        out["tokens"] += part["tokens"]
        out["length_hist"] = [a + b for a, b in zip(out["length_hist"], part["length_hist"], strict=True)]
        for name, m in part["modalities"].items():
            mine = out["modalities"].setdefault(name, {"tokens": 0, "samples": 0})
            mine["tokens"] += m["tokens"]
            mine["samples"] += m["samples"]
    out["modalities"] = dict(sorted(out["modalities"].items()))
    return out


def subtract_stats(total: dict, removed: dict) -> dict:
    """`total` less the statistics of rows deleted from it (exact: both were computed from rows)."""
    out = merge_stats(total)
    out["samples"] -= removed["samples"]
    out["tokens"] -= removed["tokens"]
    out["length_hist"] = [a - b for a, b in zip(out["length_hist"], removed["length_hist"], strict=True)]
    for name, m in removed["modalities"].items():
        mine = out["modalities"][name]
        mine["tokens"] -= m["tokens"]
        mine["samples"] -= m["samples"]
        if mine["samples"] == 0 and mine["tokens"] == 0:
            del out["modalities"][name]
    return out


def hist_edges() -> list[int]:
    return [2**b for b in range(HIST_BINS + 1)]
