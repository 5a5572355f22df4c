"""Packing that keeps media whole: fill ratio (old chunk packer vs best-fit) and stream tokens/s.

The data is demo-like: a third of the samples images (h, w in 4..14 codes, so each fits a
256-position row with its start row), a fifth audio clips (25..200 frames of 2 codes, with a
transcript), the rest text documents (log-normal lengths, median ~150 tokens, some longer than a
row), laid out by `tokenizers.sequence` with a real vocabulary manifest, in Parquet shards of
the shard contract's columns. The old packer is the stream module at git HEAD (concatenate and
chunk), loaded from `git show`, when it is still there.

Peers in the same run: fill ratio against the old packer and against 1.0 (the physical limit);
tokens/s against a raw pyarrow read of the same files (the `tokens` and `segments` columns,
tokens flattened to numpy), which is what any reader must do before packing. The stream is
timed as a trainer consumes it (each batch dropped when the next comes) over one epoch from a
cold start, over `--epochs` epochs that decode every file again (a long run: the read-ahead
thread overlaps every window's read but the first), with `stream.read_ahead` off, keeping every
batch (fresh memory for each), and as the trainer reads it (`datasets.loader.Loader`, 4 canonical
readers: one epoch from a cold start, and `--epochs` epochs). Its own reading (Parquet to segment
tables, `read_layout`) is timed alone beside it, and its decode of the shards (pre-buffering off
for local files) against pyarrow's default pre-buffered read. Each line runs `--pairs` times, each
run beside a run of the raw read (this shared machine's speed drifts up to 2x within minutes, and
each side's best of a few runs could come from different moments): the figure is the median of the
pairs' ratios, with their range. The compiled loops (`datasets/compiled.py`) are loaded once before any
timing (numba's cache; a one-off per process).

    .venv/bin/python bench/bench_packing.py [--samples 4000] [--rows 1600] [--epochs 3] [--pairs 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.contract import PAD_MODALITY, ROW_KEYS
from tokenloom.datasets import ShardFile, StreamConfig, TokenStream
from tokenloom.datasets import stream as stream_module
from tokenloom.datasets.loader import Loader, Source
from tokenloom.datasets.stream import ROW_ID, EpochOrder, forget_read_tables, read_layout, sample_positions
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart
from tokenloom.tokenizers.vocab import VocabManifest

SEQ_LEN, GROUP, AUDIO_WINDOW = 256, 2, 64


def demo_like_shards(folder: Path, samples: int, files: int, seed: int = 0) -> list[ShardFile]:
    manifest = VocabManifest.build(2048, visual_size=1024, audio_levels=GROUP, audio_codebook=256)
    layout, rng = SampleLayout(manifest), np.random.default_rng(seed)
    out = []
    for f in range(files):
        rows = []
        for _ in range(samples // files):
            u = rng.random()
            caption = TextPart(rng.integers(0, manifest.text.size, int(rng.integers(5, 40))))
            if u < 1 / 3:
                h, w = (int(x) for x in rng.integers(4, 15, 2))
                rows.append(layout.assemble([ImagePart(rng.integers(0, 1024, (h, w))), caption]))
            elif u < 1 / 3 + 1 / 5:
                rows.append(layout.assemble([AudioPart(rng.integers(0, 256, (int(rng.integers(25, 201)), GROUP))),
                                             caption]))
            else:
                n = int(np.clip(rng.lognormal(np.log(150), 0.9), 4, 2000))
                rows.append(layout.assemble([TextPart(rng.integers(0, manifest.text.size, n))]))
        path = folder / f"shard{f}.parquet"
        pq.write_table(pa.table({"tokens": pa.array([t.tolist() for t, _ in rows], pa.list_(pa.int32())),
                                 "segments": pa.array([s for _, s in rows], pa.list_(SEGMENT_TYPE))}), path)
        out.append(ShardFile(str(path), len(rows)))
    return out


def old_stream_module():
    """tokenloom/datasets/stream.py at git HEAD (the concatenate-and-chunk packer), or None."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", "HEAD:tokenloom/datasets/stream.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    if "StreamState(epoch, cursor, offset)" not in source:
        return None  # HEAD already has the best-fit packer
    path = Path(tempfile.mkdtemp()) / "old_stream.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_stream", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_stream"] = module
    spec.loader.exec_module(module)
    return module


