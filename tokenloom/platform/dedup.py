"""The driver's dedup pass: between the write tasks and the commit, drop duplicates exactly once.

Write tasks run in whatever order Ray schedules them, so none of them can decide which of two
copies to keep. Each returns the dedup keys of the rows it wrote (`TaskOutput.keys`); once all
have returned, this pass gathers the dataset's own keys (the `content_hash` column of its
current snapshot and the `signatures_file` of each job in its ancestry), lets the pure
`datasets.dedup.find_duplicates` decide (existing samples are kept, earliest job first; new
samples in (source, record) order), and rewrites only the job's not-yet-committed data files
that hold dropped rows, with their checksums and the job's statistics recomputed. Dropped
rows go to `duplicates/` with the sample they duplicate; the kept rows' signatures to
`_signatures.parquet`, for the next job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenloom.catalog.maintenance import sha256_bytes
from tokenloom.catalog.schema import DUPLICATES_SCHEMA, SIGNATURES_SCHEMA
from tokenloom.catalog.stats import merge_stats, shard_stats
from tokenloom.catalog.store import TokenCatalog
from tokenloom.catalog.uris import filesystem_and_path
from tokenloom.datasets.dedup import Drop, Keys, counts_by_kind, find_duplicates
from tokenloom.platform.config import DedupConfig
from tokenloom.platform.sink import TaskOutput


@dataclass
class DedupOutcome:
    duplicates: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # kind -> dropped samples
    files: list[str] = field(default_factory=list)  # duplicates side files
    signatures_file: str | None = None

    def properties(self) -> dict[str, object]:
        """The snapshot-summary properties of the pass."""
        props: dict[str, object] = {"duplicates": str(self.duplicates), "duplicate_counts": self.counts,
                                    "duplicates_files": self.files}
        if self.signatures_file:
            props["signatures_file"] = self.signatures_file
        return props


def existing_keys(catalog: TokenCatalog, dataset: str, leaving_sources: Iterable[str] = ()) -> list[Keys]:
    """The dedup keys of the dataset's current samples, earliest job first. Samples of
    `leaving_sources` (deleted by the same commit: a changed file's old rows) are left out, so
    their new versions are never dropped as copies of rows that are about to go."""
    if not catalog.exists(dataset):
        return []
    snap = catalog.snapshot(dataset)
    if snap is None:
        return []
    chain = catalog.ancestry(dataset, snap)
    job_rank = {s.tokenloom.get("job_id"): i for i, s in enumerate(chain)}
    index = catalog.scan(dataset, columns=("sample_id", "source", "content_hash", "job_id"))
    leaving = set(leaving_sources)
    present: dict[str, tuple[int, str | None]] = {}
    for sid, source, digest, job in zip(*(index.column(c).to_pylist() for c in ("sample_id", "source",
                                                                                 "content_hash", "job_id")),
                                        strict=True):
        if source not in leaving:
            present[sid] = (job_rank.get(job, len(chain)), digest)
    signatures: dict[str, tuple[np.ndarray | None, int | None]] = {}
    for s in chain:  # a later job's signature of the same id (a replaced sample) wins
        uri = s.tokenloom.get("signatures_file")
        if not uri:
            continue
        filesystem, path = filesystem_and_path(uri)
        table = pq.read_table(path, filesystem=filesystem, schema=SIGNATURES_SCHEMA)
        for sid, minhash, phash in zip(table.column("sample_id").to_pylist(), table.column("minhash").to_pylist(),
                                       table.column("phash").to_pylist(), strict=True):
            if sid in present:
                signatures[sid] = (np.asarray(minhash, dtype=np.uint32) if minhash is not None else None, phash)
    out = []
    for sid, (_rank, digest) in sorted(present.items(), key=lambda kv: (kv[1][0], kv[0])):
        minhash, phash = signatures.get(sid, (None, None))
        out.append(Keys(sid, content_hash=digest, minhash=minhash, phash=phash, existing=True))
    return out


def _new_keys(keys: pa.Table, config: DedupConfig) -> list[Keys]:
    on = {m: getattr(config, m) for m in ("text", "image", "audio")}
    rows = zip(*(keys.column(c).to_pylist() for c in ("sample_id", "source", "record", "modality", "content_hash",
                                                      "minhash", "phash")), strict=True)
    out = []
    for sid, source, record, modality, digest, minhash, phash in rows:
        if not on.get(modality or "text", True):  # this modality is not deduplicated
            digest = minhash = phash = None
        out.append(Keys(sid, source, record, digest, np.asarray(minhash, dtype=np.uint32) if minhash else None,
                        phash))
    return out


def deduplicate(out: TaskOutput, existing: list[Keys], config: DedupConfig, location: str,
                job_id: str) -> DedupOutcome:
    """Drop the job's duplicates from its written files (`out` is updated in place); write the
    duplicates and signatures side files under `location`."""
    outcome = DedupOutcome()
    keys = out.keys
    if config.enabled and keys.num_rows:
        drops = find_duplicates(
            _new_keys(keys, config), existing, exact=config.exact, num_perm=config.num_perm,
            minhash_threshold=config.minhash_threshold if config.near_text and config.text else None,
            phash_threshold=config.phash_threshold if config.near_image and config.image else None,
        )
        if drops:
            _rewrite(out, keys, {d.sample_id for d in drops})
            outcome.files = [_write_duplicates(drops, keys, location, job_id)]
            outcome.duplicates, outcome.counts = len(drops), counts_by_kind(drops)
            keys = keys.filter(pc.invert(pc.is_in(keys.column("sample_id"),
                                                  pa.array([d.sample_id for d in drops], pa.string()))))
    outcome.signatures_file = _write_signatures(keys, location)
    return outcome


def _rewrite(out: TaskOutput, keys: pa.Table, dropped: set[str]) -> None:
    """Rewrite the data files that hold dropped rows; recompute checksums, stats and totals."""
    files = sorted({f for sid, f in zip(keys.column("sample_id").to_pylist(), keys.column("data_file").to_pylist(),
                                         strict=True) if sid in dropped})
    drop_ids = pa.array(sorted(dropped), pa.string())
    for uri in files:
        filesystem, path = filesystem_and_path(uri)
        table = pq.read_table(path, filesystem=filesystem)
        kept = table.filter(pc.invert(pc.is_in(table.column("sample_id"), drop_ids)))
        if kept.num_rows == 0:
            filesystem.delete_file(path)
            out.data_files.remove(uri)
            out.checksums.pop(uri, None)
            out.file_stats.pop(uri, None)
            continue
        buffer = pa.BufferOutputStream()
        pq.write_table(kept, buffer, compression="zstd")
        data = buffer.getvalue()
        with filesystem.open_output_stream(path) as f:
            f.write(data)
        out.checksums[uri] = sha256_bytes(data)
        out.file_stats[uri] = shard_stats(kept)
    out.stats = merge_stats(*out.file_stats.values())
    out.samples, out.tokens = out.stats["samples"], out.stats["tokens"]


def _write_duplicates(drops: list[Drop], keys: pa.Table, location: str, job_id: str) -> str:
    where = {sid: (src, rec, mod) for sid, src, rec, mod in zip(
        *(keys.column(c).to_pylist() for c in ("sample_id", "source", "record", "modality")), strict=True)}
    table = pa.table({
        "sample_id": [d.sample_id for d in drops],
        "source": [where[d.sample_id][0] for d in drops],
        "record": [where[d.sample_id][1] for d in drops],
        "modality": [where[d.sample_id][2] for d in drops],
        "duplicate_of": [d.duplicate_of for d in drops],
        "kind": [d.kind for d in drops],
        "similarity": [d.similarity for d in drops],
        "reason": [d.reason for d in drops],
        "job_id": [job_id] * len(drops),
    }, schema=DUPLICATES_SCHEMA)
    return _write(table, f"{location}/duplicates/duplicates.parquet")


def _write_signatures(keys: pa.Table, location: str) -> str | None:
    has = pc.or_(pc.is_valid(keys.column("minhash")), pc.is_valid(keys.column("phash")))
    rows = keys.filter(has)
    if rows.num_rows == 0:
        return None
    table = rows.select(SIGNATURES_SCHEMA.names).cast(SIGNATURES_SCHEMA)
    return _write(table, f"{location}/_signatures.parquet")


def _write(table: pa.Table, uri: str) -> str:
    filesystem, path = filesystem_and_path(uri)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    pq.write_table(table, path, filesystem=filesystem)
    return uri
