import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.catalog import SHARD_SCHEMA, CatalogConfig, DatasetNotFound, TokenCatalog, validate_shard_rows
from tokenloom.catalog.stats import shard_stats


def _rows(n: int, job: str, start: int = 0) -> pa.Table:
    rows = []
    for i in range(start, start + n):
        toks = [1] + [16 + (i * 7 + j) % 50 for j in range(i % 5 + 1)] + [2]
        rows.append({"sample_id": f"s{i}", "source": "mem", "tokens": toks,
                     "segments": [{"modality": "text", "start": 0, "length": len(toks), "grid": [], "attention": "causal"}],
                     "num_tokens": len(toks), "modalities": "text", "vocab_id": "vocab-test", "bundle_ids": ["text-test"], "job_id": job})
    return pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)


def _write(catalog: TokenCatalog, name: str, job: str, table: pa.Table) -> list[str]:
    loc = catalog.data_location(name, job)
    from pyarrow import fs

    filesystem, base = fs.FileSystem.from_uri(loc)
    filesystem.create_dir(base, recursive=True)
    pq.write_table(table, f"{base}/part-0.parquet", filesystem=filesystem)
    return [f"{loc}/part-0.parquet"]


def test_validation_rules():
    good = _rows(3, "j")
    assert validate_shard_rows(good, 100) == [None, None, None]
    assert validate_shard_rows(good, 20)[1] == "token id 23 outside the vocabulary [0, 20)"
    bad = good.to_pylist()
    bad[0]["num_tokens"] += 1
    bad[1]["segments"][0]["start"] = 1
    bad[2]["segments"].append({"modality": "text", "start": bad[2]["num_tokens"], "length": 1, "grid": [],
                               "attention": "causal"})
    reasons = validate_shard_rows(pa.Table.from_pylist(bad, schema=SHARD_SCHEMA), 100)
    assert "num_tokens" in reasons[0]
    assert "do not tile" in reasons[1]
    assert "cover" in reasons[2]


def test_commit_then_read_back_equals_written(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    table = _rows(20, "job-a")
    snap = catalog.commit_job("ds", "job-a", _write(catalog, "ds", "job-a", table), {}, stats=shard_stats(table))
    back = catalog.scan("ds").sort_by("sample_id")
    assert back.cast(SHARD_SCHEMA).to_pylist() == table.sort_by("sample_id").to_pylist()
    assert catalog.summary("ds")["snapshot_id"] == snap.snapshot_id
    assert catalog.summary("ds")["samples"] == 20
    assert catalog.summary("ds")["tokens"] == sum(table["num_tokens"].to_pylist())
    assert [f.record_count for f in catalog.data_files("ds")] == [20]


def test_jobs_are_committed_once_and_versions_are_readable(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    a, b = _rows(5, "job-a"), _rows(7, "job-b", 5)
    s1 = catalog.commit_job("ds", "job-a", _write(catalog, "ds", "job-a", a), {}, stats=shard_stats(a))
    again = catalog.commit_job("ds", "job-a", [], {})
    assert again.snapshot_id == s1.snapshot_id and len(catalog.history("ds")) == 1
    s2 = catalog.commit_job("ds", "job-b", _write(catalog, "ds", "job-b", b), {}, stats=shard_stats(b))
    assert [s.snapshot_id for s in catalog.history("ds")] == [s1.snapshot_id, s2.snapshot_id]
    assert catalog.scan("ds", at=s1.snapshot_id).num_rows == 5
    assert catalog.scan("ds").num_rows == 12
    assert catalog.summary("ds")["tokens"] == sum(a["num_tokens"].to_pylist() + b["num_tokens"].to_pylist())
    assert catalog.summary("ds", at=s1.snapshot_id)["tokens"] == sum(a["num_tokens"].to_pylist())


def test_a_dataset_without_snapshots_reports_zeros(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    catalog.ensure_dataset("empty")
    s = catalog.summary("empty")
    assert (s["snapshot_id"], s["samples"], s["stats"]["tokens"], s["total_quarantined"]) == (None, 0, 0, 0)
    assert catalog.scan("empty").num_rows == 0 and catalog.data_files("empty") == []


def test_unknown_names_and_bad_names(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    with pytest.raises(DatasetNotFound, match="no dataset named 'nope'"):
        catalog.summary("nope")
    for bad in ["../escape", "a/b", "x\n", "", ".hidden"]:
        with pytest.raises(ValueError, match="invalid dataset name"):
            catalog.ensure_dataset(bad)
