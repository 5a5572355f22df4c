"""The Python API behind the `tokenloom` command: each function is one user-facing job.

The CLI is a thin shell over these functions; tests and notebooks call them directly. A
home folder (`./.tokenloom`, or TOKENLOOM_HOME) holds everything a run makes: the sample
corpus, tokenizer bundles, vocabulary manifests, the SQLite catalog, the warehouse, runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenloom
from tokenloom.catalog import TokenCatalog
from tokenloom.catalog.stats import hist_edges
from tokenloom.datasets import shard_files, sources
from tokenloom.datasets.samples import write_sample_corpus
from tokenloom.runconfig import RunConfig
from tokenloom.tokenizers import bundle as bundles
from tokenloom.tokenizers.text import train_text_tokenizer
from tokenloom.tokenizers.vocab import VocabManifest


@dataclass(frozen=True)
class Home:
    root: Path

    @staticmethod
    def resolve(path: str | Path | None = None) -> Home:
        return Home(Path(path or os.environ.get("TOKENLOOM_HOME") or ".tokenloom").absolute())

    @property
    def bundles(self) -> Path:
        return self.root / "bundles"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"


def code_version() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(tokenloom.__file__).parent,
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{tokenloom.__version__}+{sha}" if sha else tokenloom.__version__


def open_catalog(home: Home, cfg: RunConfig) -> TokenCatalog:
    return TokenCatalog(cfg.catalog, home.root)


# -- tokenizers ---------------------------------------------------------------------------
def iter_corpus_texts(paths: Sequence[str | Path]) -> Iterator[str]:
    """Good text records of the given files/folders (bad ones are skipped, as ingestion would)."""
    files, _ = sources.discover(paths)
    for src in files:
        if src.modality != "text":
            continue
        for rec in sources.parse_file(src.path, "text", Path(src.path).read_bytes()):
            if rec.payload is not None:
                yield rec.payload


def train_text(home: Home, corpus: Sequence[str | Path], cfg: RunConfig) -> bundles.BundleInfo:
    texts = iter_corpus_texts(corpus)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"no usable text found under {', '.join(map(str, corpus))}")
    return train_text_tokenizer(_chain(first, texts), home.bundles, cfg.text_tokenizer)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def latest_bundle(home: Home, kind: str) -> Path:
    found = sorted((p for p in home.bundles.glob(f"{kind}-*") if (p / bundles.CONFIG_NAME).is_file()),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no {kind} tokenizer in {home.bundles}; train one with `tokenloom tokenizer train {kind} --corpus PATH`"
        )
    return found[-1]


# -- ingestion ----------------------------------------------------------------------------
def ingest(home: Home, inputs: Sequence[str | Path], dataset: str, cfg: RunConfig,
           text_bundle: str | None = None):
    from tokenloom.platform.ingest import run_ingest  # Ray is imported only by jobs that use it

    catalog = open_catalog(home, cfg)
    text_path = bundles.resolve(home.bundles, text_bundle) if text_bundle else latest_bundle(home, "text")
    info = bundles.load_info(text_path)
    vocab = VocabManifest.build(info.config["vocab_size"], bundles={"text": info.id})
    vocab.save(home.vocab)
    return run_ingest(inputs, dataset, catalog, vocab, {"text": str(text_path)}, cfg.ingest,
                      lineage={"code_version": code_version()})


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


# -- catalog ------------------------------------------------------------------------------
def catalog_ls(home: Home, cfg: RunConfig) -> list[dict]:
    catalog = open_catalog(home, cfg)
    return [catalog.summary(name) for name in catalog.list_datasets()]


def catalog_show(home: Home, cfg: RunConfig, dataset: str, at: str | None = None) -> dict:
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    summary["files"] = [asdict(f) for f in catalog.data_files(dataset, at)]
    return summary


def catalog_history(home: Home, cfg: RunConfig, dataset: str) -> list[dict]:
    catalog = open_catalog(home, cfg)
    out = []
    tags = catalog.tags(dataset)
    for snap in catalog.history(dataset):
        tl = snap.tokenloom
        out.append({"snapshot_id": snap.snapshot_id, "timestamp_ms": snap.timestamp_ms,
                    "operation": snap.operation, "job_id": tl.get("job_id"),
                    "samples": int(tl.get("samples", 0)), "tokens": int(tl.get("tokens", 0)),
                    "quarantined": int(tl.get("quarantined", 0)),
                    "total_records": int(snap.properties.get("total-records", 0)),
                    "tags": sorted(t for t, sid in tags.items() if sid == snap.snapshot_id)})
    return out


def catalog_stats(home: Home, cfg: RunConfig, dataset: str, at: str | None = None) -> dict:
    s = open_catalog(home, cfg).summary(dataset, at)
    keys = ("dataset", "snapshot_id", "tags", "samples", "tokens", "total_quarantined", "stats", "job_id", "job_samples",
            "job_tokens", "quarantined", "quarantine_reasons")
    return {k: s.get(k) for k in keys} | {"length_hist_edges": hist_edges()}


def catalog_tag(home: Home, cfg: RunConfig, dataset: str, tag: str, at: str | None = None) -> dict:
    snapshot_id = open_catalog(home, cfg).tag(dataset, tag, at)
    return {"dataset": dataset, "tag": tag, "snapshot_id": snapshot_id}


def catalog_query(home: Home, cfg: RunConfig, sql: str):
    from tokenloom.catalog.query import query

    return query(open_catalog(home, cfg), sql)


def catalog_verify(home: Home, cfg: RunConfig, dataset: str, at: str | None = None):
    from tokenloom.catalog.maintenance import verify

    return verify(open_catalog(home, cfg), dataset, at)


def catalog_gc(home: Home, cfg: RunConfig, dataset: str | None, older_than_s: float, dry_run: bool = False) -> list:
    from tokenloom.catalog.maintenance import gc

    catalog = open_catalog(home, cfg)
    names = [dataset] if dataset else catalog.list_datasets()
    return [gc(catalog, name, older_than_s, dry_run) for name in names]


# -- training -----------------------------------------------------------------------------
def train(home: Home, dataset: str, cfg: RunConfig, at: str | None = None, progress: bool = True,
          run_name: str | None = None, resume_from: Path | None = None):
    from tokenloom.trainer import train as run_training

    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    if summary["snapshot_id"] is None:
        raise ValueError(f"dataset {dataset!r} has no committed snapshot to train on")
    vocab_path = home.vocab / f"{summary['vocab_id']}.json"
    if not vocab_path.is_file():
        raise FileNotFoundError(f"vocabulary manifest {summary['vocab_id']} not found in {home.vocab}")
    vocab = VocabManifest.load(vocab_path)
    if cfg.model.vocab_size and cfg.model.vocab_size < vocab.size:
        raise ValueError(f"model.vocab_size {cfg.model.vocab_size} is smaller than the manifest's {vocab.size}")
    cfg.model.vocab_size = cfg.model.vocab_size or vocab.size
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.stream.seq_len)
    run_dir = home.runs / (run_name or f"{dataset}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    files = shard_files(catalog, dataset, summary["snapshot_id"])
    result = run_training(files, cfg.model, cfg.stream, cfg.train, run_dir, resume_from=resume_from,
                          progress=progress)
    (run_dir / "source.json").write_text(json.dumps(
        {"dataset": dataset, "snapshot_id": summary["snapshot_id"], "vocab_id": vocab.id}, indent=2))
    return summary["snapshot_id"], result


# -- the demo -----------------------------------------------------------------------------
def demo_config(tiny: bool = False) -> RunConfig:
    """The embedded defaults at demo size: a model this CPU trains in a couple of minutes."""
    cfg = RunConfig()
    cfg.text_tokenizer.vocab_size = 2048
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 128, 4, 2
    cfg.stream.seq_len = 256
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.warmup_steps = 300, 8, 30
    if tiny:  # the integration test's size
        cfg.text_tokenizer.vocab_size = 512
        cfg.model.dim, cfg.model.n_layers = 64, 2
        cfg.stream.seq_len = 128
        cfg.train.steps, cfg.train.warmup_steps, cfg.train.micro_batch_size = 30, 5, 4
    return cfg


def demo(home: Home, cfg: RunConfig | None = None, tiny: bool = False, progress: bool = True) -> dict:
    cfg = cfg or demo_config(tiny)
    cfg.ingest.ray.progress_bars = progress
    t0 = time.perf_counter()
    corpus = write_sample_corpus(home.corpus, max_bytes=400_000 if tiny else 2_000_000)
    text_bundle = train_text(home, [corpus], cfg)
    result = ingest(home, [corpus], "stdlib-docs", cfg, text_bundle=text_bundle.id)
    shutdown_ray()
    snapshot_id, trained = train(home, "stdlib-docs", cfg, progress=progress, run_name="demo")
    return {
        "dataset": result.dataset,
        "snapshot_id": snapshot_id,
        "job_id": result.job_id,
        "already_committed": result.already_committed,
        "samples": result.samples,
        "tokens": result.tokens,
        "quarantined": result.quarantined,
        "quarantine_reasons": result.quarantine_reasons,
        "text_tokenizer": text_bundle.id,
        "steps": trained.steps,
        "loss_first": trained.first_loss,
        "loss_last": trained.last_loss,
        "train_tokens_per_second": trained.tokens_per_second,
        "parameters": trained.parameters,
        "home": str(home.root),
        "run_dir": trained.run_dir,
        "checkpoint": trained.checkpoint,
        "loss_plot": trained.loss_plot,
        "seconds": time.perf_counter() - t0,
    }
