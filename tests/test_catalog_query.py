"""`catalog query` over every table of a dataset (samples, quarantine, filtered, duplicates,
sources) at any snapshot, its read-only guarantees, and `catalog diff`; the figures asserted
are recomputed from the rows the tests planted, never read back from the catalog.

`plant` does what the ingestion sink and driver do: data files with checksums, Parquet side
files in the schemas of catalog/schema.py named by the commit, and a `_sources.json`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from cli_runner import run
from multimodal_data import audio_sample, image_sample, text_sample
from pyarrow import fs

from tokenloom.catalog import SHARD_SCHEMA, CatalogConfig, DatasetNotFound, TokenCatalog
from tokenloom.catalog.diff import diff_samples, diff_sources, snapshot_diff
from tokenloom.catalog.maintenance import sha256_bytes, write_json
from tokenloom.catalog.query import query, resolve_at
from tokenloom.catalog.schema import (
    DUPLICATES_SCHEMA,
    FILTERED_SCHEMA,
    QUARANTINE_SCHEMA,
    SIDE_TABLES,
    modality_mix,
)
from tokenloom.catalog.stats import shard_stats

MAKERS = (text_sample, image_sample, audio_sample)


def shard_rows(job: str, per_source: dict[str, int], seed: int = 0, vocab_id: str = "vocab-t") -> pa.Table:
    """`per_source[path]` samples of each source, modality mixes cycling text / image+text / audio+text."""
    rng = np.random.default_rng(seed)
    out = []
    for path, n in per_source.items():
        for i in range(n):
            tokens, segments = MAKERS[(len(out) + seed) % 3](rng)
            out.append({"sample_id": f"{job}:{path}:{i}", "source": path, "tokens": tokens.tolist(),
                        "segments": segments, "num_tokens": len(tokens), "modalities": modality_mix(segments),
                        "vocab_id": vocab_id, "bundle_ids": ["b"], "job_id": job, "content_hash": None})
    return pa.Table.from_pylist(out, schema=SHARD_SCHEMA)


def side_rows(schema: pa.Schema, job: str, reasons: list[str]) -> list[dict]:
    return [{f.name: (reason if f.name == "reason" else job if f.name == "job_id" else
                      1.0 if f.name == "similarity" else f"{job}-{f.name}-{k}") for f in schema}
            for k, reason in enumerate(reasons)]


def plant(catalog: TokenCatalog, name: str, job: str, table: pa.Table, side: dict[str, list[dict]] | None = None,
          sources: list[dict] | None = None, vocab_id: str = "vocab-t"):
    """Commit `table` as job `job`; `side[table name]` rows become that side table's Parquet file
    (a table not in `side` gets no key at all, like jobs older than it)."""
    loc = catalog.data_location(name, job)
    filesystem, base = fs.FileSystem.from_uri(loc)
    filesystem.create_dir(base, recursive=True)
    files, sums = [], {}
    for p, mix in enumerate(sorted(set(table["modalities"].to_pylist()))):
        buf = pa.BufferOutputStream()
        pq.write_table(table.filter(pc.equal(table["modalities"], mix)), buf)
        data = buf.getvalue()
        with filesystem.open_output_stream(f"{base}/part-{p}.parquet") as f:
            f.write(data)
        files.append(f"{loc}/part-{p}.parquet")
        sums[files[-1]] = sha256_bytes(data)
    write_json(f"{loc}/_checksums.json", sums)
    props: dict[str, object] = {"samples": str(table.num_rows), "checksums_file": f"{loc}/_checksums.json",
                                "vocab_id": vocab_id, "bundle_ids": ["b"], "code_version": "test"}
    for table_name, records in (side or {}).items():
        key, schema = SIDE_TABLES[table_name]
        pq.write_table(pa.Table.from_pylist(records, schema=schema), f"{base}/_{table_name}.parquet")
        props[key] = [f"{loc}/_{table_name}.parquet"]
    if "quarantine" in (side or {}):
        props["quarantined"] = str(len(side["quarantine"]))
    if sources is not None:
        write_json(f"{loc}/_sources.json", sources)
        props["sources_file"] = f"{loc}/_sources.json"
    return catalog.commit_job(name, job, files, props, stats=shard_stats(table))


def entry(path: str, sha: str) -> dict:
    return {"path": path, "size": 10, "mtime_ns": 5, "sha256": sha}


@pytest.fixture
def catalog(tmp_path):
    return TokenCatalog(CatalogConfig(), tmp_path)


@pytest.fixture
def mix(catalog):
    """Dataset `mix`: job-1 (tagged v1) with quarantine and filtered rows, job-2 with quarantine
    and duplicates and a changed b.txt; and dataset `stdlib-docs` with samples only."""
    planted = {
        "t1": shard_rows("job-1", {"a.txt": 4, "b.txt": 3}),
        "q1": side_rows(QUARANTINE_SCHEMA, "job-1", ["bad utf-8", "bad utf-8", "empty"]),
        "f1": side_rows(FILTERED_SCHEMA, "job-1", ["too short", "too short"]),
        "t2": shard_rows("job-2", {"b.txt": 2, "c.txt": 5}, seed=1),
        "q2": side_rows(QUARANTINE_SCHEMA, "job-2", ["empty"]),
        "d2": side_rows(DUPLICATES_SCHEMA, "job-2", ["exact", "exact", "near-text"]),
        "s1": [entry("a.txt", "aa"), entry("b.txt", "bb")],
        "s2": [entry("b.txt", "bb2"), entry("c.txt", "cc")],
    }
    planted["snap1"] = plant(catalog, "mix", "job-1", planted["t1"], {"quarantine": planted["q1"], "filtered": planted["f1"]},
                             planted["s1"])
    catalog.tag("mix", "v1")
    planted["snap2"] = plant(catalog, "mix", "job-2", planted["t2"], {"quarantine": planted["q2"], "duplicates": planted["d2"]},
                             planted["s2"])
    planted["docs"] = plant(catalog, "stdlib-docs", "job-d", shard_rows("job-d", {"os.txt": 3}))
    return planted


def counts(table: pa.Table, key: str) -> dict:
    return dict(zip(table.column(key).to_pylist(), table.column("n").to_pylist(), strict=True))


def test_every_table_of_a_dataset_counts_the_planted_rows(catalog, mix):
    samples = pa.concat_tables([mix["t1"], mix["t2"]])
    assert query(catalog, "SELECT count(*) AS n FROM mix").to_pylist() == [{"n": samples.num_rows}]
    assert query(catalog, "SELECT count(*) AS n FROM mix.samples").to_pylist() == [{"n": samples.num_rows}]
    by_mix = query(catalog, "SELECT modalities, count(*) AS n FROM mix.samples GROUP BY 1")
    assert counts(by_mix, "modalities") == Counter(samples["modalities"].to_pylist())
    quarantine = query(catalog, "SELECT reason, count(*) AS n FROM mix.quarantine GROUP BY 1")
    assert counts(quarantine, "reason") == Counter(r["reason"] for r in mix["q1"] + mix["q2"])
    filtered = query(catalog, "SELECT reason, count(*) AS n FROM mix.filtered GROUP BY 1")
    assert counts(filtered, "reason") == {"too short": 2}  # job-2 has no filtered key: it adds nothing
    duplicates = query(catalog, "SELECT * FROM mix.duplicates ORDER BY sample_id")
    assert duplicates.column_names == DUPLICATES_SCHEMA.names and duplicates.to_pylist() == mix["d2"]
    joined = query(catalog, "SELECT count(*) AS n FROM mix.duplicates d JOIN mix.quarantine q USING (job_id)")
    assert joined.to_pylist() == [{"n": len(mix["d2"]) * len(mix["q2"])}]


def test_sources_table_is_the_source_index_with_sample_counts(catalog, mix):
    got = query(catalog, "SELECT path, sha256, job_id, snapshot_id, samples FROM mix.sources ORDER BY path").to_pylist()
    samples = Counter(pa.concat_tables([mix["t1"], mix["t2"]])["source"].to_pylist())
    s1, s2 = mix["snap1"].snapshot_id, mix["snap2"].snapshot_id
    assert got == [{"path": "a.txt", "sha256": "aa", "job_id": "job-1", "snapshot_id": s1, "samples": samples["a.txt"]},
                   {"path": "b.txt", "sha256": "bb2", "job_id": "job-2", "snapshot_id": s2, "samples": samples["b.txt"]},
                   {"path": "c.txt", "sha256": "cc", "job_id": "job-2", "snapshot_id": s2, "samples": samples["c.txt"]}]


def test_at_an_earlier_snapshot_shows_every_table_as_it_was(catalog, mix):
    for spec in (["v1"], [f"mix={mix['snap1'].snapshot_id}"], ["mix=v1"]):
        at = resolve_at(catalog, spec)
        assert query(catalog, "SELECT count(*) AS n FROM mix", at).to_pylist() == [{"n": mix["t1"].num_rows}]
        quarantine = query(catalog, "SELECT reason, count(*) AS n FROM mix.quarantine GROUP BY 1", at)
        assert counts(quarantine, "reason") == Counter(r["reason"] for r in mix["q1"])
        empty = query(catalog, "SELECT * FROM mix.duplicates", at)  # no job had written one yet
        assert empty.num_rows == 0 and empty.column_names == DUPLICATES_SCHEMA.names
        sources = query(catalog, "SELECT path, sha256, samples FROM mix.sources ORDER BY path", at).to_pylist()
        assert sources == [{"path": "a.txt", "sha256": "aa", "samples": 4}, {"path": "b.txt", "sha256": "bb", "samples": 3}]
        # the other dataset is read at its current snapshot
        assert query(catalog, 'SELECT count(*) AS n FROM "stdlib-docs"', at).to_pylist() == [{"n": 3}]


def test_a_dataset_name_with_dashes_and_empty_side_tables(catalog, mix):
    for table, (_, schema) in SIDE_TABLES.items():
        got = query(catalog, f'SELECT * FROM "stdlib-docs".{table}')
        assert got.num_rows == 0 and got.column_names == schema.names
    got = query(catalog, 'SELECT source, count(*) AS n FROM "stdlib-docs".samples GROUP BY 1').to_pylist()
    assert got == [{"source": "os.txt", "n": 3}]
    assert query(catalog, 'SELECT count(*) AS n FROM "stdlib-docs".sources').to_pylist() == [{"n": 0}]


def test_at_names_one_dataset_or_says_why_not(catalog, mix):
    catalog.tag("stdlib-docs", "shared")
    catalog.tag("mix", "shared")
    assert resolve_at(catalog, [str(mix["docs"].snapshot_id)]) == {"stdlib-docs": str(mix["docs"].snapshot_id)}
    with pytest.raises(ValueError, match=r"on several datasets \(mix, stdlib-docs\); say which with --at NAME=shared"):
        resolve_at(catalog, ["shared"])
    with pytest.raises(ValueError, match="on no dataset"):
        resolve_at(catalog, ["v9"])
    with pytest.raises(ValueError, match="on no dataset"):
        resolve_at(catalog, ["12345"])
    with pytest.raises(DatasetNotFound, match="no dataset named 'nope'"):
        resolve_at(catalog, ["nope=v1"])
    with pytest.raises(DatasetNotFound, match="has no tag 'v9'"):
        resolve_at(catalog, ["mix=v9"])
    with pytest.raises(ValueError, match="two snapshots"):
        resolve_at(catalog, ["mix=v1", f"mix={mix['snap2'].snapshot_id}"])


def test_read_only_guarantees_hold_for_the_new_tables(catalog, mix, tmp_path):
    for sql in ("COPY (SELECT * FROM mix.quarantine) TO '/tmp/tokenloom-leak.parquet'",
                f"ATTACH '{tmp_path}/x.db' AS x", "SET enable_external_access = true",
                "CREATE VIEW mix.evil AS SELECT 1", "DROP VIEW mix.quarantine",
                "SELECT 1; SELECT * FROM mix.filtered"):
        with pytest.raises(ValueError, match="read-only SELECT|one statement"):
            query(catalog, sql)
    at = resolve_at(catalog, ["v1"])
    job2 = catalog.data_location("mix", "job-2").removeprefix("file://")
    job1 = catalog.data_location("mix", "job-1").removeprefix("file://")
    orphan = Path(job1) / "orphan.parquet"  # on disk beside the views' files, in no snapshot
    pq.write_table(mix["t1"], orphan)
    outside = [  # each exists on disk; none is a file a view names
        "/etc/passwd", str(orphan), f"{job1}/_sources.json", f"{job1}/_checksums.json",
        f"{job2}/_quarantine.parquet", f"{job2}/part-0.parquet",  # another snapshot's files under --at v1
    ]
    for path in outside:
        assert Path(path).exists(), path
        for reader in ("read_parquet", "read_csv", "read_json", "read_text"):
            with pytest.raises(ValueError, match="Permission Error|disabled by configuration"):
                query(catalog, f"SELECT * FROM {reader}('{path}')", at)
    # the views themselves still read, side files included
    assert query(catalog, "SELECT count(*) AS n FROM mix.quarantine", at).to_pylist() == [{"n": len(mix["q1"])}]


def test_a_missing_side_file_is_named_in_one_line(catalog, mix):
    side = json.loads(catalog.snapshot("mix").tokenloom["duplicates_files"])[0]
    Path(side.removeprefix("file://")).unlink()
    with pytest.raises(ValueError, match="cannot open dataset 'mix'.*catalog verify mix") as caught:
        query(catalog, "SELECT count(*) FROM mix")
    assert len(str(caught.value).splitlines()) == 1


def test_diff_equals_the_set_difference_of_the_planted_rows(catalog, mix):
    """job-3 deletes a.txt's samples (tombstone), re-reads b.txt with other content, adds d.txt."""
    catalog.table("mix").delete("source == 'a.txt'")
    t3 = shard_rows("job-3", {"d.txt": 4}, seed=2)
    snap3 = plant(catalog, "mix", "job-3", t3, sources=[{"path": "a.txt", "removed": True}, entry("b.txt", "bb3"),
                                                        entry("d.txt", "dd")])
    before = mix["t1"]
    after = pa.concat_tables([mix["t1"], mix["t2"], t3]).filter(pc.not_equal(pc.field("source"), "a.txt"))
    mixes_before = dict(zip(before["sample_id"].to_pylist(), before["modalities"].to_pylist(), strict=True))
    mixes_after = dict(zip(after["sample_id"].to_pylist(), after["modalities"].to_pylist(), strict=True))
    added = Counter(mixes_after[s] for s in set(mixes_after) - set(mixes_before))
    removed = Counter(mixes_before[s] for s in set(mixes_before) - set(mixes_after))
    d = snapshot_diff(catalog, "mix", "v1", str(snap3.snapshot_id))
    assert (d["from_snapshot"], d["to_snapshot"]) == (mix["snap1"].snapshot_id, snap3.snapshot_id)
    assert d["samples"]["added"] == sum(added.values()) == mix["t2"].num_rows + t3.num_rows
    assert d["samples"]["removed"] == sum(removed.values()) == 4
    assert d["samples"]["by_modalities"] == {m: {"added": added[m], "removed": removed[m]} for m in added | removed}
    assert d["sources"] == {"added": ["c.txt", "d.txt"], "removed": ["a.txt"], "changed": ["b.txt"]}
    back = snapshot_diff(catalog, "mix", str(snap3.snapshot_id), "v1")  # the reverse swaps the two sides
    assert (back["samples"]["added"], back["samples"]["removed"]) == (d["samples"]["removed"], d["samples"]["added"])
    assert back["sources"] == {"added": ["a.txt"], "removed": ["c.txt", "d.txt"], "changed": ["b.txt"]}
    same = snapshot_diff(catalog, "mix", "v1", "v1")
    assert same["samples"] == {"added": 0, "removed": 0, "by_modalities": {}} and not any(same["sources"].values())


