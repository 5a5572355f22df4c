"""Row-level deletes by source, copy-on-write, for a job that replaces or removes input files.

A dataset's rows are keyed by the input file they came from (`source`). When a file changes,
its old samples must go in the same snapshot that adds its new ones, or a reader could see
both or neither; when `ingest --sync` finds a file gone, its samples go. Iceberg's copy-on-write
delete does exactly that: every committed data file holding a row of those sources is rewritten
without them, and one overwrite snapshot drops the old files and adds the rewritten ones with
the job's own. The rewrite is ours (not pyiceberg's `delete`) for three reasons: the commit
stays one snapshot with the job's files, the rewritten files get checksums (`catalog verify`
needs them), and the deleted rows' statistics are known exactly (the summary subtracts them).

Which files to read is planned by Iceberg (`source` column bounds prune files that cannot hold
the paths); each candidate is then read and filtered, and a file with no matching row is kept.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.expressions import In

from tokenloom.catalog.schema import SHARD_SCHEMA
from tokenloom.catalog.stats import empty_stats, shard_stats
from tokenloom.catalog.uris import filesystem_and_path, to_uri


@dataclass
class Rewrite:
    """What deleting some sources' rows does to a snapshot's files."""

    dropped: list = field(default_factory=list)  # pyiceberg DataFile objects leaving the table
    added: list[str] = field(default_factory=list)  # URIs of the rewritten files (without the rows)
    checksums: dict[str, str] = field(default_factory=dict)  # rewritten file URI -> sha256
    checksums_file: str | None = None  # where `checksums` were written (for `catalog verify`)
    removed_stats: dict = field(default_factory=empty_stats)  # statistics of the deleted rows
    removed_samples: list[str] = field(default_factory=list)  # their sample ids

    @property
    def empty(self) -> bool:
        return not self.dropped


def rewrite_without_sources(table, snapshot_id: int | None, sources: Iterable[str], location: str) -> Rewrite:
    """Plan and write the copy-on-write delete of every row whose `source` is in `sources`, from
    the files of `snapshot_id`; rewritten files go under `location` (the job's data folder).
    Nothing is committed here: the caller swaps `dropped` for `added` in its own snapshot."""
    wanted = sorted(set(sources))
    out = Rewrite()
    if not wanted or snapshot_id is None:
        return out
    tasks = table.scan(snapshot_id=snapshot_id, row_filter=In("source", wanted)).plan_files()
    target = pa.array(wanted, pa.string())
    removed_parts = []
    filesystem_out, base = filesystem_and_path(location)
    for task in sorted(tasks, key=lambda t: t.file.file_path):
        filesystem, path = filesystem_and_path(task.file.file_path)
        with filesystem.open_input_file(path) as f:
            rows = pq.read_table(f)
        hit = pc.is_in(rows.column("source"), value_set=target)
        if not pc.any(hit).as_py():
            continue  # the bounds could not rule the file out, but it holds none of the rows
        removed_parts.append(rows.filter(hit))
        out.dropped.append(task.file)
        kept = rows.filter(pc.invert(hit))
        if kept.num_rows == 0:
            continue  # the file held only those sources: it leaves without a replacement
        buffer = pa.BufferOutputStream()
        pq.write_table(kept, buffer, compression="zstd")
        data = buffer.getvalue()
        new_path = f"{base}/rewrite-{uuid.uuid4().hex[:12]}.parquet"
        filesystem_out.create_dir(base, recursive=True)
        with filesystem_out.open_output_stream(new_path) as f:
            f.write(data)
        uri = to_uri(location, new_path)
        out.added.append(uri)
        out.checksums[uri] = hashlib.sha256(data).hexdigest()
    if out.checksums:
        out.checksums_file = f"{location}/_rewrite_checksums-{uuid.uuid4().hex[:12]}.json"
        fs_json, json_path = filesystem_and_path(out.checksums_file)
        with fs_json.open_output_stream(json_path) as f:
            f.write(json.dumps(out.checksums, indent=1, sort_keys=True).encode())
    if removed_parts:
        removed = pa.concat_tables(removed_parts, promote_options="permissive")
        out.removed_samples = sorted(removed.column("sample_id").to_pylist())
        columns = [c for c in SHARD_SCHEMA.names if c in removed.column_names]
        out.removed_stats = shard_stats(removed.select(columns))
    return out
