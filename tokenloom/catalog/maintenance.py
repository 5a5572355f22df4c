"""Catalog maintenance: checksums at commit, `verify` against them, `expire` of old snapshots,
and `gc` of the files nothing needs any more.

Checksums are SHA-256 of each Parquet file's bytes, computed by the writer from the buffer it
writes (no re-read) and stored per job in a JSON side file that the snapshot names. `verify`
re-reads every data file of a snapshot and reports missing, unreadable or changed files by
path.

`expire` removes old snapshots through pyiceberg (never the current one, a tagged one, or the
last N). Our figures are per job and read along a snapshot's ancestry (totals, source index,
side tables, vocabulary history, checksums), while pyiceberg forgets an expired snapshot and
clears its child's parent link. So the expired snapshots' summaries are kept as they were in an
archive: a JSON file under the table's metadata folder, named by the table property
`tokenloom.archive` (set in the same commit as the expiry), holding each expired snapshot's
summary with its parent, and the parent each remaining snapshot lost. The ancestry walk reads
through it (`TokenCatalog.ancestry`), so every figure stays exact with no second, folded way of
computing it, and the side files the archived jobs name stay referenced. Run one expire per
dataset at a time: two at once could each write an archive without the other's snapshots.

`gc` deletes what no live snapshot needs, once older than a grace period (so a job still
writing is never collected): files under the table's data folder that neither a live snapshot
nor a job of the history (archived ones included) names, and under its metadata folder the
manifest lists and manifests no live snapshot uses and the `*.metadata.json` files that are
neither current nor in the metadata log (pyiceberg's `create_table` race leaves those too).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table.update.snapshot import ExpireSnapshots

from tokenloom.catalog.store import ARCHIVE_PROPERTY, SnapshotInfo, TokenCatalog
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
    for s in catalog.ancestry(name, snap):  # checksums of every job the snapshot was built by
        # the job's own files, and the files it rewrote when it deleted rows (`rewrite_checksums_file`)
        for side in (v for k, v in sorted(s.tokenloom.items()) if k.endswith("checksums_file") and v):
            try:
                recorded.update(read_json(side))
            except (OSError, ValueError) as exc:
                report.problems.append({"path": side, "problem": f"checksum record unreadable: {exc}"})
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
    deleted: list[str] = field(default_factory=list)  # under the data folder
    deleted_metadata: list[str] = field(default_factory=list)  # manifest lists, manifests, metadata files
    kept_recent: list[str] = field(default_factory=list)
    referenced: int = 0


def gc(catalog: TokenCatalog, name: str, older_than_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """Delete files no live snapshot needs, under the dataset's data and metadata folders,
    once older than `older_than_s`."""
    table = catalog.table(name)
    keep = catalog.referenced_files(name)
    keep_metadata = referenced_metadata(table)
    report = GcReport(name, referenced=len(keep) + len(keep_metadata))
    location = table.metadata.location
    _sweep(f"{location}/data", keep, older_than_s, dry_run, report.deleted, report.kept_recent)
    _sweep(f"{location}/metadata", keep_metadata, older_than_s, dry_run, report.deleted_metadata, report.kept_recent)
    return report


def referenced_metadata(table) -> set[str]:
    """The metadata files a pyiceberg table still needs: the current metadata file and those of
    its metadata log, each live snapshot's manifest list and manifests, statistics files, and
    our archive of expired snapshots."""
    meta = table.metadata
    keep = {table.metadata_location, *(entry.metadata_file for entry in meta.metadata_log)}
    for snap in meta.snapshots:
        keep.add(snap.manifest_list)
        keep.update(m.manifest_path for m in snap.manifests(table.io))
    keep.update(f.statistics_path for f in meta.statistics)
    keep.update(f.statistics_path for f in meta.partition_statistics)
    if meta.properties.get(ARCHIVE_PROPERTY):
        keep.add(meta.properties[ARCHIVE_PROPERTY])
    return keep


def _sweep(root_uri: str, keep: set[str], older_than_s: float, dry_run: bool,
           deleted: list[str], kept_recent: list[str]) -> None:
    filesystem, root = _fs(root_uri)
    if filesystem.get_file_info(root).type == pafs.FileType.NotFound:
        return
    now = time.time()
    for entry in filesystem.get_file_info(pafs.FileSelector(root, recursive=True)):
        if entry.type != pafs.FileType.File:
            continue
        uri = to_uri(root_uri, entry.path)
        if uri in keep:
            continue
        age = now - (entry.mtime.timestamp() if entry.mtime else now)
        if age < older_than_s:
            kept_recent.append(uri)
            continue
        if not dry_run:
            filesystem.delete_file(entry.path)
        deleted.append(uri)


@dataclass
class ExpireReport:
    dataset: str
    expired: list[int] = field(default_factory=list)  # snapshot ids, oldest first
    kept: list[int] = field(default_factory=list)
    dry_run: bool = False
    archive_file: str | None = None


def expirable(snapshots: list[SnapshotInfo], protected: set[int], cutoff_ms: int, retain_last: int) -> list[int]:
    """Ids of the snapshots to expire, oldest first: committed before `cutoff_ms`, not protected
    (branch heads, the current snapshot among them, and tagged ones), not among the
    `retain_last` newest."""
    if retain_last < 1:
        raise ValueError(f"--retain-last must keep at least 1 snapshot, got {retain_last}")
    by_age = sorted(snapshots, key=lambda s: s.timestamp_ms)  # stable: commit order breaks ties
    newest = {s.snapshot_id for s in by_age[-retain_last:]}
    return [s.snapshot_id for s in by_age
            if s.timestamp_ms < cutoff_ms and s.snapshot_id not in protected and s.snapshot_id not in newest]


def expire(catalog: TokenCatalog, name: str, older_than_s: float, retain_last: int = 1, dry_run: bool = False,
           now_s: float | None = None, attempts: int = 5) -> ExpireReport:
    """Expire the snapshots committed more than `older_than_s` ago (see `expirable`), keeping
    their summaries in the archive; `catalog gc` then removes the files only they needed."""
    if older_than_s < 0:
        raise ValueError(f"--older-than takes a number of hours >= 0, got {older_than_s / 3600:g}")
    cutoff_ms = int(((time.time() if now_s is None else now_s) - older_than_s) * 1000)
    for attempt in range(attempts):
        table = catalog.table(name)
        snaps = catalog.history(name, table)
        protected = {ref.snapshot_id for ref in table.metadata.refs.values()}
        ids = expirable(snaps, protected, cutoff_ms, retain_last)
        report = ExpireReport(name, ids, [s.snapshot_id for s in snaps if s.snapshot_id not in set(ids)], dry_run)
        if dry_run or not ids:
            return report
        report.archive_file = _write_archive(catalog, name, table, snaps, set(ids))
        try:
            with table.transaction() as tx:  # one commit: the archive is named exactly when the snapshots go
                tx.set_properties({ARCHIVE_PROPERTY: report.archive_file})
                ExpireSnapshots(tx).by_ids(ids).commit()
        except CommitFailedException:  # another writer moved the table: plan again (gc collects the file)
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (1 + attempt))
            continue
        return report
    raise RuntimeError(f"expiry on {name!r} did not land after {attempts} attempts")


def _write_archive(catalog: TokenCatalog, name: str, table, snaps: list[SnapshotInfo], gone: set[int]) -> str:
    """A new archive: the previous one plus the snapshots in `gone`, each with its parent, and the
    parent each remaining snapshot loses (or had already lost)."""
    archived, lost = catalog.archived(name, table)

    def parent(s: SnapshotInfo) -> int | None:
        return s.parent_id if s.parent_id is not None else lost.get(s.snapshot_id)

    archived |= {s.snapshot_id: replace(s, parent_id=parent(s)) for s in snaps if s.snapshot_id in gone}
    lost_now = {s.snapshot_id: parent(s) for s in snaps
                if s.snapshot_id not in gone and parent(s) is not None and (s.parent_id is None or s.parent_id in gone)}
    uri = f"{table.metadata.location}/metadata/tokenloom-archive-{uuid.uuid4().hex}.json"
    write_json(uri, {"snapshots": [asdict(s) for s in sorted(archived.values(), key=lambda s: s.timestamp_ms)],
                     "lost_parents": {str(k): v for k, v in lost_now.items()}})
    return uri
