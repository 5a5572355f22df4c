"""The dataset's source index: which input files a snapshot holds samples of.

Every committed job writes `_sources.json` beside its shards: one entry per input file it read
(path, size, mtime_ns, sha256), and a tombstone (`{"path": ..., "removed": true}`) for each file
whose samples it deleted (a changed file is deleted and re-read; a file gone from its folder is
deleted under `ingest --sync`). Folding those entries over a snapshot's ancestry, oldest first,
gives the index at that snapshot: the latest entry per path wins, a tombstone removes it. Each
entry is returned with the job and snapshot that wrote it. Expired ancestors take part through
their archived summaries (`TokenCatalog.ancestry`), and gc keeps their `_sources.json`.
"""

from __future__ import annotations

from tokenloom.catalog.maintenance import read_json
from tokenloom.catalog.store import TokenCatalog


def source_index(catalog: TokenCatalog, dataset: str, at: str | int | None = None) -> dict[str, dict]:
    """path -> the entry the latest job of the snapshot's ancestry recorded for it (with
    `job_id` and `snapshot_id`); paths whose samples were deleted are absent."""
    if not catalog.exists(dataset):
        return {}
    snap = catalog.snapshot(dataset, at)
    if snap is None:
        return {}
    index: dict[str, dict] = {}
    for s in catalog.ancestry(dataset, snap):
        side = s.tokenloom.get("sources_file")
        if not side:
            continue
        for entry in read_json(side):
            if entry.get("removed"):
                index.pop(entry["path"], None)
            else:
                index[entry["path"]] = entry | {"job_id": s.tokenloom.get("job_id"), "snapshot_id": s.snapshot_id}
    return index
