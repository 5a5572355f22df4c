"""Dedup and quality filters: their cost in the ingestion job, and MinHash LSH precision/recall.

(a) Throughput: the same corpus (stdlib docstrings, or with `--corpus sources` whole stdlib
    source files; plus 10% planted copies, re-cased or with one word edited)
    ingested by the real Ray Data job with filters and dedup on, then off, into fresh
    catalogs; Ray is started once before timing. Prints input MB/s of both and the ratio
    on/off (the goal is >= 0.8).
(b) Accuracy: 10,000 synthetic documents (Zipf words, 80-300 words each): 1,500 pairs whose
    true Jaccard on word 5-grams is >= the threshold, 1,500 hard-negative pairs in [0.5, 0.8),
    and singletons. `datasets.dedup.find_duplicates` at the default settings decides; prints
    precision and recall against the true Jaccard, and recall in the band just above the
    threshold, where the MinHash estimate is least sure.

    .venv/bin/python bench/bench_dedup.py [--mb 3] [--corpus docstrings|sources] [--docs 10000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenloom.catalog import CatalogConfig, TokenCatalog
from tokenloom.datasets.dedup import Keys, find_duplicates, minhashes, shingles
from tokenloom.platform.config import DedupConfig, IngestConfig
from tokenloom.platform.ingest import ensure_ray, run_ingest, shutdown_ray
from tokenloom.samples.text import write_sample_corpus, write_source_corpus
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.vocab import VocabManifest


def jaccard(a: list[str], b: list[str], size: int) -> float:
    x, y = set(shingles(" ".join(a), size)), set(shingles(" ".join(b), size))
    return len(x & y) / len(x | y)


def edited(words: list[str], target: float, size: int, rng: random.Random, vocab: list[str]) -> list[str]:
    """`words` with isolated substitutions, enough for a shingle Jaccard near `target`."""
    n_sh = len(words) - size + 1
    # k spaced edits change ~size*k shingles: J = (S - c) / (S + c)
    changes = max(1, round(n_sh * (1 - target) / (1 + target) / size))
    out = list(words)
    positions = rng.sample(range(0, len(words), size + 1), min(changes, len(words) // (size + 1)))
    for p in positions:
        out[p] = rng.choice(vocab) + "q"  # a word no document has
    return out


def accuracy(args) -> None:
    cfg = DedupConfig()
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(20_000)]
    weights = 1 / np.arange(1, len(vocab) + 1)  # Zipf
    np_rng = np.random.default_rng(0)

    def doc() -> list[str]:
        return list(np_rng.choice(vocab, size=int(np_rng.integers(80, 300)), p=weights / weights.sum()))

    pairs = args.docs * 3 // 20  # 15% positive pairs, 15% hard-negative pairs, the rest singletons
    docs: list[list[str]] = []
    truth: dict[int, tuple[int, float]] = {}  # partner index -> (original index, true Jaccard)
    for kind in ("positive", "negative"):
        for _ in range(pairs):
            original = doc()
            lo, hi = (cfg.minhash_threshold, 0.98) if kind == "positive" else (0.5, cfg.minhash_threshold - 0.02)
            partner = edited(original, rng.uniform(lo, hi), cfg.shingle_size, rng, vocab)
            docs += [original, partner]
            truth[len(docs) - 1] = (len(docs) - 2, jaccard(original, partner, cfg.shingle_size))
    while len(docs) < args.docs:
        docs.append(doc())
    t0 = time.perf_counter()
    signatures = minhashes([" ".join(d) for d in docs], cfg.num_perm, cfg.shingle_size)
    sig_s = time.perf_counter() - t0
    keys = [Keys(f"d{i:05d}", "bench", f"{i}", None, signatures[i]) for i in range(len(docs))]
    t0 = time.perf_counter()
    drops = find_duplicates(keys, minhash_threshold=cfg.minhash_threshold, num_perm=cfg.num_perm,
                            phash_threshold=None)
    decide_s = time.perf_counter() - t0
    positives = {i for i, (_, j) in truth.items() if j >= cfg.minhash_threshold}
    found = {int(d.sample_id[1:]) for d in drops}
    correct = {i for i in found if i in positives and f"d{truth[i][0]:05d}" == next(
        d.duplicate_of for d in drops if d.sample_id == f"d{i:05d}")}
    band = {i for i in positives if truth[i][1] < cfg.minhash_threshold + 0.05}
    true_j = np.array([j for _, j in truth.values()])
    print(f"(b) {len(docs):,} documents: {len(positives):,} near-duplicate pairs (true J >= {cfg.minhash_threshold}), "
          f"{int((true_j < cfg.minhash_threshold).sum()):,} hard negatives (true J {true_j[true_j < 0.8].min():.2f}.."
          f"{true_j[true_j < 0.8].max():.2f}); num_perm {cfg.num_perm}, {cfg.shingle_size}-word shingles")
    print(f"    signatures {sig_s:.1f} s ({len(docs) / sig_s:,.0f} docs/s), decision {decide_s:.1f} s")
    print(f"    precision {len(correct) / max(1, len(found)):.3f}  recall {len(correct) / len(positives):.3f}  "
          f"(recall for true J in [{cfg.minhash_threshold}, {cfg.minhash_threshold + 0.05:.2f}): "
          f"{len(correct & band) / max(1, len(band)):.3f} of {len(band)})")


def throughput(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="tl-bench-dedup-"))
    cache = Path(os.environ.get("TOKENLOOM_BENCH_CACHE", "/tmp/tokenloom-bench-corpus"))
    if args.corpus == "sources":  # whole stdlib source files: one pass holds ~11 MB of distinct text
        source = write_source_corpus(cache / f"sources-{args.mb:g}mb", max_bytes=int(min(args.mb, 10) * 1e6))
    else:  # stdlib docstrings: short records, ~2.5 MB at most
        source = write_sample_corpus(cache / f"docstrings-{args.mb:g}mb", max_bytes=int(args.mb * 1e6),
                                     with_bad_inputs=False)
    corpus = work / "corpus"
    shutil.copytree(source, corpus)
    texts = [json.loads(line)["text"] for p in sorted(corpus.glob("*.jsonl")) for line in p.read_text().splitlines()
             if line]
    rng = random.Random(0)
    planted = []
    for t in rng.sample(texts, len(texts) // 10):  # 10% copies: half exact (re-cased), half one word edited
        words = t.split(" ")
        if rng.random() < 0.5 or len(words) < 20:
            planted.append(t.upper())
        else:
            words[len(words) // 2] += "x"
            planted.append(" ".join(words))
    (corpus / "planted.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in planted))
    nbytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
    info = train_text_tokenizer(texts[:5000], work / "bundles", TextTokenizerConfig(vocab_size=4096))
    vocab = VocabManifest.build(TextTokenizer.load(info.path).vocab_size, bundles={"text": info.id})
    t0 = time.perf_counter()
    base = IngestConfig()
    base.ray.progress_bars = False
    ensure_ray(base)
    print(f"(a) corpus {nbytes / 1e6:.2f} MB, {len(texts) + len(planted):,} records ({len(planted):,} planted "
          f"copies); cores {os.cpu_count()}; ray start {time.perf_counter() - t0:.1f} s")
    best: dict[bool, float] = {}
    for rep in range(args.repeats):
        for on in (False, True):
            cfg = IngestConfig()
            cfg.ray.progress_bars = False
            cfg.filters.enabled = cfg.dedup.enabled = on
            catalog = TokenCatalog(CatalogConfig(), work / f"home-{rep}-{on}")
            result = run_ingest([corpus], "bench", catalog, vocab, {"text": str(info.path)}, cfg)
            tl = catalog.snapshot("bench").tokenloom
            best[on] = min(best.get(on, float("inf")), result.seconds)
            print(f"  run {rep} {'on ' if on else 'off'}: {result.seconds:5.1f} s  {nbytes / result.seconds / 1e6:5.2f} MB/s"
                  f"  samples {result.samples:,}  duplicates {tl.get('duplicates')} {tl.get('duplicate_counts')}"
                  f"  filtered {tl.get('filtered')} {tl.get('filter_counts')}")
    print(f"    best: off {best[False]:.1f} s, on {best[True]:.1f} s -> throughput ratio on/off = "
          f"{best[False] / best[True]:.2f}")
    shutdown_ray()
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=3)
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--corpus", choices=("docstrings", "sources"), default="docstrings")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    if not args.skip_accuracy:
        accuracy(args)
    if not args.skip_throughput:
        throughput(args)


if __name__ == "__main__":
    main()
