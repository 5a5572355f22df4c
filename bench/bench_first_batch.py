"""A new training run's first batch: its first window of files read while the model and the engine
are built (`Loader.prefetch`, which `trainer.loop.train` calls for a new run), against reading it when
the first batch is asked for (the peer: the same run with `Loader.prefetch` doing nothing).

Each run is `trainer.train` for 2 steps, in this process, on the demo-like shards of
`bench_packing.py` (4 files per window), from a cold start (`forget_read_tables`: no shard or
window in memory). Timed: the first `RunData.next_batch` call (the first step's wait for its rows)
and the run's start (from calling `train` to the first batch in hand). The two kinds of run go in
turn, `--pairs` times (this shared machine's speed drifts); printed: the medians and the ratio of
the medians. The first window's read alone (`read_layout` of its files, cold) is printed beside
them: what there is to hide.

    .venv/bin/python bench/bench_first_batch.py [--samples 40000] [--files 8] [--pairs 5] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_packing import AUDIO_WINDOW, GROUP, demo_like_shards  # noqa: E402

from tokenloom.datasets import StreamConfig  # noqa: E402
from tokenloom.datasets.loader import Loader  # noqa: E402
from tokenloom.datasets.stream import EpochOrder, forget_read_tables, read_layout  # noqa: E402
from tokenloom.model.config import ModelConfig, MoEConfig  # noqa: E402
from tokenloom.tokenizers.vocab import VocabManifest  # noqa: E402
from tokenloom.trainer.config import TrainConfig  # noqa: E402
from tokenloom.trainer.data import RunData  # noqa: E402


def one_rank() -> None:
    """The environment of a one-rank process group (the trainer starts it once per process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def run(files, folder: Path, prefetch: bool, default_model: bool) -> tuple[float, float]:
    """(first batch's wait, start to first batch) in seconds of a cold 2-step run, of the default
    model (`ModelConfig()`: what `tokenloom train` builds) or a tiny one (quicker to build)."""
    from tokenloom.trainer import train

    manifest = VocabManifest.build(2048, visual_size=1024, audio_levels=GROUP, audio_codebook=256)
    model_cfg = ModelConfig(vocab_size=manifest.size, audio_ranges=tuple((r.start, r.stop) for r in manifest.audio),
                            **({} if default_model else {"dim": 64, "n_layers": 2, "n_heads": 2,
                                                         "moe": MoEConfig(n_experts=4, top_k=2, expert_hidden=64)}))
    stream_cfg = StreamConfig(seq_len=256, group_size=GROUP, audio_window=AUDIO_WINDOW)
    train_cfg = TrainConfig(steps=2, micro_batch_size=8, eval_batches=0, log_every=1, keep_last=0)
    waits, started = [], [0.0]
    real_next, real_prefetch = RunData.next_batch, Loader.prefetch

    def timed_next(self, *args):
        t0 = time.perf_counter()
        out = real_next(self, *args)
        waits.append(time.perf_counter() - t0)
        if len(waits) == 1:
            started.append(time.perf_counter() - started[0])
        return out

    RunData.next_batch = timed_next
    if not prefetch:
        Loader.prefetch = lambda self: []
    try:
        forget_read_tables()
        started[0] = time.perf_counter()
        train(files, model_cfg, stream_cfg, train_cfg, folder / f"run-{time.monotonic_ns()}", progress=False)
    finally:
        RunData.next_batch, Loader.prefetch = real_next, real_prefetch
    return waits[0], started[1]


def first_window_read(files) -> float:
    cfg = StreamConfig(seq_len=256, group_size=GROUP, audio_window=AUDIO_WINDOW)
    order = EpochOrder(tuple(files), cfg.seed, 0, cfg.shuffle_window)
    forget_read_tables()
    t0 = time.perf_counter()
    read_layout([order.files[i].path for i in order.windows[0][0]], GROUP, AUDIO_WINDOW, parallel=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=40000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer dim-64 model instead of the default one")
    args = parser.parse_args()
    one_rank()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = demo_like_shards(folder, args.samples, args.files)
        run(files, folder, True, not args.tiny)  # warm: imports, the compiled loops, the process group
        reads = [first_window_read(files) for _ in range(args.pairs)]
        out = {True: [], False: []}
        for _ in range(args.pairs):
            for prefetch in (False, True):
                out[prefetch].append(run(files, folder, prefetch, not args.tiny))
    print(f"{args.samples} samples in {args.files} shards, {'a tiny' if args.tiny else 'the default'} model; "
          f"the first window's read alone (cold): "
          f"{statistics.median(reads) * 1e3:.1f} ms (median of {args.pairs})")
    for i, what in enumerate(("first batch's wait", "start to first batch")):
        plain, ahead = (statistics.median(r[i] for r in out[p]) for p in (False, True))
        print(f"{what:22s} read when asked for {plain * 1e3:8.1f} ms   prefetched {ahead * 1e3:8.1f} ms   "
              f"{plain / max(ahead, 1e-9):.2f}x less  (medians of {args.pairs} pairs)")


if __name__ == "__main__":
    main()
