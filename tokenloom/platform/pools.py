"""Tokenizer pool stages: how a modality's records reach its tokenizer in a Ray Data job.

A large job runs each modality on its own autoscaling actor pool (`ActorPoolStrategy`): every
actor loads the tokenizer bundle once and keeps it for the job. But an actor is a process of
its own, started per job: on a small machine that is seconds per actor, which dwarfs a job of one
new file (incremental ingestion makes such jobs the common case). Below `task_below_bytes` of
input a pool runs as Ray tasks instead, with the same resources and label, on Ray's reusable
worker processes, and each process keeps the last tokenizer it built (`tokenize_batch`), so a
warm cluster tokenizes a small job without starting anything. The records and the rows they
become are the same either way (tests hold the two paths to the same shards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from tokenloom.platform.config import PoolConfig
from tokenloom.platform.guard import BatchGuard
from tokenloom.platform.workers import WORKERS

_CACHED: dict[str, tuple[str, object]] = {}  # per worker process and modality (or stage): (key, worker) built last


def worker_for(modality: str, worker_kwargs: dict):
    """This process's `modality` pool worker for these arguments, built on first use and kept (one
    per modality or stage: a process serves many jobs, and a video's two stages, not many bundles)."""
    key = json.dumps(worker_kwargs, sort_keys=True, default=str)
    cached = _CACHED.get(modality)
    if cached is None or cached[0] != key:
        cached = _CACHED[modality] = (key, WORKERS[modality](**worker_kwargs))
    return cached[1]


def tokenize_batch(batch: pa.Table, modality: str, worker_kwargs: dict, guard: dict | None = None) -> pa.Table:
    """One batch through `modality`'s pool worker, built once per process and configuration (the
    run's journal, `guard`, is not part of the key: it is set per call)."""
    worker = worker_for(modality, worker_kwargs)
    if guard is None:
        worker.guard = None
    elif worker.guard is None or worker.guard.dir != Path(guard["journal"]):
        worker.guard = BatchGuard(**guard, pool=modality)
    return worker(batch)


def _task_function(modality: str):
    """`tokenize_batch` for one modality, under a name of its own (`TokenizeText`, ...): Ray Data
    names an operator after its function, and the per-pool figures find each pool by that name."""
    def fn(batch: pa.Table, worker_kwargs: dict, guard: dict | None = None) -> pa.Table:
        return tokenize_batch(batch, modality, worker_kwargs, guard)

    fn.__name__ = fn.__qualname__ = f"Tokenize{modality.title()}"
    return fn


def _service_function(modality: str):
    """A batch through `modality`'s long-lived service (platform/services.py), by its Serve handle."""
    def fn(batch: pa.Table, worker_kwargs: dict) -> pa.Table:
        from ray import serve

        from tokenloom.platform.services import APP

        return serve.get_deployment_handle(modality, app_name=APP).tokenize.remote(batch, worker_kwargs).result()

    fn.__name__ = fn.__qualname__ = f"Service{modality.title()}"
    return fn


def operator_names(modality: str) -> tuple[str, str, str]:
    """The names Ray Data gives `modality`'s pool operator: as tasks, as an actor pool, as calls to
    its service."""
    return f"Tokenize{modality.title()}", WORKERS[modality].__name__, f"Service{modality.title()}"


