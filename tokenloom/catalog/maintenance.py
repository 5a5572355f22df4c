"""Catalog maintenance: checksums at commit, `verify` against them, and `gc` of orphan files.

Checksums are SHA-256 of each Parquet file's bytes, computed by the writer from the buffer it
writes (no re-read) and stored per job in a JSON side file that the snapshot names. `verify`
re-reads every data file of a snapshot and reports missing, unreadable or changed files by
path. `gc` deletes files under a table's data folder that no snapshot references and that are
older than a grace period, so a job still writing is never collected.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from tokenloom.catalog.store import TokenCatalog
from tokenloom.catalog.uris import filesystem_and_path as _fs
from tokenloom.catalog.uris import to_uri


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def write_json(uri: str, doc: object) -> None:
    filesystem, path = _fs(uri)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as out:
        out.write(json.dumps(doc, indent=1, sort_keys=True).encode())


def read_json(uri: str) -> object:
    filesystem, path = _fs(uri)
    with filesystem.open_input_stream(path) as f:
        return json.loads(f.read())


@dataclass
class VerifyReport:
    dataset: str
    snapshot_id: int | None
    files_checked: int = 0
    problems: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(catalog: TokenCatalog, name: str, at: str | int | None = None) -> VerifyReport:
    snap = catalog.snapshot(name, at)
    report = VerifyReport(name, snap.snapshot_id if snap else None)
    if snap is None:
        return report
    recorded: dict[str, str] = {}
    for s in catalog.history(name):  # checksums of every job up to and including this snapshot
        side = s.tokenloom.get("checksums_file")
        if side:
            try:
                recorded.update(read_json(side))
            except (OSError, ValueError) as exc:
                report.problems.append({"path": side, "problem": f"checksum record unreadable: {exc}"})
        if s.snapshot_id == snap.snapshot_id:
            break
    for f in catalog.data_files(name, snap.snapshot_id):
        report.files_checked += 1
        filesystem, path = _fs(f.path)
        try:
            with filesystem.open_input_stream(path) as stream:
                data = stream.read()
        except (FileNotFoundError, OSError) as exc:
            report.problems.append({"path": f.path, "problem": f"missing or unreadable: {exc}"})
            continue
        expected = recorded.get(f.path)
        if expected is None:
            report.problems.append({"path": f.path, "problem": "no checksum recorded at commit"})
        elif sha256_bytes(data) != expected:
            report.problems.append({"path": f.path, "problem": "checksum mismatch: the file changed after commit"})
        elif len(data) != f.size_bytes:
            report.problems.append({"path": f.path, "problem": f"size {len(data)} != {f.size_bytes} at commit"})
        else:
            try:
                pq.ParquetFile(pa.BufferReader(data))
            except (OSError, ValueError, pa.ArrowException) as exc:  # a file can match its checksum and still be garbage if written so
                report.problems.append({"path": f.path, "problem": f"not a readable Parquet file: {exc}"})
    return report


@dataclass
class GcReport:
    dataset: str
    deleted: list[str] = field(default_factory=list)
    kept_recent: list[str] = field(default_factory=list)
    referenced: int = 0


def gc(catalog: TokenCatalog, name: str, older_than_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Delete unreferenced files under the dataset's data folder older than `older_than_s`."""
    table = catalog.table(name)
    keep = catalog.referenced_files(name)
    report = GcReport(name, referenced=len(keep))
    data_root = f"{table.metadata.location}/data"
    filesystem, root = _fs(data_root)
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        return report
    now = time.time()
    for entry in filesystem.get_file_info(pafs.FileSelector(root, recursive=True)):
        if entry.type != pafs.FileType.File:
            continue
        uri = to_uri(data_root, entry.path)
        if uri in keep:
            continue
        age = now - (entry.mtime.timestamp() if entry.mtime else now)
        if age < older_than_s:
            report.kept_recent.append(uri)
            continue
        if not dry_run:
            filesystem.delete_file(entry.path)
        report.deleted.append(uri)
    return report
