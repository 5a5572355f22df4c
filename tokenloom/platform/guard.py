"""Pool workers that lose no record when a process dies: an in-flight journal, and fault injection.

Why a journal. Ray restarts a killed actor and retries its task (Ray Data's actor pools; the
pools set the bounds explicitly, `PoolConfig.max_restarts`), so a worker lost to SIGKILL, OOM or
a node going away costs a retry, not the job, and the retried batch's rows reach the sink once:
a task's output is only taken when the task returns. But a record that *kills* the process
(a decoder that segfaults on one crafted file) would be retried until the retries run out and
the job dies with it. Exceptions are caught per record already (quarantine); a dead process
cannot catch anything, so the next attempt must know what the last one was doing:

- Before a batch, its worker writes a journal entry (a file named by the hash of the batch's
  sample ids, in a directory the driver makes for this run) and deletes it when the batch is done.
- An attempt that finds the entry knows a process died on this batch. It tokenizes the batch one
  record at a time, naming each record in the entry before starting it.
- An attempt that finds a record named there knows that record was being tokenized when the
  process died: it is quarantined with the reason, and the others are tokenized as before.

So each crash either switches a batch to record-at-a-time or quarantines one more record: the job
always ends, with every good record committed once (the journal is local to a node: a retry on
another node starts the batch afresh, which is slower, never wrong).

Fault injection (`ingest.faults`, for drills and tests): `kill_after_batches` makes the first
worker of a pool that finishes that many batches SIGKILL itself before returning the last one
(once per run: a marker file), and `crash_on` makes a worker SIGKILL itself when a record's text
contains that string, as a poisoned record would.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

CRASH_REASON = "the tokenizer worker's process died while tokenizing this record (a poisoned record)"


@dataclass
class FaultConfig:
    """`[ingest.faults]`: injected faults, off by default."""

    kill_after_batches: int = 0  # the first worker (per pool) to finish this many batches SIGKILLs itself
    crash_on: str = ""  # a worker SIGKILLs itself on a record whose text contains this string


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)  # atomic: a reader sees the old entry or the new one


class BatchGuard:
    """The journal and the injected faults of one pool worker (see the module docstring)."""

    def __init__(self, journal: str, pool: str, faults: dict | None = None):
        self.dir = Path(journal)
        self.pool = pool
        self.faults = FaultConfig(**(faults or {}))
        self.batches = 0

    def _die_if_poisoned(self, batch: pa.Table) -> None:
        poison = self.faults.crash_on
        errors = batch.column("error").to_pylist() if "error" in batch.column_names else [None] * batch.num_rows
        if poison and any(poison in (p or "") for p, e in zip(batch.column("payload").to_pylist(), errors,
                                                              strict=True) if e is None):
            os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_killed(self) -> None:
        self.batches += 1
        if self.faults.kill_after_batches and self.batches >= self.faults.kill_after_batches:
            try:  # once per run and pool: the first worker to get here
                os.close(os.open(self.dir / f"killed-{self.pool}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    def run(self, batch: pa.Table, tokenize: Callable[[pa.Table], pa.Table],
            quarantine: Callable[[pa.Table, str], pa.Table]) -> pa.Table:
        ids = batch.column("sample_id").to_pylist()
        # per pool: a video's records pass two pools, in batches that may hold the same ids
        entry = self.dir / f"{self.pool}-{hashlib.sha1(chr(0).join(map(str, ids)).encode()).hexdigest()}"
        state = json.loads(entry.read_text()) if entry.exists() else None
        if state is None:
            _write(entry, {"mode": "batch", "poisoned": []})
            self._die_if_poisoned(batch)
            out = tokenize(batch)
            self._maybe_killed()
            entry.unlink(missing_ok=True)
            return out
        # a process died on this batch before: one record at a time, each named first
        poisoned = set(state["poisoned"])
        if state["mode"] == "record":
            poisoned.add(state["current"])
        parts = []
        for i, sid in enumerate(ids):
            row = batch.slice(i, 1)
            if sid in poisoned:
                parts.append(quarantine(row, CRASH_REASON))
                continue
            _write(entry, {"mode": "record", "current": sid, "poisoned": sorted(poisoned)})
            self._die_if_poisoned(row)
            parts.append(tokenize(row))
        entry.unlink(missing_ok=True)
        return pa.concat_tables(parts) if parts else tokenize(batch.slice(0, 0))
