"""Catalog at size: 10,000 data files over 100 snapshots.

Measures what a user waits for: `catalog stats` (answered from the snapshot summary) and
planning a scan of the latest snapshot (Iceberg manifests -> file list with row counts),
against the catalog-less peer: a `pyarrow.dataset` listing of the same files (discovery,
and discovery plus row counts from every footer). Prints times and ratios.

    .venv/bin/python bench/bench_catalog.py [--files 10000] [--snapshots 100]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from tqdm import tqdm

from tokenloom.catalog import SHARD_SCHEMA, CatalogConfig, TokenCatalog
from tokenloom.catalog.stats import merge_stats, shard_stats


def _rows(n: int, start: int, job: str) -> pa.Table:
    out = []
    for i in range(start, start + n):
        toks = [1] + [16 + (i + j) % 97 for j in range(8 + i % 24)] + [2]
        out.append({"sample_id": f"s{i}", "source": f"src{i % 50}.txt", "tokens": toks,
                    "segments": [{"modality": "text", "start": 0, "length": len(toks), "grid": [],
                                  "attention": "causal"}],
                    "num_tokens": len(toks), "modalities": "text", "vocab_id": "vocab-b", "bundle_ids": ["text-b"], "job_id": job})
    return pa.Table.from_pylist(out, schema=SHARD_SCHEMA)


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--rows-per-file", type=int, default=8)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tl-bench-catalog-"))
    catalog = TokenCatalog(CatalogConfig(), home)
    per_snapshot = args.files // args.snapshots
    row = 0
    build0 = time.perf_counter()
    for s in tqdm(range(args.snapshots), desc="commits"):
        job = f"job-{s:04d}"
        loc = catalog.data_location("bench", job).removeprefix("file://")
        Path(loc).mkdir(parents=True, exist_ok=True)
        files, stats = [], []
        for f in range(per_snapshot):
            table = _rows(args.rows_per_file, row, job)
            row += args.rows_per_file
            path = f"{loc}/part-{f:04d}.parquet"
            pq.write_table(table, path)
            files.append("file://" + path)
            stats.append(shard_stats(table))
        catalog.commit_job("bench", job, files, {"samples": str(per_snapshot * args.rows_per_file)},
                           stats=merge_stats(*stats))
    build = time.perf_counter() - build0
    data_dir = catalog.table("bench").metadata.location.removeprefix("file://") + "/data"

    fresh = lambda: TokenCatalog(CatalogConfig(), home)  # noqa: E731 - each timing opens the catalog anew
    t_stats = best(lambda: fresh().summary("bench"))
    t_plan = best(lambda: fresh().data_files("bench"))
    t_list = best(lambda: pads.dataset(data_dir, format="parquet").files)
    t_count = best(lambda: pads.dataset(data_dir, format="parquet").count_rows(), repeats=1)
    summary = fresh().summary("bench")
    planned = fresh().data_files("bench")
    assert len(planned) == args.files and summary["stats"]["samples"] == args.files * args.rows_per_file
    print(f"{args.files:,} files over {args.snapshots} snapshots ({row:,} rows); built in {build:.0f} s")
    print(f"catalog stats (summary of latest snapshot):   {t_stats:7.3f} s")
    print(f"scan planning of latest snapshot (file list): {t_plan:7.3f} s")
    print(f"pyarrow.dataset listing (discovery only):     {t_list:7.3f} s   -> stats is {t_list / t_stats:5.1f}x, "
          f"planning {t_list / t_plan:5.2f}x of it")
    print(f"pyarrow.dataset listing + row counts:         {t_count:7.3f} s   -> stats is {t_count / t_stats:5.1f}x, "
          f"planning {t_count / t_plan:5.2f}x faster")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
