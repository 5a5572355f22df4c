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

import pyarrow as pa
import ray

from tokenloom.platform.config import PoolConfig
from tokenloom.platform.workers import WORKERS

_CACHED: dict[str, object] = {}  # per worker process: the key of the tokenizer built last -> worker


def tokenize_batch(batch: pa.Table, modality: str, worker_kwargs: dict) -> pa.Table:
    """One batch through `modality`'s pool worker, built once per process and configuration."""
    key = modality + "\0" + json.dumps(worker_kwargs, sort_keys=True, default=str)
    worker = _CACHED.get(key)
    if worker is None:
        _CACHED.clear()  # one tokenizer per process: a worker serves many jobs, not many bundles
        worker = _CACHED[key] = WORKERS[modality](**worker_kwargs)
    return worker(batch)


def pool_stage(records: ray.data.Dataset, modality: str, pool: PoolConfig, worker_kwargs: dict,
               input_bytes: int, have_gpus: bool) -> ray.data.Dataset:
    """`records` tokenized on `modality`'s pool: an actor pool, or tasks for a small job."""
    resources = {pool.resource_label: 1} if pool.resource_label else None
    # GPUs per actor where the cluster has them; elsewhere the pool runs on CPUs under its own label
    num_gpus = (pool.num_gpus if have_gpus else 0) or None
    common = {"batch_format": "pyarrow", "batch_size": pool.batch_size, "num_cpus": pool.num_cpus,
              "num_gpus": num_gpus, "resources": resources}
    if input_bytes < pool.task_below_bytes:
        return records.map_batches(tokenize_batch, fn_kwargs={"modality": modality, "worker_kwargs": worker_kwargs},
                                   **common)
    return records.map_batches(
        WORKERS[modality], fn_constructor_kwargs=worker_kwargs,
        compute=ray.data.ActorPoolStrategy(min_size=pool.min_actors, max_size=pool.max_actors), **common)