def pool_figures(summary: Any, pools: dict[str, PoolConfig], modes: dict[str, str], records: dict[str, int],
                 tokens: dict[str, int], nodes: dict[tuple[str, str], int] | None = None,
                 notes: dict[tuple[str, str], int] | None = None) -> dict[str, dict]:
    """Per pool, what Ray Data measured of its operator (`Dataset.get_stats_summary()` of the job's
    write): records out, the operator's wall time from its first task's start to its last one's end,
    and the summed wall time of its tasks (busy seconds), beside the tokens the sink counted from
    the pool's rows. `busy_fraction` is busy seconds over (wall time x the pool's max actors): how
    much of the pool's capacity the job used while the pool ran. `nodes`: records per Ray node id,
    where the pool's workers ran (placement by its resource label); `notes`: kept samples per note
    (what a pool dropped from them, e.g. a video's broken sound track)."""
    ops: list[Any] = []

    def walk(s: Any) -> None:
        for parent in getattr(s, "parents", None) or []:
            walk(parent)
        ops.extend(getattr(s, "operators_stats", None) or [])

    if summary is not None:
        walk(summary)
    out: dict[str, dict] = {}
    for modality, mode in sorted(modes.items()):
        names = operator_names(modality)
        mine = [o for o in ops if any(f"({n})" in o.operator_name for n in names)]
        seconds = sum(o.time_total_s or 0.0 for o in mine)
        busy = sum(o.wall_time.sum for o in mine if o.wall_time is not None)
        rows = sum(int(o.output_num_rows.sum) for o in mine if o.output_num_rows is not None)
        pool = pools[modality]
        out[modality] = {
            "mode": mode, "min_actors": pool.min_actors, "max_actors": pool.max_actors,
            "records": rows, "tokens": int(tokens.get(modality, 0)), "seconds": round(seconds, 3),
            "busy_seconds": round(busy, 3),
            "records_per_second": round(rows / seconds, 1) if seconds else None,
            "tokens_per_second": round(tokens.get(modality, 0) / seconds, 1) if seconds else None,
            # (a service's replicas are shared and measured by Serve, not by this job's operator)
            "busy_fraction": round(busy / (seconds * pool.max_actors), 3) if seconds and mode != "service" else None,
            "records_at_sink": int(records.get(modality, 0)),
            "nodes": {node: n for (m, node), n in sorted((nodes or {}).items(), key=str) if m == modality},
        }
        mine_notes = {note: n for (m, note), n in sorted((notes or {}).items()) if m == modality}
        if mine_notes:
            out[modality]["notes"] = mine_notes
    return out


def pool_mode(pool: PoolConfig, input_bytes: int, service: bool = False) -> str:
    if service:
        return "service"
    return "tasks" if input_bytes < pool.task_below_bytes else "actors"


def pool_stage(records: ray.data.Dataset, modality: str, pool: PoolConfig, worker_kwargs: dict,
               input_bytes: int, have_gpus: bool, guard: dict | None = None, service: bool = False) -> ray.data.Dataset:
    """`records` tokenized on `modality`'s pool: an actor pool, or tasks for a small job; `guard`:
    the run's in-flight journal and injected faults (platform/guard.py)."""
    resources = {pool.resource_label: 1} if pool.resource_label else None
    # GPUs per actor where the cluster has them; elsewhere the pool runs on CPUs under its own label
    num_gpus = (pool.num_gpus if have_gpus else 0) or None
    common = {"batch_format": "pyarrow", "batch_size": pool.batch_size, "num_cpus": pool.num_cpus,
              "num_gpus": num_gpus, "resources": resources}
    # a worker process that dies (killed, out of memory, a poisoned record) is replaced and its batch
    # retried, a bounded number of times; Python exceptions are bugs, not retried (records that
    # raise are quarantined by the workers themselves)
    if service:  # the replicas do the work; the calling tasks only wait on them
        return records.map_batches(_service_function(modality), fn_kwargs={"worker_kwargs": worker_kwargs},
                                   batch_format="pyarrow", batch_size=pool.batch_size, num_cpus=0.25,
                                   max_retries=pool.max_restarts)
    if pool_mode(pool, input_bytes) == "tasks":
        # at most max_actors tasks at once, as the actor pool would: pools that share a label (image
        # and video both run on the visual nodes) must not take each other's share of it
        return records.map_batches(_task_function(modality), fn_kwargs={"worker_kwargs": worker_kwargs, "guard": guard},
                                   compute=ray.data.TaskPoolStrategy(size=pool.max_actors),
                                   max_retries=pool.max_restarts, retry_exceptions=False, **common)
    return records.map_batches(
        WORKERS[modality], fn_constructor_kwargs={**worker_kwargs, "guard": guard},
        compute=ray.data.ActorPoolStrategy(min_size=pool.min_actors, max_size=pool.max_actors),
        max_restarts=pool.max_restarts, max_task_retries=pool.max_restarts, **common)