def real_tokens(row: dict) -> int:
    """Codes of the samples in a row: id slots in use at non-padding positions, less the start rows."""
    keep = (row["modality"] != PAD_MODALITY) & (row["ids"][:, 0] != ROW_ID)
    return int((row["ids"][keep] >= 0).sum())


def fill(rows: list[dict]) -> float:
    return float(np.mean([(r["modality"] != PAD_MODALITY).mean() for r in rows]))


def old_packer(module, files, rows: int) -> tuple[float, int, float]:
    """The old packer's fill ratio, how many media segments it cut across rows, and its tokens/s."""
    t0 = time.perf_counter()
    cfg = module.StreamConfig(seq_len=SEQ_LEN, group_size=GROUP, audio_window=AUDIO_WINDOW)
    stream = module.TokenStream([module.ShardFile(f.path, f.num_rows) for f in files], cfg)
    out, cut, seconds = [], 0, 0.0
    for _ in range(rows):
        out.append(stream.next_row())
        seconds = time.perf_counter() - t0
        st = stream.state
        if st.offset:
            tokens, segments = stream._raw(st.epoch, st.cursor)[0]
            media = sample_positions(tokens, segments, GROUP, AUDIO_WINDOW).media
            cut += any(a < st.offset < b for a, b in media)
        t0 = time.perf_counter() - seconds  # the cut count is not the packer's time
    return fill(out), cut, sum(real_tokens(r) for r in out) / seconds


