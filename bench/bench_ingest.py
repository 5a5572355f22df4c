"""Ingestion throughput: the Ray Data job against HF `tokenizers` `encode_batch` alone.

Same corpus (standard-library sources, real text, taken in repeated passes past ~11 MB), same tokenizer bundle, same
cores. The peer reads the JSON-lines files and calls `encode_batch` (Rust, all cores); the
"fast peer" calls `encode_batch_fast` (same ids, no offsets: what the text pool calls); the
job reads, parses, routes, tokenizes on the text actor pool, validates, writes Parquet
shards and commits an Iceberg snapshot. Ray is started before timing (a cluster is
long-lived); its start-up is printed separately. Prints throughputs and their ratio.

With `--pools service` the job tokenizes through warm long-lived services (platform/services.py:
the text deployment is started, with the job's bundle and manifest, before timing), so no actor
starts per job.

With `--actors N` the text pool (or service) runs N actors (replicas); the scaling efficiency
E(n) = T(n) / (n T(1)) compares runs at n and 1 (T: the job's MB/s).

    .venv/bin/python bench/bench_ingest.py [--mb 60] [--repeats 2] [--pools job|service] [--actors 2]
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


def peer(corpus: Path, tok: TextTokenizer, method: str = "encode_batch") -> tuple[float, int]:
    """Read the JSON-lines files and tokenize them with HF `tokenizers`' `method`: `encode_batch`
    (the issue's peer) or `encode_batch_fast` (the same ids without offsets, what the pools call)."""
    t0 = time.perf_counter()
    tokens = 0
    for path in sorted(corpus.glob("*.jsonl")):
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line]
        tokens += sum(len(e.ids) for e in getattr(tok.tokenizer, method)(texts, add_special_tokens=False))
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--pools", choices=("job", "service"), default="job")
    ap.add_argument("--actors", type=int, default=2, help="text pool actors (service replicas), fixed")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tl-bench-"))
    cache = Path(os.environ.get("TOKENLOOM_BENCH_CACHE", "/tmp/tokenloom-bench-corpus"))
    corpus = write_source_corpus(cache / f"src-{args.mb:g}mb", max_bytes=int(args.mb * 1e6))
    nbytes = sum(p.stat().st_size for p in corpus.glob("*.jsonl"))
    texts = (json.loads(line)["text"] for p in sorted(corpus.glob("*.jsonl"))[:2] for line in p.read_text().splitlines())
    info = train_text_tokenizer(texts, work / "bundles", TextTokenizerConfig(vocab_size=4096))
    tok = TextTokenizer.load(info.path)
    vocab = VocabManifest.build(tok.vocab_size, bundles={"text": info.id})
    cfg = IngestConfig()
    cfg.ray.progress_bars = False
    cfg.pools["text"].batch_size = args.batch_size
    cfg.pools["text"].min_actors = cfg.pools["text"].max_actors = args.actors
    cfg.pools["text"].task_below_bytes = 0  # always actors, so --actors is what runs
    # the corpus repeats its sources on purpose (passes past ~11 MB) and the peer tokenizes every
    # record: filters and dedup are off here; bench_dedup.py measures what they cost
    cfg.filters.enabled = cfg.dedup.enabled = False
    t0 = time.perf_counter()
    ensure_ray(cfg)
    if args.pools == "service":  # warm services before timing, as `tokenloom pools up` leaves them
        import ray
        from ray import serve

        from tokenloom.platform.ingest import pool_worker_kwargs
        from tokenloom.platform.services import APP, application

        cfg.pools_mode = "service"
        defaults = {"text": pool_worker_kwargs("text", {"text": str(info.path)}, vocab, cfg)}
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        serve.run(application(defaults, {"text": "text_pool"}, cfg.service, ray.cluster_resources()["CPU"],
                              {"text": (args.actors, args.actors)}), name=APP, route_prefix="/", blocking=False)
    ray_start = time.perf_counter() - t0
    print(f"corpus {nbytes / 1e6:.1f} MB in {len(list(corpus.glob('*.jsonl')))} files; cores {os.cpu_count()}; "
          f"ray start {ray_start:.1f} s; pools: {args.pools}, {args.actors} text actor(s)")
    rows = []
    for rep in range(args.repeats):
        peer_s, peer_tokens = peer(corpus, tok)
        fast_s, fast_tokens = peer(corpus, tok, "encode_batch_fast")
        catalog = TokenCatalog(CatalogConfig(), work / f"home{rep}")
        result = run_ingest([corpus], "bench", catalog, vocab, {"text": str(info.path)}, cfg)
        job_tokens = result.tokens - 2 * result.samples  # minus <bos>/<eos>
        if not job_tokens == peer_tokens == fast_tokens:
            raise SystemExit(f"token counts differ: job {job_tokens} vs peers {peer_tokens}, {fast_tokens}")
        rows.append((peer_s, fast_s, result.seconds))
        print(f"  run {rep}: peer {nbytes / peer_s / 1e6:6.2f} MB/s   fast peer {nbytes / fast_s / 1e6:6.2f} MB/s   "
              f"job {nbytes / result.seconds / 1e6:6.2f} MB/s   job/peer {peer_s / result.seconds:.2f}   "
              f"job/fast peer {fast_s / result.seconds:.2f}")
        pool = result.pools.get("text", {})  # what Ray Data measured of the text pool's operator
        print(f"         text pool ({pool.get('mode')}): operator {pool.get('seconds')} s of the job's "
              f"{result.seconds:.2f} s, its tasks {pool.get('busy_seconds')} s in all, {pool.get('records')} records")
    best_peer, best_fast, best_job = (min(r[i] for r in rows) for i in range(3))
    print(f"best: peer {best_peer:.2f} s, fast peer {best_fast:.2f} s, job {best_job:.2f} s -> throughput ratio "
          f"job/peer (encode_batch) = {best_peer / best_job:.2f}, job/fast peer (encode_batch_fast) = "
          f"{best_fast / best_job:.2f} ({peer_tokens:,} tokens, {nbytes / 1e6:.1f} MB)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
