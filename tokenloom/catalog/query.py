"""Read-only SQL over the catalog with DuckDB.

Each dataset is a view over exactly the Parquet files of its chosen snapshot (the file list
comes from Iceberg's scan planning), so DuckDB's own Parquet reader pushes projections and
filters down to row groups, and time travel is a matter of which files the view names.
Beside it, a DuckDB schema of the dataset's name holds its other tables at the same snapshot:
`samples` (the same rows as the plain view), `quarantine`, `filtered` and `duplicates` (the
union of the Parquet side files the jobs of the snapshot's ancestry recorded) and `sources`
(the source index, an Arrow table registered with the connection, with each source's sample
count). A table with no file yet is an empty registered Arrow table of its schema, so it is
queryable with the right columns and the allowed paths stay exactly the files the views name.
Only single SELECT statements run; anything that could write (COPY, ATTACH, CREATE, SET,
INSTALL, ...) is refused before it reaches the engine, and once the views exist, external
access is off, and the settings are locked.
"""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa

from tokenloom.catalog.schema import SHARD_SCHEMA, SIDE_TABLES
from tokenloom.catalog.sources import source_index
from tokenloom.catalog.store import DatasetNotFound, TokenCatalog

SOURCES_SCHEMA = pa.schema([
    pa.field("path", pa.string()),
    pa.field("size", pa.int64()),
    pa.field("mtime_ns", pa.int64()),
    pa.field("sha256", pa.string()),
    pa.field("job_id", pa.string()),
    pa.field("snapshot_id", pa.int64()),
])
# DuckDB's own schemas: a dataset of such a name keeps its plain view, but gets no schema of tables
_RESERVED_SCHEMAS = {"main", "temp", "system", "pg_catalog", "information_schema", "memory"}


def _check_read_only(sql: str) -> None:
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise ValueError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        raise ValueError(f"run one statement at a time (got {len(statements)})")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise ValueError(f"catalog query runs read-only SELECT statements; refused a {kind.name} statement")


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def resolve_at(catalog: TokenCatalog, specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--at` values -> {dataset: snapshot id or tag}. `NAME=SNAPSHOT|TAG` names its dataset;
    a bare `SNAPSHOT|TAG` applies to the one dataset that has that snapshot or tag."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, at = spec.partition("=")
        if sep:
            if not name or not at:
                raise ValueError(f"--at takes SNAPSHOT, TAG or NAME=SNAPSHOT|TAG, got {spec!r}")
            catalog.snapshot(name, at)  # an unknown dataset, snapshot or tag is named here
        else:
            at = spec
            owners = [n for n in catalog.list_datasets() if _has(catalog, n, at)]
            if len(owners) != 1:
                where = f"is on several datasets ({', '.join(owners)}); say which with --at NAME={at}" if owners \
                    else "is on no dataset; see `tokenloom catalog history NAME`"
                raise ValueError(f"--at {at}: that snapshot id or tag {where}")
            name = owners[0]
        if name in out and out[name] != at:
            raise ValueError(f"--at gives dataset {name!r} two snapshots ({out[name]} and {at}); give one")
        out[name] = at
    return out


def _has(catalog: TokenCatalog, name: str, at: str) -> bool:
    if at.isdigit():
        return any(s.snapshot_id == int(at) for s in catalog.history(name))
    return at in catalog.tags(name)


def dataset_tables(catalog: TokenCatalog, name: str, at: str | None = None) -> dict[str, list[str] | pa.Table]:
    """The tables of a dataset at snapshot `at` (default: current): `samples` and the side tables
    as lists of Parquet paths (empty ones as an empty Arrow table of their schema), `sources`
    as an Arrow table."""
    snap = catalog.snapshot(name, at)
    if snap is None:
        return {"samples": SHARD_SCHEMA.empty_table(), "sources": SOURCES_SCHEMA.empty_table()} | {
            table: schema.empty_table() for table, (_, schema) in SIDE_TABLES.items()}
    out: dict[str, list[str] | pa.Table] = {}
    files = [f.path.removeprefix("file://") for f in catalog.data_files(name, snap.snapshot_id)]
    out["samples"] = files or SHARD_SCHEMA.empty_table()
    chain = catalog.ancestry(name, snap)
    for table, (key, schema) in SIDE_TABLES.items():
        # jobs older than a side table have no key: they add nothing
        side = [p.removeprefix("file://") for s in chain for p in json.loads(s.tokenloom.get(key) or "[]")]
        out[table] = list(dict.fromkeys(side)) or schema.empty_table()
    entries = sorted(source_index(catalog, name, snap.snapshot_id).values(), key=lambda e: e["path"])
    out["sources"] = pa.Table.from_pylist([{f.name: e.get(f.name) for f in SOURCES_SCHEMA} for e in entries],
                                          schema=SOURCES_SCHEMA)
    return out


def query(catalog: TokenCatalog, sql: str, at: dict[str, str] | None = None) -> pa.Table:
    """Run `sql` with every dataset visible (its current snapshot, or `at[name]`): `FROM name`
    and `FROM name.samples` are its samples; `name.quarantine`, `name.filtered`,
    `name.duplicates` and `name.sources` its other tables at the same snapshot."""
    _check_read_only(sql)
    at = at or {}
    names = catalog.list_datasets()
    unknown = sorted(set(at) - set(names))
    if unknown:
        raise DatasetNotFound(f"no dataset named {unknown[0]!r} in the catalog (known: {', '.join(names) or 'none yet'})")
    con = duckdb.connect(":memory:")
    allowed: list[str] = []
    try:
        for k, name in enumerate(names):
            tables = dataset_tables(catalog, name, at.get(name))
            relations = {}
            for table, source in tables.items():
                if isinstance(source, pa.Table):  # registered Arrow: read without any file access
                    registered = f"__{k}_{table}"
                    con.register(registered, source)
                    relations[table] = f"SELECT * FROM {_quote(registered)}"
                else:
                    allowed += source
                    file_list = "[" + ", ".join(_literal(p) for p in source) + "]"
                    relations[table] = f"SELECT * FROM read_parquet({file_list}, union_by_name = true)"
            try:  # DuckDB binds a view when it is created: a missing or damaged file shows here
                _create_views(con, name, relations)
            except duckdb.Error as exc:
                raise ValueError(f"cannot open dataset {name!r} ({str(exc).splitlines()[0]}); check it with "
                                 f"`tokenloom catalog verify {name}`") from None
        # from here on the statement reaches only the snapshot files, and no setting can change
        con.execute("SET allowed_paths = ?", [allowed])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            raise ValueError(f"query failed: {exc}") from None
    finally:
        con.close()


def _create_views(con, name: str, relations: dict[str, str]) -> None:
    """`name` (its samples) and, in a schema of that name, every table of the dataset."""
    con.execute(f"CREATE VIEW {_quote(name)} AS {relations['samples']}")
    if name.lower() in _RESERVED_SCHEMAS:
        return
    schema = _quote(name)
    con.execute(f"CREATE SCHEMA {schema}")
    con.execute(f"CREATE VIEW {schema}.samples AS {relations['samples']}")
    for table in SIDE_TABLES:
        con.execute(f"CREATE VIEW {schema}.{table} AS {relations[table]}")
    con.execute(f"CREATE VIEW {schema}.sources AS SELECT s.*, coalesce(c.n, 0) AS samples "
                f"FROM ({relations['sources']}) s LEFT JOIN "
                f"(SELECT source, count(*) AS n FROM {schema}.samples GROUP BY source) c ON c.source = s.path")
