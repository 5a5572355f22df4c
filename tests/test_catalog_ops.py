"""Catalog operations: tags and time travel, lineage, stats, gc after a killed job, verify,
concurrent writers on PostgreSQL, and independent readers (pyiceberg, DuckDB)."""

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pyarrow import fs

from tokenloom.catalog import SHARD_SCHEMA, CatalogConfig, DatasetNotFound, TokenCatalog
from tokenloom.catalog.maintenance import gc, sha256_bytes, verify, write_json
from tokenloom.catalog.query import query
from tokenloom.catalog.schema import modality_mix
from tokenloom.catalog.stats import merge_stats, shard_stats


def rows(n: int, job: str, start: int = 0) -> pa.Table:
    out = []
    for i in range(start, start + n):
        text = 2 + i % 7
        toks = [1] + [16 + (i + j) % 40 for j in range(text)] + [2]
        segs = [{"modality": "text", "start": 0, "length": len(toks), "grid": [], "attention": "causal"}]
        if i % 3 == 0:  # every third sample also carries a 2x2 "image"
            segs.append({"modality": "image", "start": len(toks), "length": 4, "grid": [2, 2],
                         "attention": "bidirectional"})
            toks += [60, 61, 62, 63]
        out.append({"sample_id": f"{job}-{i}", "source": f"src{i % 4}.txt", "tokens": toks, "segments": segs,
                    "num_tokens": len(toks), "modalities": modality_mix(segs), "vocab_id": "vocab-t", "bundle_ids": ["text-t"], "job_id": job})
    return pa.Table.from_pylist(out, schema=SHARD_SCHEMA)


def commit(catalog: TokenCatalog, name: str, job: str, table: pa.Table, delete_sources=()):
    """What the ingestion sink and driver do: write files with checksums, then commit once."""
    loc = catalog.data_location(name, job)
    filesystem, base = fs.FileSystem.from_uri(loc)
    filesystem.create_dir(base, recursive=True)
    files, sums = [], {}
    pieces = [table.filter(pc.equal(table["modalities"], mix)) for mix in sorted(set(table["modalities"].to_pylist()))]
    for p, piece in enumerate(pieces):  # one file per modality mix, as the sink writes them
        buf = pa.BufferOutputStream()
        pq.write_table(piece, buf)
        data = buf.getvalue()
        with filesystem.open_output_stream(f"{base}/part-{p}.parquet") as f:
            f.write(data)
        files.append(f"{loc}/part-{p}.parquet")
        sums[files[-1]] = sha256_bytes(data)
    write_json(f"{loc}/_checksums.json", sums)
    return catalog.commit_job(name, job, files, {"samples": str(table.num_rows), "quarantined": "1",
                                                 "checksums_file": f"{loc}/_checksums.json",
                                                 "sources_hash": "abc", "vocab_id": "vocab-t",
                                                 "bundle_ids": ["text-t"], "code_version": "test"},
                              stats=shard_stats(table), delete_sources=delete_sources)


@pytest.fixture
def catalog(tmp_path):
    return TokenCatalog(CatalogConfig(), tmp_path)


def test_tags_and_time_travel(catalog):
    s1 = commit(catalog, "ds", "job-1", rows(6, "job-1"))
    assert catalog.tag("ds", "v1") == s1.snapshot_id
    s2 = commit(catalog, "ds", "job-2", rows(4, "job-2", 6))
    assert catalog.scan("ds", at="v1").num_rows == 6
    assert catalog.scan("ds", at=str(s1.snapshot_id)).num_rows == 6
    assert catalog.scan("ds").num_rows == 10 and catalog.snapshot("ds").snapshot_id == s2.snapshot_id
    assert catalog.summary("ds", at="v1")["tags"] == ["v1"]
    with pytest.raises(DatasetNotFound, match="no tag 'v9'"):
        catalog.scan("ds", at="v9")
    with pytest.raises(ValueError, match="already exists"):
        catalog.tag("ds", "v1")
    with pytest.raises(ValueError, match="invalid tag name"):
        catalog.tag("ds", "../v2")
    with pytest.raises(ValueError, match="read as a snapshot id"):
        catalog.tag("ds", "2024")


