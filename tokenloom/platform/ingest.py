"""The ingestion job: raw files -> routed tokenizer pools -> Parquet shards -> one snapshot.

One Ray Data pipeline per run. Files are routed by modality on the driver (cheap: a suffix
look-up), so each modality reads only its own files, runs on its own actor pool with its
own resources, and the branches meet at a single shard sink. The job id is a hash of the
inputs, bundles, layout options and dataset, so re-running the same job finds its snapshot and
does nothing; a job that dies before the commit adds no snapshot (its files are gc food).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import ray

from tokenloom.catalog.maintenance import write_json
from tokenloom.catalog.sources import source_index
from tokenloom.catalog.store import TokenCatalog
from tokenloom.datasets import sources
from tokenloom.platform.config import IngestConfig
from tokenloom.platform.dedup import deduplicate, existing_keys
from tokenloom.platform.incremental import classify, plan
from tokenloom.platform.pools import pool_figures, pool_mode, pool_stage
from tokenloom.platform.sink import ShardSink, TaskOutput
from tokenloom.platform.workers import STAGE_POOL, WORKERS, needs, stages
from tokenloom.tokenizers.vocab import VocabManifest

log = logging.getLogger("tokenloom")


@dataclass
class IngestResult:
    dataset: str
    job_id: str
    snapshot_id: int
    already_committed: bool
    samples: int
    tokens: int
    quarantined: int
    quarantine_reasons: dict[str, int]
    skipped_files: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    input_bytes: int = 0
    # the inputs against the dataset's source index: new (tokenized now), changed, unchanged, removed
    sources: dict[str, int] = field(default_factory=dict)
    deleted_samples: int = 0  # old samples of changed (and, under sync, removed) files this job deleted
    filtered: int = 0  # valid records a quality filter dropped
    filter_counts: dict[str, int] = field(default_factory=dict)  # filter name -> records
    duplicates: int = 0  # samples dropped as duplicates (of this job's or the dataset's)
    duplicate_counts: dict[str, int] = field(default_factory=dict)  # kind -> samples
    # per tokenizer pool: mode, records, tokens, seconds, busy fraction (platform/pools.pool_figures)
    pools: dict[str, dict] = field(default_factory=dict)


def job_id_for(dataset: str, manifest_hash: str, bundles: dict[str, str], text_first: float = 0.0) -> str:
    """The identity of a job: the same inputs tokenized by the same bundles into one dataset.
    The manifest's id is left out on purpose: a dataset's manifest only ever grows by appended
    ranges, which give the same ids to the same inputs, so a re-run after another modality's job
    extended it stays a no-op."""
    parts = [dataset, manifest_hash, sorted(bundles.items())]
    if text_first:  # a different layout of the same inputs is a different job
        parts.append(round(text_first, 6))
    key = json.dumps(parts)
    return "job-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def token_auth_for_clusters() -> None:
    """Connect to an existing cluster with Ray's token authentication when this machine holds a token
    (`~/.ray/auth_token`, which `ray start` writes): Ray 2.60 enables it for a local head by default,
    but a client process only sends the token when `RAY_AUTH_MODE=token` is set."""
    if "RAY_AUTH_MODE" in os.environ or not (Path.home() / ".ray" / "auth_token").is_file():
        return
    try:  # sets the variable and refreshes Ray's cached config (read when ray was imported)
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # another Ray version: the variable alone
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    _enable_token_auth()


def ensure_ray(config: IngestConfig) -> None:
    """Connect to the configured cluster, or start a small local Ray with one label per pool."""
    if ray.is_initialized():
        return
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = config.ray.progress_bars
    ctx.print_on_execution_start = config.ray.progress_bars
    if config.ray.address:
        token_auth_for_clusters()
        ray.init(address=config.ray.address, log_to_driver=False)
        have = ray.cluster_resources()
        for modality, pool in config.pools.items():
            if pool.resource_label and pool.resource_label not in have:
                raise ValueError(
                    f"the Ray cluster at {config.ray.address} has no resource {pool.resource_label!r} for the "
                    f"{modality} pool: start its nodes with --resources='{{\"{pool.resource_label}\": N}}' "
                    f"or set ingest.pools.{modality}.resource_label=''"
                )
        return
    labels: dict[str, float] = {}
    for pool in config.pools.values():
        if pool.resource_label:
            labels[pool.resource_label] = labels.get(pool.resource_label, 0) + pool.max_actors
    # logical CPUs: every pool's actors plus room for read and write tasks, so that pools that
    # start at once on a small machine never starve the tasks that feed them (the OS shares the cores)
    actor_cpus = sum(p.num_cpus * p.max_actors for p in config.pools.values())
    ray.init(
        num_cpus=config.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(actor_cpus + 1.5)),
        resources=labels,
        object_store_memory=config.ray.object_store_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


RECORD_SCHEMA = pa.schema([(n, pa.string()) for n in ("sample_id", "source", "record", "modality", "payload", "error")]
                          + [("blob", pa.large_binary()),  # image file bytes, decoded on the image pool
                             ("media", pa.string())])  # audio file path, read in blocks on the audio pool


def _parse_batch(batch: dict) -> pa.Table:
    rows = {name: [] for name in RECORD_SCHEMA.names}
    for path, data, modality in zip(batch["path"], batch["bytes"], batch["modality"], strict=True):
        for rec in sources.parse_file(str(path), str(modality), bytes(data)):
            for name in rows:
                rows[name].append(getattr(rec, name))
    return pa.table(rows, schema=RECORD_SCHEMA)


def _parse_range_batch(batch: dict) -> pa.Table:
    rows = {name: [] for name in RECORD_SCHEMA.names}
    for path, start, stop, before in zip(batch["path"], batch["start"], batch["stop"], batch["newlines_before"],
                                         strict=True):
        for rec in sources.parse_text_range(str(path), int(start), int(stop), int(before)):
            for name in rows:
                rows[name].append(getattr(rec, name))
    return pa.table(rows, schema=RECORD_SCHEMA)


def _count_range(row: dict) -> dict:
    return {**row, "newlines": sources.count_newlines(row["path"], int(row["start"]), int(row["stop"]))}


def _split_ranges(paths: list[sources.SourceFile], split_bytes: int) -> ray.data.Dataset:
    """Big JSON-lines corpora as byte ranges (`sources.read_range`), one read task per range, so a
    single file feeds every actor of the pool; the ranges' newlines are counted first (one task
    each) so that every record keeps its line number as its id."""
    ranges = [{"path": f.path, "start": a, "stop": b} for f in paths for a, b in sources.byte_ranges(f.size, split_bytes)]
    counted = ray.data.from_items(ranges, override_num_blocks=len(ranges)).map(_count_range).take_all()
    counted.sort(key=lambda r: (r["path"], r["start"]))
    items = []
    for path in sorted({r["path"] for r in counted}):
        mine = [r for r in counted if r["path"] == path]
        before = sources.range_plan([(r["start"], r["stop"]) for r in mine], [r["newlines"] for r in mine])
        items += [{"path": path, "start": r["start"], "stop": r["stop"], "newlines_before": b}
                  for r, b in zip(mine, before, strict=True)]
    log.info("split reading: %d file(s) as %d byte ranges of <= %d bytes", len(paths), len(items), split_bytes)
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(_parse_range_batch, batch_size=1,
                                                                                  batch_format="numpy")


def _read_branch(files: list[sources.SourceFile], config: IngestConfig) -> ray.data.Dataset:
    modality = files[0].modality
    kwargs = {"override_num_blocks": config.read_tasks} if config.read_tasks else {}
    split = [f for f in files if modality == "text" and sources.can_split(f.path, f.size, config.split_bytes)]
    split_set = {f.path for f in split}
    files = [f for f in files if f.path not in split_set]
    # audio files are read by their pool, in blocks: only their paths travel (pairs files are read)
    whole = [f.path for f in files if sources.READS_BYTES[modality] or f.path.lower().endswith(".jsonl")]
    whole_set = set(whole)
    by_path = [f.path for f in files if f.path not in whole_set]
    inputs = []
    if whole:
        # read and parse fuse into one task (same resources), so each file is handled by one
        # worker process: on small machines process count, not compute, is the overhead to avoid
        inputs.append(ray.data.read_binary_files(whole, include_paths=True, **kwargs))
    if by_path:
        inputs.append(ray.data.from_items([{"path": p, "bytes": b""} for p in by_path]))
    parts = [_split_ranges(split, config.split_bytes)] if split else []
    if inputs:
        ds = inputs[0].union(*inputs[1:]) if len(inputs) > 1 else inputs[0]
        parts.append(ds.map_batches(lambda b: _parse_batch(b | {"modality": [modality] * len(b["path"])}),
                                    batch_format="numpy"))
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def run_ingest(
    inputs: Sequence[str | Path],
    dataset: str,
    catalog: TokenCatalog,
    vocab: VocabManifest,
    bundle_paths: dict[str, str],
    config: IngestConfig,
    lineage: dict[str, str] | None = None,
    sync: bool = False,
) -> IngestResult:
    """Tokenize `inputs` into `dataset`; returns the committed (or already committed) snapshot."""
    started = time.perf_counter()
    files, skipped = sources.discover(inputs)
    if not files:
        raise ValueError(
            f"no ingestible files under {', '.join(map(str, inputs))} (routed suffixes: {sorted(sources.ROUTES)})"
        )
    if all(f.modality in sources.UNPOOLED for f in files):
        raise ValueError(f"only caption files under {', '.join(map(str, inputs))}: no samples to ingest")
    # incremental: only inputs the dataset has not read as they are now are tokenized; a changed
    # file's old samples (and, with `sync`, a removed file's) leave in the same snapshot
    changes = classify(files, source_index(catalog, dataset), inputs)
    work = plan(files, changes, sync)
    if changes.removed and not sync:
        log.warning("%s: %d input file(s) removed since they were ingested; their samples stay (ingest with --sync "
                    "to delete them): %s", dataset, len(changes.removed), ", ".join(changes.removed)[:500])
    by_modality: dict[str, list[sources.SourceFile]] = {}
    for f in work.tokenize:  # captions and paired images are read with their sample
        by_modality.setdefault(f.modality, []).append(f)
    if work.empty:  # nothing new: the dataset already holds every input
        snap = catalog.snapshot(dataset)
        summary = catalog.summary(dataset, snap.snapshot_id)
        return IngestResult(dataset, summary["job_id"], snap.snapshot_id, True, summary["job_samples"],
                            summary["job_tokens"], summary["quarantined"], summary["quarantine_reasons"], skipped,
                            time.perf_counter() - started, 0, changes.counts())
    needed: set[str] = set()
    for modality in by_modality:
        config.pool(modality).validate(modality)
        for kind in sorted(needs(modality)):
            if kind not in bundle_paths:
                raise ValueError(f"inputs include {modality} files but no {kind} tokenizer bundle was given")
            needed.add(kind)
    bundles = {kind: Path(bundle_paths[kind]).name for kind in sorted(needed)}
    # the job reads what its source entries say (content hashes included) and deletes what it names
    manifest_hash = hashlib.sha256(json.dumps([work.entries, work.delete_sources]).encode()).hexdigest()[:16]
    config.validate()
    has_media = any(m in by_modality for m in ("image", "audio", "video"))
    if config.pools_mode == "service" and "video" in by_modality:
        raise ValueError("the long-lived services tokenize text, images and audio, not video: ingest the video "
                         "files with --pools job")
    # the quality filters and dedup settings decide which samples a job keeps: part of its identity
    identity = hashlib.sha256(json.dumps([manifest_hash, asdict(config.filters), asdict(config.dedup)],
                                         sort_keys=True).encode()).hexdigest()[:16]
    job_id = job_id_for(dataset, identity, bundles, config.text_first if has_media else 0.0)
    input_bytes = sum(f.size for f in work.tokenize)

    done = catalog.find_job(dataset, job_id)
    if done is not None:  # its own summary: the snapshot may since have been expired (archived)
        tl = done.tokenloom
        return IngestResult(dataset, job_id, done.snapshot_id, True, int(tl.get("samples", 0)),
                            int(tl.get("tokens", 0)), int(tl.get("quarantined", 0)),
                            json.loads(tl.get("quarantine_reasons", "{}")), skipped, time.perf_counter() - started,
                            input_bytes, changes.counts(), int(tl.get("removed_samples", 0)),
                            int(tl.get("filtered", 0)), json.loads(tl.get("filter_counts", "{}")),
                            int(tl.get("duplicates", 0)), json.loads(tl.get("duplicate_counts", "{}")),
                            json.loads(tl.get("pools", "{}")))

    location = catalog.data_location(dataset, job_id)
    out = _tokenize(by_modality, config, bundle_paths, vocab, location, job_id, bundles) if by_modality else None
    if not work.delete_sources and (out is None or (out.samples + out.quarantined + out.filtered) == 0):
        raise ValueError("the inputs hold no records (empty files or blank lines only); nothing committed")
    if not work.delete_sources and not out.data_files and not out.filtered:
        raise ValueError(
            f"every input record was quarantined ({out.quarantined}: {dict(out.reasons)}); nothing to commit"
        )
    out = out or TaskOutput()
    # duplicates are decided here, once every write task has returned its keys (platform/dedup.py)
    deduped = deduplicate(out, existing_keys(catalog, dataset, work.delete_sources), config.dedup, location, job_id)
    checksums_file, sources_file = f"{location}/_checksums.json", f"{location}/_sources.json"
    write_json(checksums_file, out.checksums)
    write_json(sources_file, work.entries)
    snap = catalog.commit_job(
        dataset,
        job_id,
        out.data_files,
        {
            "samples": str(out.samples),
            "tokens": str(out.tokens),
            "quarantined": str(out.quarantined),
            "quarantine_reasons": dict(sorted(out.reasons.items())),
            "quarantine_files": out.quarantine_files,
            "vocab_id": vocab.id,
            "bundle_ids": sorted(bundles.values()),
            "sources_hash": manifest_hash,
            "sources": len(work.tokenize),
            "source_changes": changes.counts(),
            "input_bytes": str(input_bytes),
            "checksums_file": checksums_file,
            "sources_file": sources_file,
            "filtered": str(out.filtered),
            "filter_counts": dict(sorted(out.filter_counts.items())),
            "filtered_files": out.filtered_files,
            "pools": out.pools,
            **deduped.properties(),
            **(lineage or {}),
        },
        stats=out.stats,
        delete_sources=work.delete_sources,
    )
    return IngestResult(dataset, job_id, snap.snapshot_id, False, out.samples, out.tokens, out.quarantined,
                        dict(out.reasons), skipped, time.perf_counter() - started, input_bytes, changes.counts(),
                        int(snap.tokenloom.get("removed_samples", 0)), out.filtered, dict(sorted(out.filter_counts.items())),
                        deduped.duplicates, deduped.counts, out.pools)


def _tokenize(by_modality: dict[str, list[sources.SourceFile]], config: IngestConfig, bundle_paths: dict[str, str],
              vocab: VocabManifest, location: str, job_id: str, bundles: dict[str, str]) -> TaskOutput | None:
    """The Ray Data pipeline: each modality's files read and parsed, tokenized on its own pool
    (`platform/pools.py`), and written by one shard sink under `location`; returns what the
    write tasks wrote."""
    ensure_ray(config)
    have_gpus = ray.cluster_resources().get("GPU", 0) > 0
    # the run's in-flight journal (platform/guard.py): new per run, so a rerun never inherits a crash
    journal = Path(tempfile.mkdtemp(prefix=f"tokenloom-inflight-{job_id}-"))
    guard = {"journal": str(journal), "faults": asdict(config.faults)}
    try:
        out = _run_pools(by_modality, config, bundle_paths, vocab, location, job_id, bundles, have_gpus, guard)
        for marker in journal.glob("killed-*"):  # injected faults that fired (ingest.faults)
            out.pools[marker.name.removeprefix("killed-")]["injected_kills"] = 1
        return out
    finally:
        shutil.rmtree(journal, ignore_errors=True)


def _run_pools(by_modality: dict[str, list[sources.SourceFile]], config: IngestConfig, bundle_paths: dict[str, str],
               vocab: VocabManifest, location: str, job_id: str, bundles: dict[str, str], have_gpus: bool,
               guard: dict) -> TaskOutput:
    branches, modes = [], {}
    for modality, group in sorted(by_modality.items()):
        pool = config.pool(modality)
        # blocks of one pool batch each: a file can hold thousands of records, and a whole-file
        # block would pin one actor while the others idle
        records = _read_branch(group, config).repartition(target_num_rows_per_block=pool.batch_size)
        size = sum(f.size for f in group)
        service = config.pools_mode == "service"
        for stage in stages(modality):  # a video's frames on the video pool, then its sound on the audio pool
            stage_pool = config.pool(STAGE_POOL.get(stage, stage))
            worker_kwargs = pool_worker_kwargs(stage, bundle_paths, vocab, config)
            modes[stage] = pool_mode(stage_pool, size, service)
            records = pool_stage(records, stage, stage_pool, worker_kwargs, size, have_gpus, guard, service)
        branches.append(records)
    ds = branches[0].union(*branches[1:]) if len(branches) > 1 else branches[0]
    sink = ShardSink(location, job_id, vocab.id, vocab.size, sorted(bundles.values()), config.rows_per_file or None)
    try:
        ds.write_datasink(sink, ray_remote_args={"num_cpus": 0.5})
    except Exception as exc:  # a worker that cannot start fails every batch: say which pool and why
        started = re.search(r"PoolStartError: (.+)", str(exc))
        if started:
            raise ValueError(f"{started.group(1).strip()}; nothing committed") from None
        raise
    out = sink.result
    # what Ray Data measured of each pool's operator (the executed write plan's stats)
    written = getattr(ds, "_write_ds", None)
    pools = {stage: config.pool(STAGE_POOL.get(stage, stage)) for stage in modes}
    out.pools = pool_figures(written.get_stats_summary() if written is not None else None, pools, modes,
                             out.pool_records, out.pool_tokens, out.pool_nodes, out.pool_notes)
    return out


def pool_worker_kwargs(modality: str, bundle_paths: dict[str, str], vocab: VocabManifest, config: IngestConfig) -> dict:
    """What a `modality` pool worker (or stage: `workers.STAGES`) is built from: the bundles it
    needs, the manifest, the layout, filter and dedup settings (the same for a job's pool and a
    long-lived service)."""
    kwargs = {"bundle_paths": {k: str(bundle_paths[k]) for k in WORKERS[modality].needs},
              "vocab": vocab.to_dict(), "text_first": config.text_first,
              "quality": asdict(config.filters), "dedup": asdict(config.dedup)}
    if modality == "video":
        kwargs["video"] = asdict(config.video)
    return kwargs


def shutdown_ray() -> None:
    """Stop the local Ray runtime this process started (a job that trains next wants the cores)."""
    if ray.is_initialized():
        ray.shutdown()
