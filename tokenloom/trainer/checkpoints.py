"""Checkpoints that survive a crash: written whole or not at all, and found by their manifest.

A run keeps its checkpoints in one DeepSpeed save folder, `<run>/checkpoint/`, one tag folder per
checkpoint (`step-000120/`). Every rank writes its DeepSpeed shards into `.tmp-step-000120/`;
after a barrier rank 0 writes `checkpoint.json` into it last (step, dataset snapshot, vocabulary
manifest, tokenizer bundles, the run's model/stream/train config, code version) and renames the
folder into place. So a `step-*` folder with a manifest is complete, and a crash at any moment
leaves at worst a `.tmp-*` folder that nothing reads and the next save deletes. DeepSpeed's own
`latest` file is rewritten after the rename, so `engine.load_checkpoint(folder)` also finds the
newest complete one. Checkpoints beyond `train.keep_last` are deleted only after a newer one is
in place. Only the model/stream/train sections go into the manifest: the catalog section can
hold a database URI with credentials.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

ROOT = "checkpoint"  # the save folder inside a run folder
MANIFEST = "checkpoint.json"
TMP_PREFIX = ".tmp-"
_TAG = re.compile(r"step-(\d{6,})")


def tag(step: int) -> str:
    return f"step-{step:06d}"


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under a save folder, oldest first (a `step-*` folder with a manifest)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _TAG.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=step_of)


def latest_complete(root: Path) -> Path | None:
    done = complete(root)
    return done[-1] if done else None


def find_checkpoint(path: Path) -> Path:
    """The checkpoint to resume from, given one checkpoint folder, a save folder or a run folder: the
    newest complete checkpoint there. A save folder written before manifests existed (DeepSpeed's
    `latest` file and a `global_step*` folder) resolves to the tag its `latest` file names."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for root in (path, path / ROOT):
        found = latest_complete(root)
        if found is not None:
            return found
        legacy = root / "latest"
        if legacy.is_file() and not complete(root):
            named = root / legacy.read_text().strip()
            if named.is_dir() and not named.name.startswith(TMP_PREFIX):
                return named
    raise FileNotFoundError(f"{path} holds no complete checkpoint (a checkpoint folder has {MANIFEST}; "
                            f"half-written {TMP_PREFIX}* folders are never resumed)")


def read_manifest(checkpoint: Path) -> dict | None:
    path = Path(checkpoint) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with part.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk: the manifest must not reach the disk before
    the shards it vouches for (a power cut, unlike a kill, loses what only the page cache held)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(engine, root: Path, step: int, client_state: dict, manifest: dict, keep_last: int, rank: int,
         world: int) -> Path:
    """Write the checkpoint of `step` atomically (every rank calls this); returns its folder."""
    root = Path(root)
    name = tag(step)
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # an attempt at this step that crashed mid-write
            shutil.rmtree(tmp)
    _barrier(world)
    engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)  # ends in a barrier
    if rank == 0:
        for shard in tmp.rglob("*"):
            if shard.is_file():
                _fsync(shard)
        _write_atomic(tmp / MANIFEST, json.dumps({"step": step, "tag": name, "world_size": world,
                                                  "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                  **manifest}, indent=2))
        if final.exists():  # this step again, after resuming from an older checkpoint: the new one wins
            stale = root / f"{TMP_PREFIX}{name}.replaced"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(tmp, final)
        _fsync(root)
        _write_atomic(root / "latest", name)
        prune(root, keep_last, step)
    _barrier(world)
    return final


def step_of(checkpoint: Path) -> int:
    return int(_TAG.fullmatch(Path(checkpoint).name).group(1))


def prune(root: Path, keep_last: int, current: int | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (0: keep all) and leftover
    half-written folders; returns what was deleted. Called right after the checkpoint of step
    `current` completed: any at a later step belongs to a line of training abandoned when this one
    resumed from an earlier checkpoint (or started afresh in the same run folder), and goes too."""
    done = complete(root)
    later = [p for p in done if current is not None and step_of(p) > current]
    done = [p for p in done if p not in later]
    doomed = later + (done[:-keep_last] if keep_last else [])
    doomed += [p for p in Path(root).iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class Schedule:
    """When to checkpoint: every `every` steps and/or after `minutes` without a checkpoint. Rank 0's
    clock decides, so that every rank saves at the same step."""

    def __init__(self, every: int, minutes: float, world: int, device: torch.device | str = "cpu"):
        self.every, self.seconds, self.world, self.device = every, minutes * 60, world, device
        self.last = time.monotonic()

    def due(self, done: int) -> bool:
        """Whether to save after `done` steps of the run (global steps, counted from 0)."""
        if self.every and done % self.every == 0:
            return True
        if not self.seconds:
            return False
        late = torch.tensor([float(time.monotonic() - self.last >= self.seconds)], device=self.device)
        if self.world > 1:
            torch.distributed.broadcast(late, src=0)
        return bool(late.item())

    def saved(self) -> None:
        self.last = time.monotonic()


UNIVERSAL = "universal"  # inside a checkpoint: its ZeRO shards converted for another number of ranks


def universal(checkpoint: Path, rank: int, world: int) -> Path:
    """The checkpoint as DeepSpeed's universal checkpoint (`<checkpoint>/universal/`), which loads
    on any number of data-parallel ranks: ZeRO's optimizer shards are partitioned per rank, so a
    run saved on W ranks resumes on W' != W through this form. Rank 0 converts once (DeepSpeed's
    `ds_to_universal`) into a temporary folder renamed into place; the others wait."""
    import argparse

    checkpoint = Path(checkpoint)
    out = checkpoint / UNIVERSAL
    if rank == 0 and not out.is_dir():
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        part = checkpoint / f"{TMP_PREFIX}{UNIVERSAL}"
        shutil.rmtree(part, ignore_errors=True)
        to_universal(argparse.Namespace(input_folder=str(checkpoint), output_folder=str(part), num_extract_workers=1,
                                        num_merge_workers=1, keep_temp_folder=False, strict=True,
                                        inject_missing_state=True))  # no tensor-parallel slices: the default info
        os.replace(part, out)
    _barrier(world)
    return out