def test_lineage_recorded(catalog):
    commit(catalog, "ds", "job-1", rows(3, "job-1"))
    s = catalog.summary("ds")
    assert (s["job_id"], s["sources_hash"], s["vocab_id"], s["bundle_ids"], s["code_version"]) == (
        "job-1", "abc", "vocab-t", ["text-t"], "test")


def test_stats_equal_a_full_recount(catalog):
    t1, t2 = rows(9, "job-1"), rows(13, "job-2", 9)
    commit(catalog, "ds", "job-1", t1)
    commit(catalog, "ds", "job-2", t2)
    stored = catalog.summary("ds")["stats"]
    recount = shard_stats(catalog.scan("ds").cast(SHARD_SCHEMA))
    assert stored == recount
    assert stored["modalities"]["image"] == {"samples": 8, "tokens": 32}  # i % 3 == 0 for i < 22
    assert stored == merge_stats(shard_stats(t1), shard_stats(t2))
    assert catalog.summary("ds")["total_quarantined"] == 2
    assert catalog.summary("ds", at=catalog.history("ds")[0].snapshot_id)["stats"] == shard_stats(t1)


def test_replacing_sources_is_one_snapshot_with_exact_rows_stats_and_checksums(catalog):
    """A job that re-reads src1 and drops src2: their old rows leave in the same snapshot that
    adds the new ones; the totals equal a recount; every file (rewritten ones too) verifies."""
    first = rows(24, "job-1")  # sources src0..src3, spread over one file per modality mix
    commit(catalog, "ds", "job-1", first)
    replacement = rows(5, "job-2", start=100).set_column(1, "source", pa.array(["src1.txt"] * 5))
    snap = commit(catalog, "ds", "job-2", replacement, delete_sources=["src1.txt", "src2.txt"])
    assert len(catalog.history("ds")) == 2 and snap.operation == "overwrite"
    now = catalog.scan("ds")
    expected = sorted(r for r, src in zip(first["sample_id"].to_pylist(), first["source"].to_pylist(), strict=True)
                      if src in ("src0.txt", "src3.txt")) + [f"job-2-{i}" for i in range(100, 105)]
    assert sorted(now["sample_id"].to_pylist()) == sorted(expected)
    assert sorted(set(now["source"].to_pylist())) == ["src0.txt", "src1.txt", "src3.txt"]
    summary = catalog.summary("ds")
    assert summary["samples"] == len(expected)
    assert json.loads(json.dumps(summary["stats"])) == shard_stats(now.cast(SHARD_SCHEMA))
    assert verify(catalog, "ds").ok
    # time travel still sees the first job's rows, and gc keeps the files it needs
    assert catalog.scan("ds", at=catalog.history("ds")[0].snapshot_id).num_rows == 24
    gc(catalog, "ds", older_than_s=0)
    assert catalog.scan("ds").num_rows == len(expected) and verify(catalog, "ds").ok


def test_additions_are_the_new_rows_of_each_snapshot_not_the_rewritten_ones(catalog):
    """What follow mode reads of each later snapshot (`TokenCatalog.additions`): an append's files,
    and of a snapshot that replaced a source only its job's own rows, with the sample ids it
    deleted; the files it rewrote hold rows streamed already (a trainer that read them would see
    those rows twice)."""
    def sample_ids(files) -> list[str]:
        return sorted(x for f in files for x in pq.read_table(f.path.removeprefix("file://"),
                                                              columns=["sample_id"])["sample_id"].to_pylist())

    first = rows(24, "job-1")
    base = commit(catalog, "ds", "job-1", first).snapshot_id
    commit(catalog, "ds", "job-2", rows(6, "job-2", start=50))
    replacement = rows(5, "job-3", start=100).set_column(1, "source", pa.array(["src1.txt"] * 5))
    third = commit(catalog, "ds", "job-3", replacement, delete_sources=["src1.txt"])
    added = catalog.additions("ds", base)
    assert [a.snapshot.snapshot_id for a in added] == [s.snapshot_id for s in catalog.history("ds")[1:]]
    assert sample_ids(added[0].files) == sorted(f"job-2-{i}" for i in range(50, 56)) and added[0].deleted == []
    assert sample_ids(added[1].files) == sorted(f"job-3-{i}" for i in range(100, 105)), "rewritten rows are not new"
    assert len(catalog.data_files("ds", third.snapshot_id)) > len(added[1].files) + 1, "the job did rewrite files"
    second = catalog.scan("ds", at=added[0].snapshot.snapshot_id)
    old_src1 = sorted(i for i, src in zip(second["sample_id"].to_pylist(), second["source"].to_pylist(), strict=True)
                      if src == "src1.txt")  # job-1's six and job-2's one
    assert added[1].deleted == old_src1 and len(old_src1) == 7
    # every row of the current snapshot is in the base or in exactly one addition; the rest were deleted
    seen = sample_ids(catalog.data_files("ds", base)) + [x for a in added for x in sample_ids(a.files)]
    assert len(seen) == len(set(seen))
    assert sorted(catalog.scan("ds")["sample_id"].to_pylist()) == sorted(set(seen) - set(old_src1))
    assert catalog.additions("ds", third.snapshot_id) == []
    with pytest.raises(ValueError, match="not an ancestor"):
        catalog.additions("ds", 12345)