def test_diff_pure_functions():
    a = pa.table({"sample_id": ["x", "y", "z"], "modalities": ["text", "image+text", "text"]})
    b = pa.table({"sample_id": ["y", "w"], "modalities": ["image+text", "audio+text"]})
    assert diff_samples(a, b) == {"added": 1, "removed": 2, "by_modalities": {
        "audio+text": {"added": 1, "removed": 0}, "text": {"added": 0, "removed": 2}}}
    assert diff_sources({"p": {"sha256": "1"}, "q": {"sha256": "2"}}, {"p": {"sha256": "9"}, "r": {"sha256": "3"}}) == {
        "added": ["r"], "removed": ["q"], "changed": ["p"]}


def test_cli_query_at_and_diff(tmp_path):
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    t1 = shard_rows("job-1", {"a.txt": 3})
    s1 = plant(catalog, "mix", "job-1", t1, {"quarantine": side_rows(QUARANTINE_SCHEMA, "job-1", ["empty"])},
               [entry("a.txt", "aa")])
    catalog.tag("mix", "v1")
    s2 = plant(catalog, "mix", "job-2", shard_rows("job-2", {"b.txt": 2}), sources=[entry("b.txt", "bb")])
    r = run("catalog", "query", "SELECT count(*) AS n FROM mix.samples", "--at", "v1", "--format", "json", home=tmp_path)
    assert r.json() == [{"n": 3}]
    r = run("catalog", "query", "SELECT reason FROM mix.quarantine", "--at", f"mix={s2.snapshot_id}", "--format", "json",
            home=tmp_path)
    assert r.json() == [{"reason": "empty"}]  # job-1's quarantine is part of the later snapshot too
    d = run("catalog", "diff", "mix", "v1", str(s2.snapshot_id), "--json", home=tmp_path).json()
    assert d == json.loads(json.dumps(snapshot_diff(catalog, "mix", "v1", str(s2.snapshot_id))))
    assert d["samples"]["added"] == 2 and d["sources"]["added"] == ["b.txt"]
    table = run("catalog", "diff", "mix", str(s1.snapshot_id), "v1", home=tmp_path)
    assert table.returncode == 0 and "+0" in table.stdout
    for args, message in ((("catalog", "query", "SELECT 1", "--at", "v9"), "on no dataset"),
                          (("catalog", "query", "SELECT 1", "--at", "nope=v1"), "no dataset named 'nope'"),
                          (("catalog", "diff", "mix", "v1", "v9"), "has no tag 'v9'"),
                          (("catalog", "diff", "mix", "v1", "999"), "has no snapshot 999"),
                          (("catalog", "diff", "nope", "v1", "v1"), "no dataset named 'nope'")):
        r = run(*args, home=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
