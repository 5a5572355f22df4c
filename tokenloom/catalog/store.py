"""The dataset catalog: one Apache Iceberg table per dataset, one snapshot per ingestion job.

pyiceberg's SQL catalog keeps table pointers in SQLite (embedded) or PostgreSQL (many
writers); table metadata and Parquet data files live in the warehouse (a local folder or
any pyarrow filesystem URI). Ingestion writes Parquet files itself (in Ray tasks) and the
driver commits them with `add_files`, so a job is one atomic snapshot and a job that dies
before its commit leaves nothing visible. The snapshot summary carries the job's lineage
and counts, so listing and showing datasets never scans data.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError, TableAlreadyExistsError

from tokenloom.catalog.names import check_name
from tokenloom.catalog.schema import SHARD_SCHEMA

PROP = "tokenloom."  # prefix of our snapshot-summary properties


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


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: int
    timestamp_ms: int
    operation: str
    properties: dict[str, str]

    @property
    def tokenloom(self) -> dict[str, str]:
        return {k[len(PROP) :]: v for k, v in self.properties.items() if k.startswith(PROP)}


@dataclass(frozen=True)
class DataFile:
    path: str
    record_count: int
    size_bytes: int


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
            return self._catalog.create_table(self._ident(name), schema=SHARD_SCHEMA)
        except TableAlreadyExistsError:
            return self._catalog.load_table(self._ident(name))

    def data_location(self, name: str, job_id: str) -> str:
        """Where a job writes its Parquet files before they are committed."""
        return f"{self.ensure_dataset(name).metadata.location}/data/{check_name(job_id, 'job id')}"

    # -- snapshots ------------------------------------------------------------------------
    def history(self, name: str) -> list[SnapshotInfo]:
        table = self.table(name)
        out = []
        for snap in table.metadata.snapshots:
            summary = snap.summary
            props = dict(summary.additional_properties) if summary else {}
            op = summary.operation.value if summary else "unknown"
            out.append(SnapshotInfo(snap.snapshot_id, snap.timestamp_ms, op, props))
        return out

    def snapshot(self, name: str, at: str | int | None = None) -> SnapshotInfo | None:
        """The snapshot `at` (id) or the current one; None for a dataset with no commit yet."""
        snaps = self.history(name)
        if not snaps:
            return None
        if at is None:
            current = self.table(name).metadata.current_snapshot_id
            return next(s for s in snaps if s.snapshot_id == current)
        try:
            wanted = int(at)
        except (TypeError, ValueError):
            raise ValueError(f"snapshot must be a numeric snapshot id, got {at!r}") from None
        for snap in snaps:
            if snap.snapshot_id == wanted:
                return snap
        raise DatasetNotFound(
            f"dataset {name!r} has no snapshot {at}; see `tokenloom catalog history {name}`"
        )

    def exists(self, name: str) -> bool:
        return self._catalog.table_exists(self._ident(name))

    def find_job(self, name: str, job_id: str) -> SnapshotInfo | None:
        if not self.exists(name):
            return None
        for snap in self.history(name):
            if snap.tokenloom.get("job_id") == job_id:
                return snap
        return None

    def commit_job(self, name: str, job_id: str, files: list[str], properties: dict[str, object]) -> SnapshotInfo:
        """Commit a job's data files as one snapshot; a job already committed is not committed again."""
        existing = self.find_job(name, job_id)
        if existing is not None:
            return existing
        table = self.ensure_dataset(name)
        previous = self.snapshot(name)
        total_tokens = int(previous.tokenloom.get("total_tokens", 0)) if previous else 0
        total_tokens += int(properties.get("tokens", 0))  # type: ignore[arg-type]
        props = {PROP + "job_id": job_id, PROP + "total_tokens": str(total_tokens)}
        props.update({PROP + k: v if isinstance(v, str) else json.dumps(v) for k, v in properties.items()})
        table.add_files(file_paths=list(files), snapshot_properties=props)
        committed = self.find_job(name, job_id)
        if committed is None:  # pragma: no cover - pyiceberg always records a snapshot
            raise RuntimeError(f"commit of job {job_id} left no snapshot")
        return committed

    # -- reads ----------------------------------------------------------------------------
    def data_files(self, name: str, at: str | int | None = None) -> list[DataFile]:
        snap = self.snapshot(name, at)
        if snap is None:
            return []
        tasks = self.table(name).scan(snapshot_id=snap.snapshot_id).plan_files()
        files = [DataFile(t.file.file_path, t.file.record_count, t.file.file_size_in_bytes) for t in tasks]
        return sorted(files, key=lambda f: f.path)

    def scan(self, name: str, at: str | int | None = None, columns: tuple[str, ...] = ("*",)) -> pa.Table:
        snap = self.snapshot(name, at)
        if snap is None:
            return SHARD_SCHEMA.empty_table()
        return self.table(name).scan(snapshot_id=snap.snapshot_id, selected_fields=columns).to_arrow()

    def summary(self, name: str, at: str | int | None = None) -> dict:
        """Counts and lineage of a snapshot, from its summary (no data is read)."""
        snap = self.snapshot(name, at)
        out: dict = {"dataset": name, "snapshots": len(self.history(name))}
        if snap is None:
            return out | {"snapshot_id": None, "samples": 0, "tokens": 0, "quarantined": 0}
        tl = snap.tokenloom
        out |= {
            "snapshot_id": snap.snapshot_id,
            "timestamp_ms": snap.timestamp_ms,
            "job_id": tl.get("job_id"),
            "samples": int(snap.properties.get("total-records", 0)),
            "tokens": int(tl.get("total_tokens", 0)),
            "job_samples": int(tl.get("samples", 0)),
            "job_tokens": int(tl.get("tokens", 0)),
            "quarantined": int(tl.get("quarantined", 0)),
            "quarantine_reasons": json.loads(tl.get("quarantine_reasons", "{}")),
            "quarantine_files": json.loads(tl.get("quarantine_files", "[]")),
            "data_files": int(snap.properties.get("total-data-files", 0)),
            "vocab_id": tl.get("vocab_id"),
            "bundle_ids": json.loads(tl.get("bundle_ids", "[]")),
            "sources_hash": tl.get("sources_hash"),
            "code_version": tl.get("code_version"),
        }
        return out