def stream_rate(files, cfg: StreamConfig, rows: int, keep: bool = False) -> tuple[float, float, int]:
    """(fill ratio, tokens/s, skipped) of `rows` rows of a fresh stream in batches of 8, reading
    included (no shard kept from an earlier read). The batches are consumed as a trainer consumes
    them, each dropped when the next comes; `keep` holds them all instead (a consumer collecting
    the epoch: fresh memory for every batch). The tokens are counted in a separate untimed run of
    the same stream (its rows are the same), so that no pause in the timed run gives the
    read-ahead thread free time."""
    fills, tokens = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = TokenStream(files, cfg).batches(8)
        for _ in range(rows // 8):
            batch = next(batches)
            fills.append(batch["fill_ratio"].mean())
            tokens += sum(real_tokens({k: v[b] for k, v in batch.items()}) for b in range(8))
        forget_read_tables()
        kept = []
        t0 = time.perf_counter()
        stream = TokenStream(files, cfg)
        batches = stream.batches(8)
        for _ in range(rows // 8):
            batch = next(batches)
            if keep:
                kept.append(batch)
        seconds = time.perf_counter() - t0
    return float(np.mean(fills)), tokens / seconds, stream.state.skipped


def loader_rate(files, cfg: StreamConfig, rows: int) -> float:
    """tokens/s of the trainer's path over `rows` rows from a cold start: `Loader` with 4 canonical
    readers (one source), batches of 8, each dropped when the next comes; tokens counted in a
    separate untimed run (its rows are the same)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = Loader([Source("bench", tuple(files))], cfg, readers=4).batches(8)
        tokens = 0
        for _ in range(rows // 8):
            batch = next(batches)
            tokens += sum(real_tokens({k: v[b] for k, v in batch.items() if k in ROW_KEYS}) for b in range(8))
        forget_read_tables()
        t0 = time.perf_counter()
        batches = Loader([Source("bench", tuple(files))], cfg, readers=4).batches(8)
        for _ in range(rows // 8):
            next(batches)
        return tokens / (time.perf_counter() - t0)


def steady_rate(files, cfg: StreamConfig, epoch_rows: int, epochs: int) -> float:
    """tokens/s of `epochs` epochs of one stream, with the shard and layout caches cut to one entry
    so that every epoch decodes its files again, as a long run over a large dataset does: the first
    window's read (nothing to overlap it with) weighs 1/epochs as much as in one epoch."""
    caches = (stream_module._RECENT, stream_module._LAYOUTS)  # decoded shards, laid-out windows
    budgets = [c.budget for c in caches]
    for c in caches:
        c.budget = 0  # keeps the last one only
    try:
        return stream_rate(files, cfg, epoch_rows * epochs)[1]
    finally:
        for c, b in zip(caches, budgets, strict=True):
            c.budget = b


def loader_steady_rate(files, cfg: StreamConfig, epoch_rows: int, epochs: int) -> float:
    """`steady_rate` for the trainer's path (`loader_rate`)."""
    caches = (stream_module._RECENT, stream_module._LAYOUTS)
    budgets = [c.budget for c in caches]
    for c in caches:
        c.budget = 0
    try:
        return loader_rate(files, cfg, epoch_rows * epochs)
    finally:
        for c, b in zip(caches, budgets, strict=True):
            c.budget = b


def read_layout_rate(files, cfg: StreamConfig) -> float:
    """tokens/s of the stream's reading alone: each window of files to its layout (segment tables)."""
    order = EpochOrder(files, cfg.seed, 0, cfg.shuffle_window)
    forget_read_tables()
    t0, tokens = time.perf_counter(), 0
    for members, _ in order.windows:
        layout = read_layout([order.files[i].path for i in members], GROUP, AUDIO_WINDOW)
        tokens += len(layout.tokens)
    return tokens / (time.perf_counter() - t0)


def raw_pyarrow_rate(files) -> float:
    t0 = time.perf_counter()
    tokens = 0
    for f in files:
        table = pq.read_table(f.path, columns=["tokens", "segments"])
        flat = table.column("tokens").combine_chunks().values.to_numpy(zero_copy_only=False)
        table.column("segments").to_pylist()
        tokens += len(flat)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1600)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the long-run line")
    parser.add_argument("--pairs", type=int, default=7, help="runs of each line, each beside a run of its peer")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = demo_like_shards(Path(tmp), args.samples, args.files)
        flat_tokens = sum(pq.read_metadata(f.path).num_rows for f in files)
        print(f"{flat_tokens} samples in {len(files)} shards, seq_len {SEQ_LEN}, rows {args.rows}")
        stream_rate(files, StreamConfig(seq_len=SEQ_LEN, group_size=GROUP, audio_window=AUDIO_WINDOW), 8)  # warm
        old = old_stream_module()
        if old is not None:
            old_fill, old_cut, old_rate = old_packer(old, files, args.rows)
            print(f"old chunk packer   fill {old_fill:.4f}  media segments cut across rows: {old_cut}  "
                  f"{old_rate / 1e3:.1f} k tokens/s")
        else:
            old_fill = old_rate = None
            print("old chunk packer   not reachable at git HEAD")
        for window in (1, 16, 64, 128, 256):
            cfg = StreamConfig(seq_len=SEQ_LEN, group_size=GROUP, audio_window=AUDIO_WINDOW, pack_window=window)
            f, rate, skipped = stream_rate(files, cfg, args.rows)
            ratio = f"  vs old {f / old_fill:.3f}x fill, {rate / old_rate:.3f}x tokens/s" if old_fill else ""
            print(f"best-fit window {window:3d}  fill {f:.4f} (target >= 0.95: {f / 0.95:.3f}x){ratio}  "
                  f"skipped {skipped}  {rate / 1e3:.1f} k tokens/s")
        # tokens/s: the whole epoch through the stream (window 128) vs a raw pyarrow read of the same files
        cfg = StreamConfig(seq_len=SEQ_LEN, group_size=GROUP, audio_window=AUDIO_WINDOW)
        raw_pyarrow_rate(files)  # warm
        epoch_rows = int(sum(len(sample_positions(*s, GROUP, AUDIO_WINDOW)) for s in _samples(files)) / SEQ_LEN)
        for label, run in (
                ("one epoch, cold (the first window's read has nothing to overlap)",
                 lambda: stream_rate(files, cfg, epoch_rows)[1]),
                (f"{args.epochs} epochs, every file decoded again each epoch",
                 lambda: steady_rate(files, cfg, epoch_rows, args.epochs)),
                ("one epoch, stream.read_ahead off",
                 lambda: stream_rate(files, replace(cfg, read_ahead=False), epoch_rows)[1]),
                ("one epoch, every batch kept (fresh memory for each)",
                 lambda: stream_rate(files, cfg, epoch_rows, keep=True)[1]),
                ("the trainer's path: Loader, 4 canonical readers, one epoch, cold",
                 lambda: loader_rate(files, cfg, epoch_rows)),
                (f"the trainer's path, {args.epochs} epochs, every file decoded again each epoch",
                 lambda: loader_steady_rate(files, cfg, epoch_rows, args.epochs))):
            rates, raws = paired(run, lambda: raw_pyarrow_rate(files), args.pairs)
            print(f"stream {np.median(rates) / 1e6:.3f} M tokens/s = {paired_ratio(rates, raws)} the raw read "
                  f"({np.median(raws) / 1e6:.3f} M, target >= 0.9x): {label}")
        readings, raws = paired(lambda: read_layout_rate(files, cfg), lambda: raw_pyarrow_rate(files), args.pairs)
        print(f"of which reading alone (Parquet to segment tables) {np.median(readings) / 1e6:.3f} M tokens/s = "
              f"{paired_ratio(readings, raws)} the raw read")
        # the shards' decode as the stream does it (a local file read as decoded) against pyarrow's default
        # (pre-buffered: the column chunks' reads coalesced on Arrow's I/O threads), in turn, many times
        times = np.array([[decode_seconds(files, pre_buffer) for pre_buffer in (False, True)]
                          for _ in range(args.pairs * 20)])
        print(f"decoding the shards as the stream does (pre_buffer off for local files) "
              f"{np.median(times[:, 0]) * 1e3:.2f} ms against pyarrow's pre-buffered read "
              f"{np.median(times[:, 1]) * 1e3:.2f} ms: {np.median(times[:, 1] / times[:, 0]):.3f}x as fast "
              f"(median of {len(times)} pairs)")


def decode_seconds(files, pre_buffer: bool) -> float:
    """Seconds to decode the files' token columns as the stream's decoder does (one `ParquetFile` each,
    no threads), with or without pyarrow's pre-buffering."""
    t0 = time.perf_counter()
    for f in files:
        with pq.ParquetFile(f.path, pre_buffer=pre_buffer) as shard:
            shard.read(columns=["tokens", "segments"], use_threads=False)
    return time.perf_counter() - t0


def paired(run, peer, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """`pairs` runs of `run` and of its `peer`, turn about (rates). The machine's speed drifts by
    up to 2x within minutes (a shared VM): a run is compared with the peer run beside it."""
    rates, raws = zip(*((run(), peer()) for _ in range(pairs)), strict=True)
    return np.array(rates), np.array(raws)


def paired_ratio(rates: np.ndarray, raws: np.ndarray) -> str:
    """The median of the pairs' ratios, and their range."""
    r = rates / raws
    return f"{np.median(r):.3f}x ({r.min():.2f}-{r.max():.2f} over {len(r)} pairs)"


def _samples(files):
    for f in files:
        table = pq.read_table(f.path, columns=["tokens", "segments"])
        for t, s in zip(table.column("tokens").to_pylist(), table.column("segments").to_pylist(), strict=True):
            yield np.asarray(t, dtype=np.int32), s


if __name__ == "__main__":
    main()
