"""What two snapshots of a dataset differ by: samples added and removed, per modality mix, and
sources added, removed and changed.

Samples are compared as sets of `sample_id` (the id names a source and a record, so a sample
re-read from a changed file keeps its id and counts as neither added nor removed; its source
shows as changed). Only the `sample_id` and `modalities` columns are read, so a diff costs a
projection of two scans, and the source indexes come from the jobs' side files. The
comparison itself is pure: `diff_samples` and `diff_sources` take tables and dicts.
"""

from __future__ import annotations

import pyarrow as pa

from tokenloom.catalog.sources import source_index
from tokenloom.catalog.store import TokenCatalog


def diff_samples(before: pa.Table, after: pa.Table) -> dict:
    """Tables with `sample_id` and `modalities` -> counts added and removed, overall and per
    modality mix (an added sample counted under its mix in `after`, a removed one in `before`)."""
    mix_before = dict(zip(before.column("sample_id").to_pylist(), before.column("modalities").to_pylist(), strict=True))
    mix_after = dict(zip(after.column("sample_id").to_pylist(), after.column("modalities").to_pylist(), strict=True))
    added = mix_after.keys() - mix_before.keys()
    removed = mix_before.keys() - mix_after.keys()
    by_mix: dict[str, dict[str, int]] = {}
    for ids, mixes, what in ((added, mix_after, "added"), (removed, mix_before, "removed")):
        for sample_id in ids:
            counts = by_mix.setdefault(mixes[sample_id] or "", {"added": 0, "removed": 0})
            counts[what] += 1
    return {"added": len(added), "removed": len(removed), "by_modalities": dict(sorted(by_mix.items()))}


def diff_sources(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Source indexes (path -> entry) -> the paths added, removed, and changed (same path, other sha256)."""
    return {"added": sorted(after.keys() - before.keys()),
            "removed": sorted(before.keys() - after.keys()),
            "changed": sorted(p for p in before.keys() & after.keys() if before[p].get("sha256") != after[p].get("sha256"))}


def snapshot_diff(catalog: TokenCatalog, name: str, a: str | int, b: str | int) -> dict:
    """How snapshot `b` (id or tag) of dataset `name` differs from snapshot `a`."""
    snap_a, snap_b = catalog.snapshot(name, a), catalog.snapshot(name, b)
    if snap_a is None or snap_b is None:
        raise ValueError(f"dataset {name!r} has no snapshot yet; nothing to compare")
    columns = ("sample_id", "modalities")
    return {
        "dataset": name,
        "from_snapshot": snap_a.snapshot_id,
        "to_snapshot": snap_b.snapshot_id,
        "samples": diff_samples(catalog.scan(name, snap_a.snapshot_id, columns=columns),
                                catalog.scan(name, snap_b.snapshot_id, columns=columns)),
        "sources": diff_sources(source_index(catalog, name, snap_a.snapshot_id),
                                source_index(catalog, name, snap_b.snapshot_id)),
    }
