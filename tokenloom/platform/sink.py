"""The shard sink: a Ray Data Datasink that writes token shards and quarantine records.

Each write task validates its rows against the shard contract, writes the good ones as one
Parquet file under the job's data folder, the rejected ones as a quarantine file and the
ones a quality filter dropped as a `filtered/` file, and returns what it wrote with the dedup
keys of every row it wrote (the driver decides duplicates from all of them once every task
has returned: platform/dedup.py). Nothing is visible until the driver commits the collected
file list as one Iceberg snapshot; files of a job that died are unreferenced and `catalog gc` food.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.datasource.datasink import WriteResult

from tokenloom.catalog.maintenance import sha256_bytes
from tokenloom.catalog.schema import (
    FILTERED_SCHEMA,
    QUARANTINE_SCHEMA,
    SHARD_SCHEMA,
    modality_mix,
    validate_shard_rows,
)
from tokenloom.catalog.stats import empty_stats, merge_stats, shard_stats
from tokenloom.catalog.uris import filesystem_and_path, to_uri

# What the driver's dedup pass needs of each written sample, and the file that holds it.
KEYS_SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("record", pa.string()),
                         ("modality", pa.string()), ("content_hash", pa.string()),
                         ("minhash", pa.list_(pa.uint32())), ("phash", pa.uint64()), ("data_file", pa.string())])


@dataclass
class TaskOutput:
    data_files: list[str] = field(default_factory=list)
    quarantine_files: list[str] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    quarantined: int = 0
    reasons: Counter = field(default_factory=Counter)
    checksums: dict[str, str] = field(default_factory=dict)  # data file URI -> sha256
    stats: dict = field(default_factory=empty_stats)
    file_stats: dict[str, dict] = field(default_factory=dict)  # data file URI -> its stats (dedup rewrites)
    filtered_files: list[str] = field(default_factory=list)
    filtered: int = 0
    filter_counts: Counter = field(default_factory=Counter)
    keys: pa.Table = field(default_factory=lambda: KEYS_SCHEMA.empty_table())  # one row per written sample
    # per tokenizer pool: records that came out of it and the tokens it produced (before dedup)
    pool_records: Counter = field(default_factory=Counter)
    pool_tokens: Counter = field(default_factory=Counter)
    pool_nodes: Counter = field(default_factory=Counter)  # (pool, Ray node id) -> records
    pool_notes: Counter = field(default_factory=Counter)  # (pool, note class) -> kept samples that carry it
    pools: dict = field(default_factory=dict)  # per-pool figures of the job (platform/pools.pool_figures)



def _reason_class(reason: str) -> str:
    """Group reasons for the summary: 'malformed JSON: ... at column 3' -> 'malformed JSON'."""
    return reason.split(":")[0].split(" at byte")[0].strip()


def _kept(table: pa.Table, mask: pa.Array | pa.ChunkedArray) -> pa.Table:
    """`table.filter(mask)`, without the copy when every row is kept (the common case: a filter
    copies every column, and a block's token lists are most of what a job writes)."""
    if mask.null_count == 0 and pc.all(mask).as_py() is not False:
        return table
    return table.filter(mask)


class ShardSink(Datasink):
    def __init__(self, location: str, job_id: str, vocab_id: str, vocab_size: int, bundle_ids: list[str],
                 rows_per_file: int | None = None):
        self.rows_per_file = rows_per_file
        self.location = location.rstrip("/")
        self.job_id = job_id
        self.vocab_id = vocab_id
        self.vocab_size = vocab_size
        self.bundle_ids = list(bundle_ids)
        self.result: TaskOutput | None = None

    @property
    def min_rows_per_write(self) -> int | None:
        """Ray Data buffers this many rows into each `write` call (one file per modality mix)."""
        return self.rows_per_file

    def on_write_start(self, schema=None) -> None:
        filesystem, path = filesystem_and_path(self.location)
        filesystem.create_dir(path, recursive=True)

    def write(self, blocks: Iterable[pa.Table], ctx) -> TaskOutput:
        out = TaskOutput()
        good_parts, bad_parts, key_parts, filtered_parts = [], [], [], []
        for block in blocks:
            if not isinstance(block, pa.Table):
                block = pa.Table.from_pandas(block, preserve_index=False)
            if block.num_rows == 0:
                continue
            if "pool" in block.column_names:
                lengths = pc.list_value_length(block.column("tokens"))
                for pool in set(block.column("pool").to_pylist()):
                    mine = pc.equal(block.column("pool"), pool)
                    out.pool_records[pool] += int(pc.sum(pc.cast(mine, pa.int64())).as_py())
                    out.pool_tokens[pool] += int(pc.sum(pc.filter(lengths, mine)).as_py() or 0)
                    if "node" in block.column_names:
                        out.pool_nodes.update((pool, node) for node in pc.filter(block.column("node"), mine).to_pylist())
                    if "note" in block.column_names:
                        out.pool_notes.update((pool, _reason_class(note)) for note in
                                              pc.filter(block.column("note"), mine).to_pylist() if note)
                if "sound_node" in block.column_names:  # video rows passed the sound stage, on the audio pool
                    staged = pc.is_valid(block.column("sound_node"))
                    out.pool_records["video_sound"] += int(pc.sum(pc.cast(staged, pa.int64())).as_py())
                    out.pool_tokens["video_sound"] += int(pc.sum(pc.filter(lengths, staged)).as_py() or 0)
                    out.pool_nodes.update(("video_sound", node) for node in
                                          pc.filter(block.column("sound_node"), staged).to_pylist())
            good, bad, good_keys, filtered = self._split(block)
            good_parts.append(good)
            bad_parts.append(bad)
            key_parts.append(good_keys)
            filtered_parts.append(filtered)
        filesystem, base = filesystem_and_path(self.location)
        name = f"task{ctx.task_idx:05d}-{uuid.uuid4().hex[:12]}"
        good = pa.concat_tables(good_parts) if good_parts else SHARD_SCHEMA.empty_table()
        bad = pa.concat_tables(bad_parts) if bad_parts else QUARANTINE_SCHEMA.empty_table()
        good_keys = pa.concat_tables(key_parts) if key_parts else KEYS_SCHEMA.empty_table().drop(["data_file"])
        filtered = pa.concat_tables(filtered_parts) if filtered_parts else FILTERED_SCHEMA.empty_table()
        # one file per modality mix: the table is partitioned by it
        for mix in sorted(set(good.column("modalities").to_pylist())):
            in_mix = pc.equal(good.column("modalities"), mix)
            part = _kept(good, in_mix)
            path = f"{base}/{name}-{mix.replace('+', '_')}.parquet"
            buffer = pa.BufferOutputStream()
            pq.write_table(part, buffer, compression="zstd")
            data = buffer.getvalue()
            with filesystem.open_output_stream(path) as f:
                f.write(data)
            uri = to_uri(self.location, path)
            out.data_files.append(uri)
            out.checksums[uri] = sha256_bytes(data)
            out.file_stats[uri] = shard_stats(part)
            part_keys = _kept(good_keys, in_mix)
            key_parts_out = part_keys.append_column("data_file", pa.array([uri] * part_keys.num_rows, pa.string()))
            out.keys = pa.concat_tables([out.keys, key_parts_out])
        if good.num_rows:
            out.samples = good.num_rows
            out.tokens = int(pc.sum(good.column("num_tokens")).as_py())
            out.stats = shard_stats(good)
        if bad.num_rows:
            out.quarantine_files.append(self._side_file(filesystem, f"{base}/quarantine", name, bad))
            out.quarantined = bad.num_rows
            out.reasons.update(_reason_class(r) for r in bad.column("reason").to_pylist())
        if filtered.num_rows:
            out.filtered_files.append(self._side_file(filesystem, f"{base}/filtered", name, filtered))
            out.filtered = filtered.num_rows
            out.filter_counts.update(filtered.column("filter").to_pylist())
        return out

    def _side_file(self, filesystem, folder: str, name: str, table: pa.Table) -> str:
        """A task's quarantine or filtered records as one Parquet file under `folder`; its URI."""
        filesystem.create_dir(folder, recursive=True)
        path = f"{folder}/{name}.parquet"
        pq.write_table(table, path, filesystem=filesystem)
        return to_uri(self.location, path)

    def _split(self, block: pa.Table) -> tuple[pa.Table, pa.Table, pa.Table, pa.Table]:
        """(shard rows, quarantine rows, the shard rows' dedup keys, filtered rows) of a block."""
        errors = block.column("error")
        ok = pc.is_null(errors)
        marked = "filter" in block.column_names
        kept = pc.and_(ok, pc.is_null(block.column("filter"))) if marked else ok
        filtered = self._filtered(block.filter(pc.and_(ok, pc.invert(kept)))) if marked else FILTERED_SCHEMA.empty_table()
        candidates = _kept(block, kept)
        n = candidates.num_rows
        shards = pa.Table.from_arrays(
            [
                candidates.column("sample_id"),
                candidates.column("source"),
                candidates.column("tokens"),
                candidates.column("segments"),
                pc.list_value_length(candidates.column("tokens")).cast(pa.int32()),
                pa.array([modality_mix(segs) for segs in candidates.column("segments").to_pylist()], pa.string()),
                pa.array([self.vocab_id] * n, pa.string()),
                pa.array([self.bundle_ids] * n, pa.list_(pa.string())),
                pa.array([self.job_id] * n, pa.string()),
                (candidates.column("content_hash") if "content_hash" in candidates.column_names
                 else pa.nulls(n, pa.string())),
            ],
            schema=SHARD_SCHEMA,
        )
        reasons = validate_shard_rows(shards, self.vocab_size)
        valid = pa.array([r is None for r in reasons], type=pa.bool_())  # typed: a block may hold no candidates
        rejected = [(i, r) for i, r in enumerate(reasons) if r is not None]
        upstream = block.filter(pc.invert(ok))
        bad = pa.Table.from_pydict(
            {
                "source": upstream.column("source").to_pylist() + [candidates["source"][i].as_py() for i, _ in rejected],
                "record": upstream.column("record").to_pylist() + [candidates["record"][i].as_py() for i, _ in rejected],
                "reason": upstream.column("error").to_pylist() + [f"validation: {r}" for _, r in rejected],
                "job_id": [self.job_id] * (upstream.num_rows + len(rejected)),
            },
            schema=QUARANTINE_SCHEMA,
        )
        return _kept(shards, valid), bad, _kept(self._keys(candidates), valid), filtered

    def _filtered(self, rows: pa.Table) -> pa.Table:
        return pa.Table.from_arrays(
            [rows.column("sample_id"), rows.column("source"), rows.column("record"), rows.column("modality"),
             rows.column("filter"), rows.column("filter_reason"), pa.array([self.job_id] * rows.num_rows, pa.string())],
            schema=FILTERED_SCHEMA,
        )

    @staticmethod
    def _keys(rows: pa.Table) -> pa.Table:
        n = rows.num_rows
        names = [f.name for f in KEYS_SCHEMA if f.name != "data_file"]
        return pa.Table.from_arrays(
            [rows.column(c) if c in rows.column_names else pa.nulls(n, KEYS_SCHEMA.field(c).type) for c in names],
            schema=pa.schema([KEYS_SCHEMA.field(c) for c in names]),
        )

    def on_write_complete(self, write_result: WriteResult) -> None:
        total = TaskOutput()
        for part in write_result.write_returns:
            total.data_files += part.data_files
            total.quarantine_files += part.quarantine_files
            total.samples += part.samples
            total.tokens += part.tokens
            total.quarantined += part.quarantined
            total.reasons.update(part.reasons)
            total.checksums.update(part.checksums)
            total.stats = merge_stats(total.stats, part.stats)
            total.file_stats.update(part.file_stats)
            total.filtered_files += part.filtered_files
            total.filtered += part.filtered
            total.filter_counts.update(part.filter_counts)
            total.keys = pa.concat_tables([total.keys, part.keys])
            total.pool_records.update(part.pool_records)
            total.pool_tokens.update(part.pool_tokens)
            total.pool_nodes.update(part.pool_nodes)
            total.pool_notes.update(part.pool_notes)
        total.data_files.sort()
        total.quarantine_files.sort()
        total.filtered_files.sort()
        self.result = total
