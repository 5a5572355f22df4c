"""Incremental ingestion: which inputs a dataset already holds, and which are new.

Every committed job writes `_sources.json` beside its shards: one entry per input file it read
(path, size, mtime, and since this module a SHA-256 of the content). The union of those entries
over the current snapshot's ancestry is the dataset's *source index*. A new job classifies its
inputs against it:

    new        a path the dataset never read: tokenized by this job
    unchanged  same path, same content (same size and mtime, or the same hash after a touch)
    changed    same path, other content: tokenized again, and its old samples deleted in the
               same snapshot (copy-on-write, `catalog/replace.py`)
    removed    an indexed path under one of the job's input folders that is gone: reported, and
               its samples kept, unless the job runs with `sync` (then they are deleted and the
               path leaves the index through a tombstone entry)

A caption or transcript sidecar, or a media file a pairs file names, has no samples of its own:
when it changes, appears or goes, the samples that read it are rebuilt (`sources.readers_of`).
So adding one file to a folder and ingesting the folder again tokenizes that one file, editing
one file replaces exactly its samples, and re-running the same inputs tokenizes nothing (the job
is a no-op, as before).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.datasets.sources import UNPOOLED, SourceFile, readers_of


def content_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_entry(f: SourceFile, sha256: str | None = None) -> dict:
    """What a job records of an input it read."""
    return {"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "sha256": sha256 or content_hash(f.path)}


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


@dataclass
class IncrementalPlan:
    """What a job does with its inputs: which files to tokenize, whose samples to delete in its
    snapshot, and the source-index entries it records."""

    tokenize: list[SourceFile]
    delete_sources: list[str]
    entries: list[dict]

    @property
    def empty(self) -> bool:
        return not self.tokenize and not self.delete_sources


def plan(files: Sequence[SourceFile], changes: SourceChanges, sync: bool = False) -> IncrementalPlan:
    """Turn a classification into work: new and changed files are tokenized; a changed file's old
    samples are deleted; so are removed files' under `sync`; samples that read a sidecar or a
    referenced file which changed, appeared or went are rebuilt."""
    by_path = {f.path: f for f in files}
    touched_unpooled = [f.path for f in changes.new + changes.changed if f.modality in UNPOOLED] + changes.removed
    rebuilt = {p for p in readers_of(files, touched_unpooled)} - {f.path for f in changes.new}
    changed = {f.path for f in changes.changed if f.modality not in UNPOOLED} | rebuilt
    tokenize = sorted([f for f in changes.new if f.modality not in UNPOOLED] + [by_path[p] for p in changed],
                      key=lambda f: f.path)
    deleted = set(changed) | (set(changes.removed) if sync else set())
    touched = [f for f in changes.unchanged if f.path in changes.hashes]  # same content, new mtime
    recorded = {f.path: f for f in changes.new + changes.changed + touched + [by_path[p] for p in rebuilt]}
    entries = [source_entry(f, changes.hashes.get(f.path)) for f in sorted(recorded.values(), key=lambda f: f.path)]
    if sync:
        entries += [{"path": p, "removed": True} for p in changes.removed]
    return IncrementalPlan(tokenize, sorted(deleted), entries)
