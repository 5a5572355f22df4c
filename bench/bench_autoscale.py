"""The text service's autoscaler over time, under a load that starts small and grows.

The long-lived text service (platform/services.py, the application `tokenloom pools up` starts)
runs on a local Ray with min 1 replica and as many as the cluster's CPUs allow. HTTP clients
(`POST /tokenize/text`, real documents of the standard-library corpus) come in phases of growing
concurrency, then stop; a sampler reads the replicas Serve runs (`serve.status()`) twice a second.
Printed per phase: the replicas running (mean, last), requests/s and tokens/s; written: the
samples as JSON and a plot (replicas and concurrency over time, above; tokens/s below). The
peer is the first phase: throughput per replica as load and replicas grow.

    .venv/bin/python bench/bench_autoscale.py [--phases 1,2,4,8,0] [--phase-s 40] [--out bench/figures]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from tokenloom.platform.config import IngestConfig
from tokenloom.platform.ingest import ensure_ray, pool_worker_kwargs
from tokenloom.samples.text import write_source_corpus
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.vocab import VocabManifest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Load:
    """Client threads, of which the first `level` send requests back to back."""

    def __init__(self, url: str, docs: list[bytes], threads: int):
        self.url, self.docs, self.level, self.stop = url, docs, 0, False
        self.done: list[tuple[float, int]] = []  # (finish time, tokens) per answered request
        self.errors = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(threads)]
        for t in self.threads:
            t.start()

    def _client(self, k: int) -> None:
        rng = np.random.default_rng(k)
        while not self.stop:
            if k >= self.level:
                time.sleep(0.05)
                continue
            body = self.docs[int(rng.integers(len(self.docs)))]
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    tokens = len(json.loads(response.read())["ids"])
                with self.lock:
                    self.done.append((time.perf_counter(), tokens))
            except OSError:
                with self.lock:
                    self.errors += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="1,2,4,8,0", help="client concurrency per phase (0: idle)")
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--upscale-delay-s", type=float, default=5.0)
    ap.add_argument("--downscale-delay-s", type=float, default=15.0)
    ap.add_argument("--out", default="bench/figures")
    args = ap.parse_args()
    phases = [int(x) for x in args.phases.split(",")]
    work = Path(tempfile.mkdtemp(prefix="tl-autoscale-"))
    corpus = write_source_corpus(work / "src", max_bytes=2_000_000)
    texts = [json.loads(line)["text"] for p in sorted(corpus.glob("*.jsonl")) for line in p.read_text().splitlines()]
    info = train_text_tokenizer(iter(texts), work / "bundles", TextTokenizerConfig(vocab_size=4096))
    vocab = VocabManifest.build(TextTokenizer.load(info.path).vocab_size, bundles={"text": info.id})
    docs = [json.dumps({"text": t[:8000]}).encode() for t in texts if t.strip()]

    cfg = IngestConfig()
    cfg.ray.progress_bars = False
    svc = cfg.service
    svc.min_replicas["text"], svc.max_replicas["text"] = 1, 0  # 0: as many as the cluster's CPUs allow
    svc.upscale_delay_s, svc.downscale_delay_s = args.upscale_delay_s, args.downscale_delay_s
    ensure_ray(cfg)
    import ray
    from ray import serve

    from tokenloom.platform.services import APP, application, autoscaling

    cpus = ray.cluster_resources()["CPU"]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    defaults = {"text": pool_worker_kwargs("text", {"text": str(info.path)}, vocab, cfg)}
    serve.run(application(defaults, {"text": "text_pool"}, svc, cpus), name=APP, route_prefix="/", blocking=False)
    bounds = autoscaling(svc, "text", cpus)
    url = f"http://127.0.0.1:{port}/tokenize/text"
    urllib.request.urlopen(urllib.request.Request(url, data=docs[0], method="POST"), timeout=300).read()  # warm
    print(f"cluster CPUs {cpus:g}; text service replicas {bounds['min_replicas']}..{bounds['max_replicas']}, "
          f"target {svc.target_ongoing_requests} ongoing requests per replica, upscale after "
          f"{svc.upscale_delay_s:g} s, downscale after {svc.downscale_delay_s:g} s")

    def running() -> int:
        states = serve.status().applications[APP].deployments["text"].replica_states
        return int(states.get("RUNNING", 0))

    load = Load(url, docs, max(phases))
    samples: list[dict] = []
    t0 = time.perf_counter()
    rows = []
    for level in phases:
        load.level = level
        start = time.perf_counter()
        while time.perf_counter() - start < args.phase_s:
            samples.append({"t": round(time.perf_counter() - t0, 2), "concurrency": level, "replicas": running()})
            time.sleep(0.5)
        end = time.perf_counter()
        with load.lock:
            answered = [(t, n) for t, n in load.done if start <= t < end]
        reps = [s["replicas"] for s in samples if s["t"] >= start - t0]
        rows.append((level, float(np.mean(reps)), reps[-1], len(answered) / (end - start),
                     sum(n for _, n in answered) / (end - start)))
        print(f"  concurrency {level}: replicas mean {rows[-1][1]:.2f}, last {rows[-1][2]}; "
              f"{rows[-1][3]:.1f} requests/s, {rows[-1][4]:,.0f} tokens/s")
    load.stop = True
    done = [(t - t0, n) for t, n in load.done]
    base = rows[0][4] / max(rows[0][2], 1)
    for level, _, last, _, tps in rows[1:]:
        if level:
            print(f"  concurrency {level}: {tps / max(rows[0][4], 1e-9):.2f}x the first phase's tokens/s "
                  f"with {last} replicas ({tps / max(last, 1) / max(base, 1e-9):.2f}x its tokens/s per replica)")
    print(f"errors: {load.errors}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale.json").write_text(json.dumps({"samples": samples, "answered": done, "phases": rows}))
    plot(samples, done, out / "autoscale.png")
    print(f"wrote {out / 'autoscale.png'} and {out / 'autoscale.json'}")
    serve.shutdown()


def plot(samples: list[dict], done: list[tuple[float, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.step(t, [s["replicas"] for s in samples], where="post", label="replicas running")
    top.step(t, [s["concurrency"] for s in samples], where="post", linestyle="--", label="client concurrency")
    top.set_ylabel("count")
    top.legend(loc="upper left")
    top.set_title("text tokenizer service: Serve autoscaler under growing load")
    edges = np.arange(0, max(t) + 5, 5.0)
    tokens, _ = np.histogram([d[0] for d in done], bins=edges, weights=[d[1] for d in done])
    bottom.bar(edges[:-1], tokens / 5.0, width=5.0, align="edge", alpha=0.7)
    bottom.set_ylabel("tokens/s (5 s bins)")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
