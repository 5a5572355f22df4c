"""The dataset catalog: one Apache Iceberg table per dataset, one snapshot per ingestion job.

pyiceberg's SQL catalog keeps table pointers in SQLite (embedded) or PostgreSQL (many
writers); table metadata and Parquet data files live in the warehouse (a local folder or
any pyarrow filesystem URI). Ingestion writes Parquet files itself (in Ray tasks) and the
driver commits them with `add_files`, so a job is one atomic snapshot and a job that dies
before its commit adds no snapshot: readers see the table as it was, and `catalog gc` removes
the files it left. The snapshot summary carries the job's lineage
and counts, so listing and showing datasets never scans data.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NoSuchTableError,
    TableAlreadyExistsError,
)

from tokenloom.catalog.names import check_name
from tokenloom.catalog.schema import SHARD_SCHEMA
from tokenloom.catalog.stats import empty_stats, merge_stats, subtract_stats
from tokenloom.catalog.uris import filesystem_and_path

PROP = "tokenloom."  # prefix of our snapshot-summary properties
# Table property naming the JSON file that keeps expired snapshots' summaries (catalog/maintenance.expire):
# the ancestry, totals, source index and side tables of the snapshots that remain read through it.
ARCHIVE_PROPERTY = PROP + "archive"
# One ingestion job is one append; merging small manifests at commit keeps scan planning from
# reading one manifest per job forever (measured in bench/bench_catalog.py).
TABLE_PROPERTIES = {"commit.manifest-merge.enabled": "true", "commit.manifest.min-count-to-merge": "8"}


class DatasetNotFound(LookupError):
    def __str__(self) -> str:  # LookupError quotes its message; ours is a sentence
        return str(self.args[0])


@dataclass
class CatalogConfig:
    """Where the catalog lives. Empty fields take the embedded defaults under the home."""

    uri: str = ""  # e.g. postgresql+psycopg2://user@host:5432/db ; default sqlite under home
    warehouse: str = ""  # local path or URI (s3://bucket/prefix); default <home>/warehouse
    namespace: str = "tokenloom"
    name: str = "tokenloom"

    def resolved(self, home: Path) -> CatalogConfig:
        home = Path(home).absolute()
        uri = self.uri or f"sqlite:///{home / 'catalog.db'}"
        warehouse = self.warehouse or (home / "warehouse").as_uri()
        if "://" not in warehouse:
            warehouse = Path(warehouse).absolute().as_uri()
        return CatalogConfig(uri, warehouse, self.namespace, self.name)


def _sample_ids(paths: list[str]) -> list[str]:
    """The `sample_id` column of data files, read alone."""
    import pyarrow.parquet as pq

    out: list[str] = []
    for uri in paths:
        filesystem, path = filesystem_and_path(uri)
        out += pq.read_table(path, columns=["sample_id"], filesystem=filesystem)["sample_id"].to_pylist()
    return out


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: int
    timestamp_ms: int
    operation: str
    properties: dict[str, str]
    parent_id: int | None = None

    @property
    def tokenloom(self) -> dict[str, str]:
        return {k[len(PROP) :]: v for k, v in self.properties.items() if k.startswith(PROP)}


@dataclass(frozen=True)
class DataFile:
    path: str
    record_count: int
    size_bytes: int



class NotAnAncestor(ValueError):
    """A snapshot is no longer in the current snapshot's history (the table was rolled back)."""


@dataclass(frozen=True)
class Addition:
    """What one snapshot changed, for a reader that follows a dataset (`TokenCatalog.additions`):
    the data files of its new rows and the sample ids it deleted."""

    snapshot: SnapshotInfo
    files: list[DataFile]
    deleted: list[str]


