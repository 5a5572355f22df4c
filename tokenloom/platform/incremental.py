"""Incremental ingestion: which inputs a dataset already holds, and which are new.

Every committed job writes `_sources.json` beside its shards: one entry per input file it read
(path, size, mtime, and since this module a SHA-256 of the content). The union of those entries
over the current snapshot's ancestry is the dataset's *source index*. A new job classifies its
inputs against it:

    new        a path the dataset never read: tokenized by this job
    unchanged  same path, same content (same size and mtime, or the same hash after a touch)
    changed    same path, other content: reported, not re-ingested (replacing a file's samples
               needs a row-level delete in the same snapshot; not built yet, see issue 14)
    removed    an indexed path under one of the job's input folders that is gone: reported;
               its samples stay

So adding one file to a folder and ingesting the folder again tokenizes that one file, and
re-running the same inputs tokenizes nothing (the job is a no-op, as before).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.catalog.maintenance import read_json
from tokenloom.catalog.store import TokenCatalog
from tokenloom.datasets.sources import SourceFile


def content_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_entry(f: SourceFile, sha256: str | None = None) -> dict:
    """What a job records of an input it read."""
    return {"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "sha256": sha256 or content_hash(f.path)}


def source_index(catalog: TokenCatalog, dataset: str) -> dict[str, dict]:
    """path -> the latest entry any job of the current snapshot's ancestry recorded for it."""
    if not catalog.exists(dataset):
        return {}
    snap = catalog.snapshot(dataset)
    if snap is None:
        return {}
    index: dict[str, dict] = {}
    for s in catalog.ancestry(dataset, snap):
        side = s.tokenloom.get("sources_file")
        if side:
            for entry in read_json(side):
                index[entry["path"]] = entry
    return index


@dataclass
class SourceChanges:
    new: list[SourceFile] = field(default_factory=list)
    unchanged: list[SourceFile] = field(default_factory=list)
    changed: list[SourceFile] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)  # path -> sha256 of the files hashed here

    def counts(self) -> dict[str, int]:
        return {"new": len(self.new), "changed": len(self.changed), "unchanged": len(self.unchanged),
                "removed": len(self.removed)}


def classify(files: Sequence[SourceFile], index: dict[str, dict], roots: Sequence[str | Path]) -> SourceChanges:
    """Sort a job's inputs against the dataset's source index (module docstring)."""
    out = SourceChanges()
    for f in files:
        known = index.get(f.path)
        if known is None:
            out.new.append(f)
            continue
        if known.get("size") == f.size and known.get("mtime_ns") == f.mtime_ns:
            out.unchanged.append(f)
            continue
        digest = out.hashes[f.path] = content_hash(f.path)
        (out.unchanged if known.get("sha256") == digest else out.changed).append(f)
    seen = {f.path for f in files}
    folders = [str(Path(r).expanduser().resolve()) for r in roots]
    for path in sorted(index):
        if path not in seen and any(path == root or path.startswith(root.rstrip("/") + "/") for root in folders):
            out.removed.append(path)
    return out