def test_deleting_a_source_absent_from_the_table_changes_nothing(catalog):
    commit(catalog, "ds", "job-1", rows(8, "job-1"))
    commit(catalog, "ds", "job-2", rows(2, "job-2", start=50), delete_sources=["nowhere.txt"])
    assert catalog.scan("ds").num_rows == 10
    assert catalog.summary("ds")["stats"]["samples"] == 10


def test_killed_job_leaves_table_unchanged_and_gc_cleans(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    commit(catalog, "ds", "job-1", rows(5, "job-1"))
    before = catalog.snapshot("ds").snapshot_id
    script = textwrap.dedent(f"""
        import os, signal, pyarrow.parquet as pq
        from pathlib import Path
        from tokenloom.catalog import CatalogConfig, TokenCatalog
        from tokenloom.catalog.schema import SHARD_SCHEMA
        catalog = TokenCatalog(CatalogConfig(), Path({str(tmp_path)!r}))
        loc = catalog.data_location("ds", "job-killed").removeprefix("file://")
        Path(loc).mkdir(parents=True)
        pq.write_table(SHARD_SCHEMA.empty_table(), loc + "/part-0.parquet")
        os.kill(os.getpid(), signal.SIGKILL)  # dies between writing its files and committing
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert r.returncode == -9
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    assert catalog.snapshot("ds").snapshot_id == before and catalog.scan("ds").num_rows == 5
    orphan = catalog.data_location("ds", "job-killed").removeprefix("file://") + "/part-0.parquet"
    assert os.path.exists(orphan)
    assert gc(catalog, "ds", older_than_s=3600).deleted == []  # too young: it could be a live job
    report = gc(catalog, "ds", older_than_s=0)
    assert report.deleted == ["file://" + orphan] and not os.path.exists(orphan)
    assert verify(catalog, "ds").ok and catalog.scan("ds").num_rows == 5  # committed files untouched


def test_verify_catches_corruption_and_missing_files(catalog):
    commit(catalog, "ds", "job-1", rows(8, "job-1"))
    assert verify(catalog, "ds").ok
    first, second = (f.path.removeprefix("file://") for f in catalog.data_files("ds"))
    data = bytearray(Path(first).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(first).write_bytes(bytes(data))
    os.remove(second)
    report = verify(catalog, "ds")
    problems = {p["path"].removeprefix("file://"): p["problem"] for p in report.problems}
    assert "checksum mismatch" in problems[first] and "missing" in problems[second]


def test_independent_readers_agree(catalog):
    commit(catalog, "ds", "job-1", rows(7, "job-1"))
    commit(catalog, "ds", "job-2", rows(5, "job-2", 7))
    ours = catalog.scan("ds").sort_by("sample_id").select(["sample_id", "num_tokens", "tokens"]).to_pylist()
    direct = catalog.table("ds").scan().to_arrow().sort_by("sample_id")
    assert direct.select(["sample_id", "num_tokens", "tokens"]).to_pylist() == ours
    via_duckdb = query(catalog, 'SELECT sample_id, num_tokens, tokens FROM ds ORDER BY sample_id').to_pylist()
    assert via_duckdb == ours
    first = catalog.history("ds")[0].snapshot_id
    assert query(catalog, "SELECT count(*) AS n FROM ds", at={"ds": str(first)}).to_pylist() == [{"n": 7}]


def test_query_is_read_only(catalog):
    commit(catalog, "ds", "job-1", rows(3, "job-1"))
    for sql in ["COPY (SELECT 1) TO '/tmp/x.csv'", "CREATE TABLE t AS SELECT 1", "SELECT 1; SELECT 2",
                "ATTACH 'x.db'", "SET threads = 1"]:
        with pytest.raises(ValueError):
            query(catalog, sql)
    with pytest.raises(ValueError, match="query failed"):
        query(catalog, "SELECT * FROM read_csv('/etc/passwd')")


def _postgres_uri() -> str | None:
    try:
        import psycopg2

        psycopg2.connect(host="127.0.0.1", port=5432, dbname="test", user="postgres", connect_timeout=3).close()
        return "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
    except Exception:
        return None


def test_four_concurrent_writers_on_postgresql(tmp_path):
    uri = _postgres_uri()
    if uri is None:
        pytest.skip("PostgreSQL is not reachable at 127.0.0.1:5432 (database 'test')")
    namespace = f"t{uuid.uuid4().hex[:10]}"
    cfg = CatalogConfig(uri=uri, warehouse=str(tmp_path / "wh"), namespace=namespace)
    TokenCatalog(cfg, tmp_path).ensure_dataset("ds")
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_catalog_ops import commit, rows
        from tokenloom.catalog import CatalogConfig, TokenCatalog
        w = int(sys.argv[1])
        cat = TokenCatalog(CatalogConfig(uri={uri!r}, warehouse={str(tmp_path / "wh")!r},
                                         namespace={namespace!r}), Path({str(tmp_path)!r}))
        start = float(sys.argv[2])
        time.sleep(max(0.0, start - time.time()))
        for j in range(3):
            commit(cat, "ds", f"job-w{{w}}-{{j}}", rows(5, f"w{{w}}j{{j}}", 100 * w + 10 * j))
    """)
    start = time.time() + 8
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w), str(start)], stderr=subprocess.PIPE)
             for w in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    cat = TokenCatalog(cfg, tmp_path)
    ids = cat.scan("ds", columns=("sample_id",)).column("sample_id").to_pylist()
    assert len(ids) == 60 and len(set(ids)) == 60  # 4 writers x 3 jobs x 5 rows, none lost or doubled
    assert len(cat.history("ds")) == 12
    assert cat.summary("ds")["stats"]["samples"] == 60
    assert json.loads(json.dumps(cat.summary("ds")["stats"])) == shard_stats(cat.scan("ds").cast(SHARD_SCHEMA))


