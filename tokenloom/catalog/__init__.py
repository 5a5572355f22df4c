"""catalog: token-shard schema, Iceberg tables, snapshots, lineage and reads."""

from tokenloom.catalog.names import check_name
from tokenloom.catalog.schema import QUARANTINE_SCHEMA, SHARD_SCHEMA, validate_shard_rows
from tokenloom.catalog.store import CatalogConfig, DataFile, DatasetNotFound, SnapshotInfo, TokenCatalog

__all__ = [
    "QUARANTINE_SCHEMA",
    "SHARD_SCHEMA",
    "CatalogConfig",
    "DataFile",
    "DatasetNotFound",
    "SnapshotInfo",
    "TokenCatalog",
    "check_name",
    "validate_shard_rows",
]
