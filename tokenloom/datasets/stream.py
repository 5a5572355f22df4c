"""Token streams: a snapshot's shards read in a seeded order, split by rank, packed.

Order. For epoch e, the data files are permuted with a generator seeded by (seed, e); the
files are taken in windows of `shuffle_window` and the samples of each window are permuted
again. This fixes one global sample order per (snapshot, seed, epoch), whatever the number
of readers; rank r of W takes global samples r, r+W, r+2W, ...

Packing. A rank's samples are concatenated and cut into rows of `seq_len` inputs and
`seq_len` targets (the targets are the inputs shifted by one token, so a row reads
seq_len + 1 tokens and the next row starts at its last one). `doc_ids` mark which sample
each position came from; a target that crosses into another sample is ignored (-100), and
`position_ids` restart at each sample so attention and RoPE see documents apart.

State. `StreamState(epoch, cursor, offset)` is the position of the next row's first token:
the rank-local sample index inside the epoch and the token offset inside that sample. It is
three integers, so saving and resuming is exact and costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow.parquet as pq

from tokenloom.catalog.uris import filesystem_and_path

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardFile:
    path: str  # URI or local path of a Parquet data file
    num_rows: int


@dataclass
class StreamConfig:
    seq_len: int = 256
    seed: int = 0
    shuffle_window: int = 4  # files whose samples are shuffled together


@dataclass
class StreamState:
    epoch: int = 0
    cursor: int = 0  # rank-local sample index within the epoch
    offset: int = 0  # token offset within that sample

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> StreamState:
        return StreamState(int(d["epoch"]), int(d["cursor"]), int(d["offset"]))


def _read_tokens(path: str) -> list[np.ndarray]:
    filesystem, inner = filesystem_and_path(path)
    try:
        table = pq.read_table(inner, columns=["tokens"], filesystem=filesystem)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read token shard {path}: {exc}") from exc
    col = table.column("tokens").combine_chunks()
    offsets = col.offsets.to_numpy()
    flat = col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(col))]


class EpochOrder:
    """The global sample order of one epoch, as windows of (file, row) pairs."""

    def __init__(self, files: Sequence[ShardFile], seed: int, epoch: int, window: int):
        rng = np.random.default_rng([seed, epoch])
        self.files = [files[i] for i in rng.permutation(len(files))]
        self.windows: list[tuple[list[int], np.ndarray]] = []  # (file indices, row permutation)
        self.window_starts: list[int] = []
        start = 0
        for w0 in range(0, len(self.files), window):
            members = list(range(w0, min(w0 + window, len(self.files))))
            rows = sum(self.files[i].num_rows for i in members)
            self.windows.append((members, rng.permutation(rows)))
            self.window_starts.append(start)
            start += rows
        self.total = start


class TokenStream:
    """An endless iterator of packed rows for one data-parallel rank."""

    def __init__(self, files: Sequence[ShardFile], config: StreamConfig, rank: int = 0, world_size: int = 1,
                 state: StreamState | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        files = [f for f in files if f.num_rows > 0]
        if not files:
            raise ValueError("the snapshot has no samples to stream")
        if sum(f.num_rows for f in files) < world_size:
            raise ValueError(f"{sum(f.num_rows for f in files)} samples cannot feed {world_size} ranks")
        self.files, self.config, self.rank, self.world = list(files), config, rank, world_size
        self.state = state or StreamState()
        self._order: EpochOrder | None = None
        self._cache: dict[int, list[np.ndarray]] = {}  # window index -> samples in window order

    # -- sample access ------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order = EpochOrder(self.files, self.config.seed, epoch, self.config.shuffle_window)
            self._order_epoch = epoch
            self._cache.clear()
        return self._order

    def samples_per_epoch(self, epoch: int = 0) -> int:
        total = self._epoch_order(epoch).total
        return (total - self.rank + self.world - 1) // self.world

    def _sample(self, epoch: int, cursor: int) -> np.ndarray:
        order = self._epoch_order(epoch)
        global_index = cursor * self.world + self.rank
        w = int(np.searchsorted(order.window_starts, global_index, side="right") - 1)
        if w not in self._cache:
            self._cache.clear()  # one window in memory at a time
            members, perm = order.windows[w]
            samples = [s for i in members for s in _read_tokens(order.files[i].path)]
            self._cache[w] = [samples[j] for j in perm]
        return self._cache[w][global_index - order.window_starts[w]]

    # -- packing --------------------------------------------------------------------------
    def _take(self, n: int, advance: int) -> tuple[np.ndarray, np.ndarray, StreamState]:
        """Read n tokens from the current state; return them, their doc index within this read,
        and the state `advance` tokens on (where the next row begins)."""
        toks, docs, taken, doc = [], [], 0, 0
        epoch, cursor, offset = self.state.epoch, self.state.cursor, self.state.offset
        after: StreamState | None = None
        while taken < n:
            if cursor >= self.samples_per_epoch(epoch):
                epoch, cursor, offset = epoch + 1, 0, 0
                continue
            sample = self._sample(epoch, cursor)
            if after is None and taken + len(sample) - offset >= advance:
                at = offset + advance - taken
                after = StreamState(epoch, cursor, at) if at < len(sample) else StreamState(epoch, cursor + 1, 0)
            piece = sample[offset : offset + n - taken]
            toks.append(piece)
            docs.append(np.full(len(piece), doc, dtype=np.int32))
            taken += len(piece)
            offset += len(piece)
            if offset >= len(sample):
                cursor, offset, doc = cursor + 1, 0, doc + 1
        if after is None:  # cannot happen while advance <= n
            raise RuntimeError(f"stream advanced {advance} past a read of {n} tokens")
        return np.concatenate(toks), np.concatenate(docs), after

    def next_row(self) -> dict[str, np.ndarray]:
        L = self.config.seq_len
        tokens, docs, self.state = self._take(L + 1, advance=L)
        inputs, targets = tokens[:L], tokens[1:].astype(np.int64)
        targets[docs[1:] != docs[:L]] = IGNORE_INDEX
        doc_ids = docs[:L]
        starts = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
        positions = np.arange(L) - np.repeat(starts, np.diff(np.r_[starts, L]))
        return {
            "input_ids": inputs.astype(np.int64),
            "labels": targets,
            "doc_ids": doc_ids,
            "position_ids": positions.astype(np.int64),
        }

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield self.next_row()

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        while True:
            rows = [self.next_row() for _ in range(batch_size)]
            yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def state_dict(self) -> dict:
        return self.state.to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state = StreamState.from_dict(state)
