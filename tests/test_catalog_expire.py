"""`catalog expire` and the `gc` after it: which snapshots go (never the current one, a tagged
one, or the last N), that every figure read along the ancestry (totals, source index, side
tables, vocabulary history, checksums) is the same after expiry as before and equals a full
recount, and that gc then removes exactly the data and metadata files only expired snapshots
needed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from cli_runner import run
from test_catalog_query import entry, plant, shard_rows, side_rows

from tokenloom.catalog import SHARD_SCHEMA, CatalogConfig, DatasetNotFound, TokenCatalog
from tokenloom.catalog.maintenance import expire, gc, referenced_metadata, verify
from tokenloom.catalog.query import query
from tokenloom.catalog.schema import FILTERED_SCHEMA, QUARANTINE_SCHEMA
from tokenloom.catalog.sources import source_index
from tokenloom.catalog.stats import shard_stats

LATER = 10.0  # expire "now + 10 s": every snapshot counts as older than a 0 h grace


@pytest.fixture
def catalog(tmp_path):
    return TokenCatalog(CatalogConfig(), tmp_path)


def five_jobs(catalog) -> list:
    """Five jobs on `ds`; job-2 is tagged v2, job-4 changes the vocabulary (appended ranges)."""
    snaps = []
    for k in range(1, 6):
        job = f"job-{k}"
        vocab = "vocab-u" if k >= 4 else "vocab-t"
        side = {"quarantine": side_rows(QUARANTINE_SCHEMA, job, ["empty"] * k)}
        if k >= 3:  # older jobs had no filtered table
            side["filtered"] = side_rows(FILTERED_SCHEMA, job, ["too short"])
        sources = [entry(f"s{k}.txt", f"h{k}")] + ([entry("s1.txt", "h1-changed")] if k == 3 else [])
        snaps.append(plant(catalog, "ds", job, shard_rows(job, {f"s{k}.txt": k + 1}, seed=k, vocab_id=vocab),
                           side, sources, vocab_id=vocab))
        if k == 2:
            catalog.tag("ds", "v2")
    return snaps


def figures(catalog, at=None) -> dict:
    """Everything read along a snapshot's ancestry."""
    s = catalog.summary("ds", at)
    ats = {"ds": str(at)} if at else None
    return {
        "summary": {k: s[k] for k in ("snapshot_id", "samples", "tokens", "stats", "total_quarantined", "vocab_history",
                                      "tags", "job_id")},
        "sources": source_index(catalog, "ds", at),
        "quarantine": query(catalog, "SELECT job_id, count(*) AS n FROM ds.quarantine GROUP BY 1 ORDER BY 1", ats).to_pylist(),
        "filtered": query(catalog, "SELECT count(*) AS n FROM ds.filtered", ats).to_pylist(),
        "rows": sorted(catalog.scan("ds", at, columns=("sample_id",))["sample_id"].to_pylist()),
    }


def metadata_files(catalog) -> set[str]:
    folder = catalog.table("ds").metadata.location.removeprefix("file://") + "/metadata"
    return {"file://" + str(p) for p in Path(folder).iterdir()}


def test_expire_never_takes_the_current_a_tagged_or_the_last_n(catalog):
    snaps = five_jobs(catalog)
    ids = [s.snapshot_id for s in snaps]
    plan = expire(catalog, "ds", older_than_s=0, retain_last=2, dry_run=True, now_s=time.time() + LATER)
    assert plan.expired == [ids[0], ids[2]] and plan.kept == [ids[1], ids[3], ids[4]]
    assert [s.snapshot_id for s in catalog.history("ds")] == ids  # a dry run changes nothing
    assert expire(catalog, "ds", older_than_s=3600, now_s=time.time()).expired == []  # none is an hour old
    done = expire(catalog, "ds", older_than_s=0, retain_last=2, now_s=time.time() + LATER)
    assert done.expired == [ids[0], ids[2]]
    assert [s.snapshot_id for s in catalog.history("ds")] == [ids[1], ids[3], ids[4]]
    last = expire(catalog, "ds", older_than_s=0, now_s=time.time() + LATER)  # retain_last=1: the current stays
    assert last.expired == [ids[3]] and [s.snapshot_id for s in catalog.history("ds")] == [ids[1], ids[4]]
    assert catalog.tags("ds") == {"v2": ids[1]}
    with pytest.raises(DatasetNotFound, match=f"has no snapshot {ids[0]}"):
        catalog.scan("ds", at=ids[0])
    with pytest.raises(ValueError, match="at least 1"):
        expire(catalog, "ds", older_than_s=0, retain_last=0)
    with pytest.raises(ValueError, match="hours >= 0"):
        expire(catalog, "ds", older_than_s=-3600)


