"""Which responses does each replay buffer train on, and how busy does it keep the inference pool?

A simulated long tail (lognormal response lengths, a few answers 10-20x the per-round budget; the
same lengths for every buffer) through `trainer.rl.buffer.simulate`, the loop's own order of
release, admission and rounds. Printed per buffer, against the queries' own lengths (the peer:
what an unbiased trainer should see):
- the mean, median and 90th percentile of the trained responses' lengths and their ratio to the
  queries' (1.00: unbiased), and the share of the longest decile of queries that got trained;
- rounds per released batch (how long the trainer waits) and the inference pool's slot use (tokens
  made / the pool's round capacity, batch_queries x oversample x group x budget per round, the same
  pool for every buffer: a synchronous loop leaves most of it idle while its long answers finish);
- staleness: how many policy versions behind the trained tokens are.

Usage: python bench/bench_rl_buffer.py [--batches 50] [--batch-queries 8] [--group 8] [--oversample 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenloom.trainer.rl.buffer import make_buffer, simulate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--batch-queries", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--oversample", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16, help="tokens per response per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    queries = args.batches * args.batch_queries * (args.oversample + 2)
    # per query a typical length (lognormal, median 24 tokens), per response some spread around it
    typical = np.clip(rng.lognormal(np.log(24), 0.9, size=queries), 2, 20 * args.budget)
    spread = rng.uniform(0.7, 1.3, size=(queries, args.group))
    lengths = np.maximum(1, (typical[:, None] * spread).round().astype(int))
    trained_queries = args.batches * args.batch_queries
    peer = lengths[:trained_queries].ravel()
    long_cut = np.quantile(typical[:trained_queries], 0.9)
    print(f"{args.batches} batches of {args.batch_queries} queries x {args.group} responses, budget {args.budget} "
          f"tokens/round, oversample {args.oversample}; query lengths: mean {peer.mean():.1f}, median "
          f"{np.median(peer):.0f}, p90 {np.quantile(peer, 0.9):.0f}, max {peer.max()}")
    print(f"{'buffer':8} {'mean':>6} {'/peer':>6} {'median':>7} {'p90':>5} {'/peer':>6} {'long decile':>12} "
          f"{'rounds/batch':>13} {'slot use':>9} {'stale mean':>11} {'seconds':>8}")
    pool_slots = args.batch_queries * args.oversample * args.group * args.budget  # one round of the whole pool
    for name in ("sync", "urb", "april"):
        buffer = make_buffer(name, args.batch_queries, args.group, args.oversample)
        count = {"rounds": 0, "tokens": 0}
        active, record = buffer.active, buffer.record

        def counted_active(active=active, count=count):  # simulate calls it once per round
            count["rounds"] += 1
            return active()

        def counted_record(key, tokens, *rest, record=record, count=count):
            count["tokens"] += len(tokens)
            return record(key, tokens, *rest)

        buffer.active, buffer.record = counted_active, counted_record
        started = time.perf_counter()
        batches = simulate(buffer, lambda q, m: int(lengths[q, m]), args.budget, args.batches)
        seconds = time.perf_counter() - started
        trained = np.array([len(t.tokens) for b in batches for t in b])
        stale = np.array([k - v for k, b in enumerate(batches) for t in b for v in t.versions])
        long_q = {t.query.index for b in batches for t in b if typical[t.query.index] >= long_cut}
        long_share = len(long_q) / max(1, int((typical[:trained_queries] >= long_cut).sum()))
        print(f"{name:8} {trained.mean():6.1f} {trained.mean() / peer.mean():6.2f} {np.median(trained):7.0f} "
              f"{np.quantile(trained, 0.9):5.0f} {np.quantile(trained, 0.9) / np.quantile(peer, 0.9):6.2f} "
              f"{long_share:12.2f} {count['rounds'] / len(batches):13.1f} "
              f"{count['tokens'] / (count['rounds'] * pool_slots):9.2f} {stale.mean():11.2f} {seconds:8.2f}")


if __name__ == "__main__":
    main()
