"""Split reading: one big JSON-lines file ingested as byte ranges vs as one whole-file block.

The file is the standard-library corpus (`samples.text.write_source_corpus`) concatenated into one
`.jsonl` of `--mb` megabytes. Both runs: the text pool as actors (2), filters and dedup off (the
comparison is of reading), the same bundle and Ray runtime (started before timing). Measured per
run: wall time, and peak memory as the machine's used memory (`psutil.virtual_memory().used`,
sampled every 0.2 s) over the baseline before the run: every Ray process counts, whichever holds
the file. Whole-file reading puts the entire file in one task's memory and one block; split
reading holds `ingest.split_bytes` per read task.

    .venv/bin/python bench/bench_split.py [--mb 2048] [--split-mb 64] [--modes split,whole]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tokenloom.catalog import CatalogConfig, TokenCatalog
from tokenloom.platform.config import IngestConfig
from tokenloom.platform.ingest import ensure_ray, run_ingest
from tokenloom.samples.text import write_source_corpus
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.vocab import VocabManifest


def big_file(folder: Path, mb: float) -> Path:
    """One .jsonl of `mb` megabytes: the source corpus's records, repeated with a pass number so no
    two lines are equal."""
    corpus = write_source_corpus(folder / "src", max_bytes=20_000_000)
    lines = [line for p in sorted(corpus.glob("*.jsonl")) for line in p.read_text().splitlines() if line]
    out = folder / "big" / "corpus.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    target, written, n = int(mb * 1e6), 0, 0
    with out.open("w") as f:
        while written < target:
            for line in lines:
                doc = json.loads(line)
                row = json.dumps({"text": f"[pass {n}] {doc['text']}"}) + "\n"
                f.write(row)
                written += len(row.encode())
                if written >= target:
                    break
            n += 1
    return out


class PeakMemory:
    """The machine's used memory, sampled in a thread: peak over the baseline at start."""

    def __enter__(self):
        self.base = self.peak = psutil.virtual_memory().used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, psutil.virtual_memory().used)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=2048)
    ap.add_argument("--split-mb", type=float, default=64)
    ap.add_argument("--modes", default="split,whole")
    ap.add_argument("--work", default="")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="tl-split-"))
    path = work / "big" / "corpus.jsonl"
    if not path.exists() or path.stat().st_size < args.mb * 1e6 * 0.99:
        path = big_file(work, args.mb)
    size = path.stat().st_size
    texts = (json.loads(line)["text"] for line, _ in zip(path.open(), range(20000), strict=False))
    info = train_text_tokenizer(texts, work / "bundles", TextTokenizerConfig(vocab_size=4096))
    vocab = VocabManifest.build(TextTokenizer.load(info.path).vocab_size, bundles={"text": info.id})
    print(f"{path}: {size / 1e6:,.0f} MB", flush=True)
    results = {}
    for mode in args.modes.split(","):
        cfg = IngestConfig()
        cfg.ray.progress_bars = False
        cfg.filters.enabled = cfg.dedup.enabled = False
        cfg.pools["text"].task_below_bytes = 0
        cfg.split_bytes = int(args.split_mb * 1e6) if mode == "split" else 0
        ensure_ray(cfg)
        catalog = TokenCatalog(CatalogConfig(), work / f"home-{mode}")
        t0 = time.perf_counter()
        with PeakMemory() as mem:
            try:
                r = run_ingest([path.parent], mode, catalog, vocab, {"text": str(info.path)}, cfg)
                outcome = f"{r.samples:,} samples, {r.tokens:,} tokens"
            except Exception as exc:  # noqa: BLE001 (the whole-file run may run out of memory)
                outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        seconds = time.perf_counter() - t0
        results[mode] = (seconds, mem.mb)
        print(f"{mode:>5}: {seconds:7.1f} s  {size / 1e6 / seconds:6.1f} MB/s  peak memory +{mem.mb:,.0f} MB  {outcome}",
              flush=True)
    if {"split", "whole"} <= set(results):
        (ts, ms), (tw, mw) = results["split"], results["whole"]
        print(f"split / whole: time {ts / tw:.2f}x, peak memory {ms / max(mw, 1):.2f}x")


if __name__ == "__main__":
    main()