def test_scan_pushes_filters_and_projections(catalog):
    table = rows(20, "job-1")
    commit(catalog, "ds", "job-1", table)
    got = catalog.scan("ds", where="num_tokens > 8 and source = 'src1.txt'", columns=("sample_id", "num_tokens"))
    assert got.column_names == ["sample_id", "num_tokens"]
    want = [r["sample_id"] for r in table.to_pylist() if r["num_tokens"] > 8 and r["source"] == "src1.txt"]
    assert sorted(got.column("sample_id").to_pylist()) == sorted(want) and want


def test_table_is_partitioned_by_modality_mix_and_planning_prunes(catalog):
    commit(catalog, "ds", "job-1", rows(12, "job-1"))
    spec = catalog.table("ds").spec()
    assert [f.name for f in spec.fields] == ["modalities"]
    files = catalog.table("ds").scan(row_filter="modalities = 'text'").plan_files()
    assert len(files) == 1 and files[0].file.record_count == 8  # the image+text file is pruned
    assert catalog.scan("ds", where="modalities = 'image+text'").num_rows == 4


def test_validation_rejects_a_wrong_modality_mix():
    from tokenloom.catalog import validate_shard_rows

    table = rows(3, "j").to_pylist()
    table[1]["modalities"] = "text"  # row 1 has no image; row 0 has one
    table[0]["modalities"] = "text"
    reasons = validate_shard_rows(pa.Table.from_pylist(table, schema=SHARD_SCHEMA), 100)
    assert "does not match the segments" in reasons[0] and reasons[1] is None