def test_figures_survive_expiry_and_gc_and_equal_a_recount(catalog):
    snaps = five_jobs(catalog)
    before, before_v2 = figures(catalog), figures(catalog, "v2")
    expired_manifest_lists = {s.manifest_list for s in catalog.table("ds").metadata.snapshots
                              if s.snapshot_id in (snaps[0].snapshot_id, snaps[2].snapshot_id)}
    expire(catalog, "ds", older_than_s=0, retain_last=2, now_s=time.time() + LATER)  # takes job-1 and job-3
    report = gc(catalog, "ds", older_than_s=0)
    assert figures(catalog) == before and figures(catalog, "v2") == before_v2
    # the totals are those of the rows: a recount from the data equals the stored figures
    assert before["summary"]["stats"] == shard_stats(catalog.scan("ds").cast(SHARD_SCHEMA))
    assert before_v2["summary"]["stats"] == shard_stats(catalog.scan("ds", "v2").cast(SHARD_SCHEMA))
    assert before["quarantine"] == [{"job_id": f"job-{k}", "n": k} for k in range(1, 6)]
    assert [v["vocab_id"] for v in before["summary"]["vocab_history"]] == ["vocab-t", "vocab-u"]
    assert before["sources"]["s1.txt"]["sha256"] == "h1-changed"  # written by expired job-3
    assert [s.tokenloom["job_id"] for s in catalog.ancestry("ds", catalog.snapshot("ds"))] == [
        f"job-{k}" for k in range(1, 6)]
    assert verify(catalog, "ds").ok and verify(catalog, "ds", "v2").ok
    # metadata: the expired snapshots' manifest lists are gone; what is left is exactly what is referenced
    assert expired_manifest_lists and all(p in report.deleted_metadata for p in expired_manifest_lists)
    assert not any(Path(p.removeprefix("file://")).exists() for p in expired_manifest_lists)
    assert metadata_files(catalog) == referenced_metadata(catalog.table("ds"))
    assert report.deleted == []  # appends only: every data file is still in the current snapshot
    # and a second expiry chains onto the first one's archive
    expire(catalog, "ds", older_than_s=0, now_s=time.time() + LATER)
    gc(catalog, "ds", older_than_s=0)
    assert figures(catalog) == before and verify(catalog, "ds").ok
    assert len(catalog.history("ds")) == 2 and len(catalog.archived("ds")[0]) == 3
    assert metadata_files(catalog) == referenced_metadata(catalog.table("ds"))  # the first archive file went too


def test_a_job_whose_snapshot_expired_is_still_done(catalog):
    """Exactly once survives expiry: committing an expired snapshot's job again adds nothing."""
    snaps = five_jobs(catalog)
    expire(catalog, "ds", older_than_s=0, retain_last=2, now_s=time.time() + LATER)  # takes job-1 and job-3
    found = catalog.find_job("ds", "job-1")
    assert found is not None and found.snapshot_id == snaps[0].snapshot_id
    rows = catalog.scan("ds").num_rows
    again = catalog.commit_job("ds", "job-1", [], {"samples": "0"})
    assert again.snapshot_id == snaps[0].snapshot_id and catalog.scan("ds").num_rows == rows
    assert len(catalog.history("ds")) == 3


def test_gc_after_expiry_removes_data_files_only_expired_snapshots_needed(catalog):
    t1, t2 = shard_rows("job-1", {"a.txt": 5}), shard_rows("job-2", {"b.txt": 4}, seed=1)
    plant(catalog, "ds", "job-1", t1, {"quarantine": side_rows(QUARANTINE_SCHEMA, "job-1", ["empty"])},
          [entry("a.txt", "aa")])
    plant(catalog, "ds", "job-2", t2, sources=[entry("b.txt", "bb")])
    job1_files = [f.path for f in catalog.data_files("ds") if "/job-1/" in f.path]
    catalog.table("ds").delete("job_id == 'job-1'")  # whole files: a snapshot that drops job-1's data files
    plant(catalog, "ds", "job-3", shard_rows("job-3", {"c.txt": 2}, seed=2), sources=[entry("c.txt", "cc")])
    assert job1_files and not any("/job-1/" in f.path for f in catalog.data_files("ds"))
    assert gc(catalog, "ds", older_than_s=0).deleted == []  # the first snapshot still needs them
    before = figures(catalog)
    report = expire(catalog, "ds", older_than_s=0, now_s=time.time() + LATER)
    assert len(report.expired) == 3 and len(catalog.history("ds")) == 1
    deleted = gc(catalog, "ds", older_than_s=0).deleted
    assert sorted(deleted) == sorted(job1_files)
    assert not any(os.path.exists(p.removeprefix("file://")) for p in job1_files)
    job1 = catalog.data_location("ds", "job-1").removeprefix("file://")
    for side in ("_quarantine.parquet", "_sources.json", "_checksums.json"):  # still part of the history
        assert os.path.exists(f"{job1}/{side}"), side
    after = figures(catalog)
    assert after == before and sorted(after["rows"]) == sorted(t2["sample_id"].to_pylist() +
                                                              [f"job-3:c.txt:{i}" for i in range(2)])
    assert after["quarantine"] == [{"job_id": "job-1", "n": 1}]
    assert verify(catalog, "ds").ok and catalog.scan("ds").num_rows == t2.num_rows + 2


def test_cli_expire_and_gc(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    ids = [plant(catalog, "ds", f"job-{k}", shard_rows(f"job-{k}", {f"s{k}.txt": 2}, seed=k)).snapshot_id
           for k in range(3)]
    time.sleep(0.01)
    dry = run("catalog", "expire", "ds", "--older-than", "0", "--dry-run", "--json", home=tmp_path).json()
    assert dry["expired"] == ids[:2] and dry["dry_run"] and len(catalog.history("ds")) == 3
    r = run("catalog", "expire", "ds", "--older-than", "0", "--retain-last", "2", home=tmp_path)
    assert r.returncode == 0 and "expired 1 snapshots" in r.stdout
    assert [s.snapshot_id for s in catalog.history("ds")] == ids[1:]
    reports = run("catalog", "gc", "ds", "--older-than", "0", "--json", home=tmp_path).json()
    assert reports[0]["deleted"] == [] and reports[0]["deleted_metadata"]
    assert json.loads(run("catalog", "stats", "ds", "--json", home=tmp_path).stdout)["stats"]["samples"] == 6
    for args, message in ((("catalog", "expire", "nope", "--older-than", "1"), "no dataset named 'nope'"),
                          (("catalog", "expire", "ds", "--older-than", "1", "--retain-last", "0"), "at least 1"),
                          (("catalog", "expire", "ds", "--older-than", "-1"), "hours >= 0")):
        r = run(*args, home=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