class TokenCatalog:
    """Datasets of token shards, their snapshots and data files."""

    def __init__(self, config: CatalogConfig, home: Path):
        self.config = config.resolved(home)
        if self.config.uri.startswith("sqlite:///"):
            Path(self.config.uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        if self.config.warehouse.startswith("file://"):
            Path(self.config.warehouse[len("file://") :]).mkdir(parents=True, exist_ok=True)
        self._catalog = SqlCatalog(self.config.name, uri=self.config.uri, warehouse=self.config.warehouse)
        with contextlib.suppress(NamespaceAlreadyExistsError):
            self._catalog.create_namespace(self.config.namespace)

    def _ident(self, name: str) -> tuple[str, str]:
        return (self.config.namespace, check_name(name))

    # -- datasets -------------------------------------------------------------------------
    def list_datasets(self) -> list[str]:
        return sorted(ident[-1] for ident in self._catalog.list_tables(self.config.namespace))

    def table(self, name: str):
        try:
            return self._catalog.load_table(self._ident(name))
        except NoSuchTableError:
            known = ", ".join(self.list_datasets()) or "none yet"
            raise DatasetNotFound(
                f"no dataset named {name!r} in the catalog (known: {known}); ingest one with `tokenloom ingest`"
            ) from None

    def ensure_dataset(self, name: str):
        try:
            table = self._catalog.create_table(self._ident(name), schema=SHARD_SCHEMA, properties=TABLE_PROPERTIES)
        except TableAlreadyExistsError:
            return self._evolve(self._catalog.load_table(self._ident(name)))
        # partitioned by modality mix: text-only training skips image and audio files at planning
        try:
            with table.update_spec() as spec:
                spec.add_identity("modalities")
        except CommitFailedException:  # another writer created and partitioned it at the same time
            pass
        return self._catalog.load_table(self._ident(name))

    def _evolve(self, table):
        """Add the shard columns a table made by an older version lacks (Iceberg schema
        evolution: old files read them as null), so today's files can be added to it."""
        have = {f.name for f in table.schema().fields}
        if all(f.name in have for f in SHARD_SCHEMA):
            return table
        try:
            with table.update_schema() as update:
                update.union_by_name(SHARD_SCHEMA)
        except CommitFailedException:  # another writer evolved it at the same time
            pass
        return self._catalog.load_table(table.name())

    def data_location(self, name: str, job_id: str) -> str:
        """Where a job writes its Parquet files before they are committed."""
        return f"{self.ensure_dataset(name).metadata.location}/data/{check_name(job_id, 'job id')}"

    # -- snapshots ------------------------------------------------------------------------
    def history(self, name: str, table=None) -> list[SnapshotInfo]:
        table = table or self.table(name)
        out = []
        for snap in table.metadata.snapshots:
            summary = snap.summary
            props = dict(summary.additional_properties) if summary else {}
            op = summary.operation.value if summary else "unknown"
            out.append(SnapshotInfo(snap.snapshot_id, snap.timestamp_ms, op, props, snap.parent_snapshot_id))
        return out

    def snapshot(self, name: str, at: str | int | None = None, table=None) -> SnapshotInfo | None:
        """The snapshot `at` (an id or a tag) or the current one; None for a dataset with no commit yet."""
        table = table or self.table(name)
        snaps = self.history(name, table)
        if not snaps:
            return None
        if at is None:
            wanted = table.metadata.current_snapshot_id
        elif isinstance(at, int) or str(at).isdigit():
            wanted = int(at)
        else:
            check_name(str(at), "tag")
            tagged = table.snapshot_by_name(str(at))
            if tagged is None:
                tags = ", ".join(sorted(self.tags(name))) or "none"
                raise DatasetNotFound(f"dataset {name!r} has no tag {at!r} (tags: {tags})")
            wanted = tagged.snapshot_id
        for snap in snaps:
            if snap.snapshot_id == wanted:
                return snap
        raise DatasetNotFound(f"dataset {name!r} has no snapshot {at}; see `tokenloom catalog history {name}`")

    def ancestry(self, name: str, snap: SnapshotInfo) -> list[SnapshotInfo]:
        """`snap` and the snapshots it was built on, oldest first: what the table holds at `snap`.
        Expired ancestors take part through their archived summaries (see `archived`)."""
        table = self.table(name)
        archived, lost_parents = self.archived(name, table)
        by_id = archived | {s.snapshot_id: s for s in self.history(name, table)}
        chain, cursor = [], snap
        while cursor is not None:
            chain.append(cursor)
            parent = cursor.parent_id if cursor.parent_id is not None else lost_parents.get(cursor.snapshot_id)
            cursor = by_id.get(parent) if parent is not None else None
        return chain[::-1]

    def archived(self, name: str, table=None) -> tuple[dict[int, SnapshotInfo], dict[int, int]]:
        """(expired snapshot id -> its summary as it was, live snapshot id -> the parent it had
        before that parent expired): pyiceberg drops expired snapshots and clears their children's
        parent links, so `catalog expire` keeps both in the file the table property names."""
        table = table or self.table(name)
        uri = table.properties.get(ARCHIVE_PROPERTY)
        if not uri:
            return {}, {}
        filesystem, path = filesystem_and_path(uri)
        with filesystem.open_input_stream(path) as f:
            doc = json.loads(f.read())
        snaps = {int(s["snapshot_id"]): SnapshotInfo(int(s["snapshot_id"]), int(s["timestamp_ms"]), s["operation"],
                                                     dict(s["properties"]), s.get("parent_id"))
                 for s in doc["snapshots"]}
        return snaps, {int(child): int(parent) for child, parent in doc["lost_parents"].items()}

    def tags(self, name: str) -> dict[str, int]:
        refs = self.table(name).metadata.refs
        return {ref: r.snapshot_id for ref, r in refs.items() if r.snapshot_ref_type.value == "tag"}

    def tag(self, name: str, tag: str, at: str | int | None = None) -> int:
        """Point tag `tag` at snapshot `at` (default: current); returns the snapshot id."""
        check_name(tag, "tag")
        if tag.isdigit():
            raise ValueError(f"invalid tag name {tag!r}: a tag of digits only would read as a snapshot id")
        snap = self.snapshot(name, at)
        if snap is None:
            raise ValueError(f"dataset {name!r} has no snapshot to tag")
        if tag in self.tags(name):
            raise ValueError(f"tag {tag!r} already exists on {name!r}; tags are immutable, pick another name")
        self.table(name).manage_snapshots().create_tag(snap.snapshot_id, tag).commit()
        return snap.snapshot_id

    def exists(self, name: str) -> bool:
        return self._catalog.table_exists(self._ident(name))

    def find_job(self, name: str, job_id: str) -> SnapshotInfo | None:
        """The snapshot that committed `job_id`: a live one, or one `catalog expire` archived (its
        rows are still in the table, so the job stays done)."""
        if not self.exists(name):
            return None
        table = self.table(name)
        for snap in self.history(name, table):
            if snap.tokenloom.get("job_id") == job_id:
                return snap
        for snap in self.archived(name, table)[0].values():
            if snap.tokenloom.get("job_id") == job_id:
                return snap
        return None

    def commit_job(self, name: str, job_id: str, files: list[str], properties: dict[str, object],
                   stats: dict | None = None, attempts: int = 20,
                   delete_sources: list[str] | tuple[str, ...] = ()) -> SnapshotInfo:
        """Commit a job's data files as one snapshot, exactly once.

        `delete_sources`: input files whose existing rows the same snapshot deletes (a changed
        file's old samples, or files removed under `--sync`): the data files holding them are
        rewritten without them (`catalog/replace.py`) and swapped in one overwrite snapshot, whose
        summary records the deleted rows' statistics (`removed_stats`) for the totals.
        A job already committed is not committed again. On a conflict with another writer the
        commit is retried on the refreshed table (with jittered back-off; the rewrite is planned
        again, against the table as it then is).
        """
        for attempt in range(attempts):
            existing = self.find_job(name, job_id)
            if existing is not None:
                return existing
            table = self.ensure_dataset(name)
            # only the job's own figures are stored: totals are summed over a snapshot's ancestry
            # when read, so they stay exact whichever order concurrent writers land in
            props = {PROP + "job_id": job_id}
            props.update({PROP + k: v if isinstance(v, str) else json.dumps(v) for k, v in properties.items()})
            props[PROP + "stats"] = json.dumps(stats or empty_stats())
            try:
                if delete_sources:
                    self._replace(table, job_id, list(files), props, delete_sources)
                else:
                    table.add_files(file_paths=list(files), snapshot_properties=props)
            except CommitFailedException:
                if attempt == attempts - 1:
                    raise
                time.sleep(random.uniform(0.05, 0.3) * (1 + attempt))
                continue
            committed = self.find_job(name, job_id)
            if committed is not None:
                return committed
        raise RuntimeError(f"commit of job {job_id} to {name!r} did not land after {attempts} attempts")

    def _replace(self, table, job_id: str, files: list[str], props: dict[str, str], delete_sources) -> None:
        """One overwrite snapshot: the job's files in, `delete_sources`' rows out (copy-on-write)."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        from tokenloom.catalog.replace import rewrite_without_sources

        location = f"{table.metadata.location}/data/{check_name(job_id, 'job id')}"
        plan = rewrite_without_sources(table, table.metadata.current_snapshot_id, delete_sources, location)
        props = props | {PROP + "removed_stats": json.dumps(plan.removed_stats),
                         PROP + "removed_samples": str(len(plan.removed_samples)),
                         PROP + "deleted_sources": json.dumps(sorted(set(delete_sources)))}
        if plan.checksums_file:
            props[PROP + "rewrite_checksums_file"] = plan.checksums_file
        with table.transaction() as tx:
            if tx.table_metadata.name_mapping() is None:
                tx.set_properties(**{"schema.name-mapping.default":
                                     tx.table_metadata.schema().name_mapping.model_dump_json()})
            with tx.update_snapshot(snapshot_properties=props).overwrite() as overwrite:
                for data_file in plan.dropped:
                    overwrite.delete_data_file(data_file)
                for path in plan.added + files:
                    overwrite.append_data_file(parquet_file_to_data_file(table.io, tx.table_metadata, path))

    def additions(self, name: str, since: int) -> list[Addition]:
        """The snapshots committed after `since` up to the current one, oldest first, each with the
        data files of its new rows and the sample ids it deleted. A job that deleted rows
        (`commit_job`'s `delete_sources`) dropped the files holding them and added those files
        rewritten without them (`rewrite_checksums_file` names the rewrites): the rewrites hold rows
        the table had before, so they are not new rows, and the deleted samples are the dropped
        files' rows that no rewrite kept. Raises ValueError when `since` is no longer an ancestor of
        the current snapshot (a rollback)."""
        current = self.snapshot(name)
        chain = self.ancestry(name, current) if current is not None else []
        ids = [s.snapshot_id for s in chain]
        if since not in ids:
            raise NotAnAncestor(f"snapshot {since} of {name!r} is not an ancestor of the current snapshot "
                             f"{ids[-1] if ids else None}")
        before = {f.path: f for f in self.data_files(name, since)}
        out = []
        for snap in chain[ids.index(since) + 1 :]:
            files = self.data_files(name, snap.snapshot_id)
            rewritten: set[str] = set()
            side = snap.tokenloom.get("rewrite_checksums_file")
            if side:
                filesystem, path = filesystem_and_path(side)
                try:
                    with filesystem.open_input_stream(path) as f:
                        rewritten = set(json.loads(f.read()))
                except (OSError, ValueError) as exc:
                    raise OSError(f"snapshot {snap.snapshot_id} of {name!r} rewrote files but their record "
                                  f"{side} is unreadable ({exc}): cannot tell its new rows from kept ones") from exc
            now = {f.path for f in files}
            dropped = [p for p in before if p not in now]
            deleted: list[str] = []
            if dropped:
                kept = set(_sample_ids([f.path for f in files if f.path in rewritten]))
                deleted = sorted(set(_sample_ids(dropped)) - kept)
            out.append(Addition(snap, [f for f in files if f.path not in before and f.path not in rewritten],
                                deleted))
            before = {f.path: f for f in files}
        return out

    # -- reads ----------------------------------------------------------------------------
    def data_files(self, name: str, at: str | int | None = None) -> list[DataFile]:
        table = self.table(name)
        snap = self.snapshot(name, at, table)
        if snap is None:
            return []
        tasks = table.scan(snapshot_id=snap.snapshot_id).plan_files()
        files = [DataFile(t.file.file_path, t.file.record_count, t.file.file_size_in_bytes) for t in tasks]
        return sorted(files, key=lambda f: f.path)

    def scan(self, name: str, at: str | int | None = None, where=None,
             columns: tuple[str, ...] = ("*",)) -> pa.Table:
        """Rows of a snapshot as Arrow; `where` is an Iceberg filter expression pushed into the scan
        (for example "num_tokens > 100 and source = 'a.txt'") or a pyiceberg BooleanExpression."""
        table = self.table(name)
        snap = self.snapshot(name, at, table)
        if snap is None:
            return SHARD_SCHEMA.empty_table()
        kwargs = {"row_filter": where} if where else {}
        return table.scan(snapshot_id=snap.snapshot_id, selected_fields=columns, **kwargs).to_arrow()

    def referenced_files(self, name: str) -> set[str]:
        """Every file any snapshot still needs: data files of the live snapshots, plus the side
        files of every job in the dataset's history (expired snapshots' included: the source
        index and side tables of the snapshots that remain still read them) and the archive."""
        table = self.table(name)
        keep: set[str] = set()
        live = self.history(name, table)
        archived, _ = self.archived(name, table)
        if table.properties.get(ARCHIVE_PROPERTY):
            keep.add(table.properties[ARCHIVE_PROPERTY])
        for snap in live:
            keep.update(t.file.file_path for t in table.scan(snapshot_id=snap.snapshot_id).plan_files())
        for snap in [*live, *archived.values()]:
            tl = snap.tokenloom
            for key, value in tl.items():  # side files: one (`*_file`) or a JSON list (`*_files`)
                if key.endswith("_file") and value:
                    keep.add(value)
                elif key.endswith("_files") and value:
                    keep.update(json.loads(value))
        return keep

    def summary(self, name: str, at: str | int | None = None) -> dict:
        """Counts and lineage of a snapshot, from its summary (no data is read)."""
        snap = self.snapshot(name, at)
        out: dict = {"dataset": name, "snapshots": len(self.history(name))}
        if snap is None:
            return out | {"snapshot_id": None, "samples": 0, "tokens": 0, "quarantined": 0, "total_quarantined": 0,
                          "stats": empty_stats(), "job_stats": empty_stats(), "tags": [], "quarantine_reasons": {},
                          "job_id": None, "job_samples": 0, "job_tokens": 0}
        tl = snap.tokenloom
        chain = self.ancestry(name, snap)
        # rows a job deleted (replaced or removed sources) leave the totals with their statistics
        totals = subtract_stats(
            merge_stats(*(json.loads(s.tokenloom.get("stats", "null")) or empty_stats() for s in chain)),
            merge_stats(*(json.loads(s.tokenloom.get("removed_stats", "null")) or empty_stats() for s in chain)))
        out |= {
            "snapshot_id": snap.snapshot_id,
            "timestamp_ms": snap.timestamp_ms,
            "job_id": tl.get("job_id"),
            "samples": int(snap.properties.get("total-records", 0)),
            "tokens": totals["tokens"],
            "job_samples": int(tl.get("samples", 0)),
            "job_tokens": int(tl.get("tokens", 0)),
            "quarantined": int(tl.get("quarantined", 0)),
            "total_quarantined": sum(int(s.tokenloom.get("quarantined", 0)) for s in chain),
            "quarantine_reasons": json.loads(tl.get("quarantine_reasons", "{}")),
            # valid records the job's quality filters dropped, and samples dropped as duplicates
            "filtered": int(tl.get("filtered", 0)),
            "filter_counts": json.loads(tl.get("filter_counts", "{}")),
            "total_filtered": sum(int(s.tokenloom.get("filtered", 0)) for s in chain),
            "duplicates": int(tl.get("duplicates", 0)),
            "duplicate_counts": json.loads(tl.get("duplicate_counts", "{}")),
            "total_duplicates": sum(int(s.tokenloom.get("duplicates", 0)) for s in chain),
            "deleted_samples": int(tl.get("removed_samples", 0)),
            "pools": json.loads(tl.get("pools", "{}")),  # the job's per-pool figures
            "quarantine_files": json.loads(tl.get("quarantine_files", "[]")),
            "data_files": int(snap.properties.get("total-data-files", 0)),
            "vocab_id": tl.get("vocab_id"),
            "vocab_history": _vocab_history(chain),
            "bundle_ids": json.loads(tl.get("bundle_ids", "[]")),
            "sources_hash": tl.get("sources_hash"),
            "code_version": tl.get("code_version"),
            "sources_file": tl.get("sources_file"),
            "checksums_file": tl.get("checksums_file"),
            "stats": totals,
            "job_stats": json.loads(tl.get("stats", "null")) or empty_stats(),
            "tags": sorted(t for t, sid in self.tags(name).items() if sid == snap.snapshot_id),
        }
        return out


def _vocab_history(chain: list[SnapshotInfo]) -> list[dict]:
    """The manifests a snapshot's jobs wrote with, oldest first: each vocabulary id with the
    first snapshot that used it (a dataset's manifest changes only by appended ranges)."""
    out: list[dict] = []
    for snap in chain:
        vocab_id = snap.tokenloom.get("vocab_id")
        if vocab_id and (not out or out[-1]["vocab_id"] != vocab_id):
            out.append({"vocab_id": vocab_id, "snapshot_id": snap.snapshot_id})
    return out
