"""Catalog jobs: list, show, history, stats, tag, query, diff, verify, expire and gc, over `catalog/`."""

from __future__ import annotations

from dataclasses import asdict

from tokenloom.catalog.stats import hist_edges
from tokenloom.jobs.home import Home, open_catalog


def ls(home: Home, cfg) -> list[dict]:
    catalog = open_catalog(home, cfg)
    return [catalog.summary(name) for name in catalog.list_datasets()]


def show(home: Home, cfg, dataset: str, at: str | None = None) -> dict:
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    summary["files"] = [asdict(f) for f in catalog.data_files(dataset, at)]
    return summary


def history(home: Home, cfg, dataset: str) -> list[dict]:
    catalog = open_catalog(home, cfg)
    tags = catalog.tags(dataset)
    out = []
    for snap in catalog.history(dataset):
        tl = snap.tokenloom
        out.append({"snapshot_id": snap.snapshot_id, "timestamp_ms": snap.timestamp_ms,
                    "operation": snap.operation, "job_id": tl.get("job_id"),
                    "samples": int(tl.get("samples", 0)), "tokens": int(tl.get("tokens", 0)),
                    "quarantined": int(tl.get("quarantined", 0)),
                    "total_records": int(snap.properties.get("total-records", 0)),
                    "tags": sorted(t for t, sid in tags.items() if sid == snap.snapshot_id)})
    return out


def stats(home: Home, cfg, dataset: str, at: str | None = None) -> dict:
    s = open_catalog(home, cfg).summary(dataset, at)
    keys = ("dataset", "snapshot_id", "tags", "samples", "tokens", "total_quarantined", "stats", "job_id", "job_samples",
            "job_tokens", "quarantined", "quarantine_reasons")
    return {k: s.get(k) for k in keys} | {"length_hist_edges": hist_edges()}


def tag(home: Home, cfg, dataset: str, name: str, at: str | None = None) -> dict:
    snapshot_id = open_catalog(home, cfg).tag(dataset, name, at)
    return {"dataset": dataset, "tag": name, "snapshot_id": snapshot_id}


def query(home: Home, cfg, sql: str, at: list[str] | None = None):
    """`at`: `--at` values, `SNAPSHOT|TAG` (the one dataset that has it) or `NAME=SNAPSHOT|TAG`."""
    from tokenloom.catalog.query import query as run_query
    from tokenloom.catalog.query import resolve_at

    catalog = open_catalog(home, cfg)
    return run_query(catalog, sql, resolve_at(catalog, at or []))


def diff(home: Home, cfg, dataset: str, a: str, b: str) -> dict:
    from tokenloom.catalog.diff import snapshot_diff

    return snapshot_diff(open_catalog(home, cfg), dataset, a, b)


def verify(home: Home, cfg, dataset: str, at: str | None = None):
    from tokenloom.catalog.maintenance import verify as run_verify

    return run_verify(open_catalog(home, cfg), dataset, at)


def expire(home: Home, cfg, dataset: str, older_than_s: float, retain_last: int = 1, dry_run: bool = False):
    from tokenloom.catalog.maintenance import expire as run_expire

    return run_expire(open_catalog(home, cfg), dataset, older_than_s, retain_last, dry_run)


def gc(home: Home, cfg, dataset: str | None, older_than_s: float, dry_run: bool = False) -> list:
    from tokenloom.catalog.maintenance import gc as run_gc

    catalog = open_catalog(home, cfg)
    names = [dataset] if dataset else catalog.list_datasets()
    return [run_gc(catalog, name, older_than_s, dry_run) for name in names]
