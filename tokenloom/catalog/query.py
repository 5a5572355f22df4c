"""Read-only SQL over the catalog with DuckDB.

Each dataset is a view over exactly the Parquet files of its chosen snapshot (the file list
comes from Iceberg's scan planning), so DuckDB's own Parquet reader pushes projections and
filters down to row groups, and time travel is a matter of which files the view names.
Only single SELECT statements run; anything that could write (COPY, ATTACH, CREATE, SET,
INSTALL, ...) is refused before it reaches the engine.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from tokenloom.catalog.store import TokenCatalog


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


def query(catalog: TokenCatalog, sql: str, at: dict[str, str] | None = None) -> pa.Table:
    """Run `sql` with every dataset visible as a table (its current snapshot, or `at[name]`)."""
    _check_read_only(sql)
    at = at or {}
    con = duckdb.connect(":memory:")
    allowed: list[str] = []
    try:
        for name in catalog.list_datasets():
            files = [f.path.removeprefix("file://") for f in catalog.data_files(name, at.get(name))]
            if not files:
                continue
            allowed += files
            file_list = "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in files) + "]"
            con.execute(f"CREATE VIEW {_quote(name)} AS SELECT * FROM read_parquet({file_list})")
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
