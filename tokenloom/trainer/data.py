"""A run's rows: the loader of the current stage, stage switches, follow-mode segments, targets per
source, rows.jsonl and the state a checkpoint saves.

The loop asks for one micro-batch at a time; this owns everything that decides which rows it is.
A stage (`train.stages`) gets its own `datasets.loader.Loader` (its row length, source weights and
a seed of its own) with the rows per micro-batch that keep positions per step constant, and the
model's RoPE base of that stage; segments still being read move to the new stage's loader. The
checkpoint state is every canonical reader's state (gathered from all ranks), the stage it belongs
to and the targets counted per source, so a resume at any step (a stage boundary included) and on
any number of ranks dividing the readers continues with the rows an uninterrupted run reads.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from tokenloom.contract import IGNORE_INDEX, PAD_MODALITY
from tokenloom.datasets import StreamConfig
from tokenloom.datasets.loader import Loader, LoaderState, Source
from tokenloom.trainer.config import TrainConfig


class RunData:
    def __init__(self, sources: list[Source], stream_cfg: StreamConfig, train_cfg: TrainConfig, model_cfg,
                 rank: int, world: int, start_step: int, client: dict | None, run_dir: Path):
        """`model_cfg`: the live model's config (a stage sets its `rope_theta`); `client`: the resumed
        checkpoint's client state, or None for a new run."""
        self.sources, self.stream_cfg, self.train_cfg, self.model_cfg = sources, stream_cfg, train_cfg, model_cfg
        self.rank, self.world, self.base_theta = rank, world, model_cfg.rope_theta
        self.stage = train_cfg.stage_at(start_step)
        state = LoaderState.from_dict(client["data"]) if client else None
        saved_stage = int(client.get("stage", 0)) if client else self.stage
        if state is not None and saved_stage != self.stage:  # saved at a stage boundary: carry its segments over
            old, _ = self._stage_loader(saved_stage, state)
            self.loader, self.rows = self._stage_loader(self.stage, None)
            self.loader.take_segments(old)
        else:
            self.loader, self.rows = self._stage_loader(self.stage, state)
        self.batches = self.loader.batches(self.rows)
        resumed = client.get("tokens_by_source", {}) if client else {}
        self.tokens_by_source = {s.name: int(resumed.get(s.name, 0)) for s in sources}
        self.index = {s.name: i for i, s in enumerate(sources)}
        self.segments = [s.to_dict() | {"files": len(s.files), "deleted": len(s.deleted)} for s in self.loader.segments]
        self.seen = {s.name: s.snapshot_id for s in sources}  # the newest snapshot streamed per source
        self.seen.update({s.source: s.snapshot_id for s in self.loader.segments})
        self.rows_log = None
        if train_cfg.log_rows and rank == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)  # (a new run's rows are made before its metrics)
            self.rows_log = (Path(run_dir) / "rows.jsonl").open("a" if client else "w")

    def _stage_loader(self, stage: int, state: LoaderState | None) -> tuple[Loader, int]:
        """The loader of `stage` (its seq_len, weights and seed) and its rows per micro-batch."""
        train_cfg, stream_cfg, sources = self.train_cfg, self.stream_cfg, self.sources
        st = train_cfg.stages[stage] if train_cfg.stages else None
        cfg, srcs, rows = stream_cfg, sources, train_cfg.micro_batch_size
        if st is not None:
            positions = train_cfg.micro_batch_size * stream_cfg.seq_len
            if positions % st.seq_len:
                raise ValueError(f"train.stages[{stage}].seq_len {st.seq_len} does not divide the positions per "
                                 f"micro-batch ({train_cfg.micro_batch_size} x stream.seq_len {stream_cfg.seq_len})")
            unknown = sorted(set(st.weights) - {s.name for s in sources})
            if unknown:
                raise ValueError(f"train.stages[{stage}].weights names {unknown}, not sources of this run "
                                 f"({[s.name for s in sources]})")
            cfg, rows = replace(stream_cfg, seq_len=st.seq_len), positions // st.seq_len
            srcs = [replace(s, weight=st.weights.get(s.name, s.weight)) for s in sources]
            self.model_cfg.rope_theta = st.rope_theta or self.base_theta
        return Loader(srcs, cfg, stream_cfg.readers, self.rank, self.world, stage, state), rows

    def at_step(self, step: int) -> dict | None:
        """Switch to the next stage when `step` starts it; returns the metrics record of the switch."""
        bounds = self.train_cfg.stage_bounds()
        if self.stage + 1 >= len(bounds) or step < bounds[self.stage + 1][0]:
            return None
        self.stage += 1  # its own loader, seq_len and rows per micro-batch; unread segments go along
        old = self.loader
        self.loader, self.rows = self._stage_loader(self.stage, None)
        self.loader.take_segments(old)
        self.batches = self.loader.batches(self.rows)
        return {"step": step, "stage": self.stage, "seq_len": self.loader.config.seq_len,
                "rows_per_micro_batch": self.rows}

    def follow(self, step: int, snapshots: list) -> list[dict]:
        """Read each (source, snapshot id, files of its new rows, sample ids it deleted) once, from
        the next row on, and stop reading what it deleted (every rank calls this with the same
        list); returns a record per segment that adds or deletes samples."""
        docs = []
        for source, snapshot_id, files, *deleted in snapshots:
            self.seen[source] = snapshot_id
            added = self.loader.follow(source, snapshot_id, files, deleted[0] if deleted else ())
            if added is not None:
                docs.append({"source": added.source, "snapshot_id": added.snapshot_id, "files": len(added.files),
                             "samples": sum(f.num_rows for f in added.files), "deleted": len(added.deleted),
                             "from_row": added.from_row, "step": step})
        self.segments += docs
        return docs

    def next_batch(self, step: int, counts: torch.Tensor) -> dict[str, np.ndarray]:
        """The next micro-batch's row keys and `fill_ratio`; adds each source's targets to `counts`
        and, with `train.log_rows`, writes the rows to rows.jsonl (a collective: every rank calls it)."""
        raw = next(self.batches)
        sources, rows, segments = raw.pop("source"), raw.pop("row"), raw.pop("segment")
        targets = (raw["labels"] != IGNORE_INDEX).sum(axis=(1, 2))
        for name, n in zip(sources, targets, strict=True):
            counts[self.index[name]] += int(n)
        if self.train_cfg.log_rows:
            self._log_rows(step, raw, sources, rows, segments)
        return raw

    def add_counts(self, counts: torch.Tensor) -> None:
        """Targets per source of a step, summed over every rank."""
        for name, i in self.index.items():
            self.tokens_by_source[name] += int(counts[i])

    def _log_rows(self, step: int, raw: dict, sources: list[str], rows: np.ndarray, segments: np.ndarray) -> None:
        """Every rank's rows of this micro-batch (global index, source, followed snapshot or -1,
        non-padding positions, CRC-32 of the row's ids and labels), written by rank 0."""
        mine = [{"row": int(g), "source": src, "segment": int(seg),
                 "positions": int((raw["modality"][i] != PAD_MODALITY).sum()),
                 "crc": zlib.crc32(raw["ids"][i].tobytes() + raw["labels"][i].tobytes())}
                for i, (g, src, seg) in enumerate(zip(rows, sources, segments, strict=True))]
        if self.world > 1:
            gathered: list[list | None] = [None] * self.world
            torch.distributed.all_gather_object(gathered, mine)
            mine = [r for part in gathered for r in part]
        if self.rows_log is not None:
            for r in sorted(mine, key=lambda r: r["row"]):
                self.rows_log.write(json.dumps({"step": step, **r}) + "\n")
            self.rows_log.flush()

    def checkpoint_state(self) -> dict:
        """What a checkpoint's client state holds of the data: every canonical reader's state (each
        rank holds its own readers'), the stage, the targets per source."""
        state = self.loader.state()
        if self.world > 1:
            gathered: list[LoaderState | None] = [None] * self.world
            torch.distributed.all_gather_object(gathered, state)
            state = Loader.merge(gathered)
        return {"data": state.to_dict(), "stage": self.stage, "tokens_by_source": dict(self.tokens_by_source)}

    def close(self) -> None:
        if self.rows_log is not None:
            self.rows_log.close()
