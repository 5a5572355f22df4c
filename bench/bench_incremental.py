"""Incremental re-ingestion: one new file in a folder of 1,000 against ingesting the folder anew.

The peer is the full ingestion of the same folder into a fresh dataset (what every job did before
the source index existed). The incremental job classifies all 1,001 inputs against the dataset's
source index (size and mtime, a hash only on mismatch), tokenizes only the new file and commits one
snapshot; it runs twice (a second new file), since the first finds the pool's worker processes
cold. Ray is started before timing in both (a cluster is long-lived). Both end with the same
catalog content, which the script checks (samples per source), and it prints the ratio.

    .venv/bin/python bench/bench_incremental.py [--files 1000] [--mb 15.5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from tokenloom.catalog import CatalogConfig, TokenCatalog
from tokenloom.platform.config import IngestConfig
from tokenloom.platform.ingest import ensure_ray, run_ingest
from tokenloom.samples.text import write_source_corpus
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.vocab import VocabManifest


def per_source(catalog: TokenCatalog) -> dict[str, int]:
    names = catalog.scan("bench", columns=("source",)).column("source").to_pylist()
    return {n: names.count(n) for n in set(names)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--mb", type=float, default=15.5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tl-bench-incr-"))
    source = write_source_corpus(work / "src", max_bytes=int(args.mb * 1e6), per_file=1)  # a file per module
    folder = work / "folder"
    folder.mkdir()
    shards = sorted(source.glob("*.jsonl"))
    for path in shards[: args.files]:
        shutil.copy(path, folder / path.name)
    extras = shards[args.files:args.files + 2]
    if len(extras) < 2:
        raise SystemExit(f"the corpus has {len(shards)} files; raise --mb to get more than {args.files + 1}")
    texts = (json.loads(line)["text"] for p in shards[:20] for line in p.read_text().splitlines())
    info = train_text_tokenizer(texts, work / "bundles", TextTokenizerConfig(vocab_size=4096))
    vocab = VocabManifest.build(TextTokenizer.load(info.path).vocab_size, bundles={"text": info.id})
    cfg = IngestConfig()
    cfg.ray.progress_bars = False
    t0 = time.perf_counter()
    ensure_ray(cfg)
    print(f"{args.files} files, {sum(p.stat().st_size for p in folder.glob('*.jsonl')) / 1e6:.1f} MB; "
          f"cores {os.cpu_count()}; ray start {time.perf_counter() - t0:.1f} s (not timed)")

    grown = TokenCatalog(CatalogConfig(), work / "grown")
    first = run_ingest([folder], "bench", grown, vocab, {"text": str(info.path)}, cfg)
    increments = []  # the first starts the pool's worker processes, the second finds them warm
    for extra in extras:
        shutil.copy(extra, folder / extra.name)
        increments.append(run_ingest([folder], "bench", grown, vocab, {"text": str(info.path)}, cfg))
    fresh = TokenCatalog(CatalogConfig(), work / "fresh")
    full = run_ingest([folder], "bench", fresh, vocab, {"text": str(info.path)}, cfg)
    if per_source(grown) != per_source(fresh):
        raise SystemExit("the incrementally grown dataset differs from the full ingestion")
    print(f"first full ingestion of {args.files} files: {first.seconds:.1f} s")
    for n, inc in enumerate(increments, start=1):
        print(f"incremental {n} (+1 file, {inc.sources}): {inc.seconds:.2f} s, {inc.samples} samples")
    print(f"full ingestion of {args.files + 2} files: {full.seconds:.1f} s, {full.samples} samples")
    print("speed-up incremental vs full = " + ", ".join(f"{full.seconds / inc.seconds:.1f}x" for inc in increments)
          + " (first, second increment)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
