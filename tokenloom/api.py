"""The Python API behind the `tokenloom` command: each function is one user-facing job.

The CLI is a thin shell over these functions; tests and notebooks call them directly. A
home folder (`./.tokenloom`, or TOKENLOOM_HOME) holds everything a run makes: the sample
corpus, tokenizer bundles, vocabulary manifests, the SQLite catalog, the warehouse, runs.
"""

from __future__ import annotations

import hashlib
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
from tokenloom.datasets.samples import write_sample_corpus, write_sample_images
from tokenloom.datasets.speech import write_sample_audio
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
            f"no {kind} tokenizer in {home.bundles}; train one with `tokenloom tokenizer train {kind} "
            f"{ {'visual': '--images', 'audio': '--audio'}.get(kind, '--corpus')} PATH`"
        )
    return found[-1]


def load_image_files(paths: Sequence[str | Path]) -> tuple[list[tuple[str, object]], list[tuple[str, str]]]:
    """Image files under `paths`, decoded and normalized as ingestion would:
    ([(path, RGB array)], [(path, reason)] for files that are not usable images)."""
    from tokenloom.datasets.images import decode_image

    files, skipped = sources.discover(paths)
    good, bad = [], list(skipped)
    for src in files:
        if src.modality not in ("image", sources.REFERENCED) or src.path.lower().endswith(".jsonl"):
            continue
        decoded, problem = decode_image(Path(src.path).read_bytes())
        if problem:
            bad.append((src.path, problem))
        else:
            good.append((src.path, decoded.pixels))
    return good, bad


def _split_heldout(items: list, fraction: float) -> tuple[list, list]:
    """A stable held-out split by path hash (at least one held out, at least one kept)."""
    ranked = sorted(items, key=lambda it: hashlib.sha256(it[0].encode()).hexdigest())
    n = min(len(ranked) - 1, max(1, round(len(ranked) * fraction)))
    held = set(id(it) for it in ranked[:n])
    return [it for it in items if id(it) not in held], [it for it in items if id(it) in held]


def _train_and_heldout(load, inputs: Sequence[str | Path], heldout: Sequence[str | Path], what: str
                       ) -> tuple[tuple[list, list], list[tuple[str, str]]]:
    """Load training and held-out media with `load` (explicit held-out files, or 10% of the
    inputs by path hash): ((train arrays, held-out arrays), rejected (path, reason))."""
    train_items, skipped = load(inputs)
    if heldout:
        held_items, bad = load(heldout)
        skipped += bad
    elif len(train_items) >= 2:
        train_items, held_items = _split_heldout(train_items, 0.1)
    else:
        held_items = []
    if not train_items or not held_items:
        raise ValueError(f"need at least two usable {what} (one held out) under {', '.join(map(str, inputs))}; "
                         f"found {len(train_items) + len(held_items)}"
                         + (f", rejected {len(skipped)}: {skipped[0][1]}" if skipped else ""))
    return ([a for _, a in train_items], [a for _, a in held_items]), skipped


def _run_dir(home: Home, kind: str, run_name: str | None) -> Path:
    return home.runs / (run_name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")


def train_visual(home: Home, images: Sequence[str | Path], cfg: RunConfig, heldout: Sequence[str | Path] = (),
                 run_name: str | None = None, resume: bool = False, progress: bool = True,
                 photos: tuple[list, list] | None = None):
    """Train a visual tokenizer on image files (or on given (train, held-out) arrays)."""
    from tokenloom.tokenizers.visual import matched_baseline
    from tokenloom.tokenizers.visual import train_visual as run

    vcfg = cfg.visual_tokenizer
    vcfg.validate()
    skipped: list[tuple[str, str]] = []
    if photos is None:
        photos, skipped = _train_and_heldout(load_image_files, images, heldout, "images")
    extra = matched_baseline(vcfg)[1] if vcfg.arch == "cnn" else 0
    result = run(photos[0], photos[1], vcfg, home.bundles, _run_dir(home, "visual", run_name), extra_cnn_blocks=extra,
                 resume=resume, progress=progress)
    return result, skipped


def eval_visual(home: Home, bundle_ref: str, images: Sequence[str | Path], out_dir: Path | None = None) -> dict:
    """PSNR, SSIM, codebook usage and perplexity of a visual bundle on anyone's image files,
    plus a PNG grid of originals beside reconstructions."""
    from tokenloom.tokenizers.visual import evaluate, load_visual, prepare

    model = load_visual(bundles.resolve(home.bundles, bundle_ref))
    good, bad = load_image_files(images)
    if not good:
        raise ValueError(f"no usable images under {', '.join(map(str, images))}"
                         + (f" ({len(bad)} rejected, e.g. {bad[0][0]}: {bad[0][1]})" if bad else ""))
    out_dir = Path(out_dir or home.root / "evals" / f"{model.bundle_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    tensors = [prepare(p, model.cfg) for _, p in good]
    result = evaluate(model, tensors, names=[path for path, _ in good], grid_path=out_dir / "grid.png")
    doc = {"bundle_id": model.bundle_id, **result.to_dict(), "rejected": [{"path": p, "reason": r} for p, r in bad]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(doc, indent=2))
    return doc


def load_audio_files(paths: Sequence[str | Path], seconds: float | None = None
                     ) -> tuple[list[tuple[str, object]], list[tuple[str, str]]]:
    """Audio files under `paths` as 16 kHz mono float arrays (at most `seconds` each), read as
    ingestion reads them: ([(path, samples)], [(path, reason)] for unusable files)."""
    import numpy as np

    from tokenloom.datasets.audio import AudioProblem, probe, read_blocks
    from tokenloom.tokenizers.audio import to_mono_16k

    files, skipped = sources.discover(paths)
    good, bad = [], list(skipped)
    for src in files:
        if src.modality not in ("audio", sources.REFERENCED) or sources.ROUTES.get(Path(src.path).suffix.lower()) != "audio":
            continue
        try:
            info = probe(src.path)
            parts, total = [], 0
            for block in read_blocks(src.path, 30.0):
                parts.append(to_mono_16k(block, info.sample_rate))
                total += len(parts[-1])
                if seconds and total >= seconds * 16_000:
                    break
            samples = np.concatenate(parts)[: int(seconds * 16_000) if seconds else None]
            good.append((src.path, samples))
        except AudioProblem as exc:
            bad.append((src.path, str(exc)))
    return good, bad


def train_audio(home: Home, audio: Sequence[str | Path], cfg: RunConfig, heldout: Sequence[str | Path] = (),
                run_name: str | None = None, resume: bool = False, progress: bool = True,
                clips: tuple[list, list] | None = None):
    """Train an RVQ audio tokenizer on audio files (or on given (train, held-out) 16 kHz arrays)."""
    from tokenloom.tokenizers.audio import train_audio as run

    acfg = cfg.audio_tokenizer
    acfg.validate()
    skipped: list[tuple[str, str]] = []
    if clips is None:
        clips, skipped = _train_and_heldout(load_audio_files, audio, heldout, "audio files")
    result = run(clips[0], clips[1], acfg, home.bundles, _run_dir(home, "audio", run_name), resume=resume,
                 progress=progress)
    return result, skipped


def eval_audio(home: Home, bundle_ref: str, audio: Sequence[str | Path], levels: int | None = None,
               out_dir: Path | None = None, max_seconds: float = 30.0) -> dict:
    """SI-SDR, mel distance, bitrate and codebook usage per level of an audio bundle on anyone's
    files (the first `max_seconds` of each), with spectrograms and WAVs."""
    import torch

    from tokenloom.tokenizers.audio import evaluate, load_audio

    model = load_audio(bundles.resolve(home.bundles, bundle_ref))
    if levels is not None and not 1 <= levels <= model.levels:
        raise ValueError(f"--levels must be 1..{model.levels} for this bundle, got {levels}")
    good, bad = load_audio_files(audio, seconds=max_seconds)
    if not good:
        raise ValueError(f"no usable audio under {', '.join(map(str, audio))}"
                         + (f" ({len(bad)} rejected, e.g. {bad[0][0]}: {bad[0][1]})" if bad else ""))
    out_dir = Path(out_dir or home.root / "evals" / f"{model.bundle_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    clips = [torch.from_numpy(a)[None] for _, a in good]
    result = evaluate(model, clips, out_dir, names=[p for p, _ in good], levels=levels)
    doc = {"bundle_id": model.bundle_id, **result.to_dict(), "rejected": [{"path": p, "reason": r} for p, r in bad]}
    doc["levels"] = levels or model.levels
    doc["si_sdr"], doc["mel"] = result.by_levels[doc["levels"]]["si_sdr"], result.by_levels[doc["levels"]]["mel"]
    doc["bitrate"] = model.cfg.bitrate(doc["levels"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(doc, indent=2))
    return doc


def decode_sample(home: Home, cfg: RunConfig, dataset: str, sample: str, out: Path, at: str | None = None,
                  levels: int | None = None) -> dict:
    """Turn the image segments of a committed sample back into image files (PNG) and its audio
    segments into WAV files (from the first `levels` RVQ levels, all by default); text
    segments are decoded to text with the sample's text bundle."""
    from tokenloom.tokenizers.text import TextTokenizer
    from tokenloom.tokenizers.visual import load_visual, to_pixels

    catalog = open_catalog(home, cfg)
    from pyiceberg.expressions import EqualTo

    rows = catalog.scan(dataset, at=at, where=EqualTo("sample_id", sample),
                        columns=("sample_id", "tokens", "segments", "vocab_id")).to_pylist()
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no sample {sample!r}")
    row = rows[0]
    vocab_path = home.vocab / f"{row['vocab_id']}.json"
    if not vocab_path.is_file():
        raise FileNotFoundError(f"vocabulary manifest {row['vocab_id']} not found in {home.vocab}")
    vocab = VocabManifest.load(vocab_path)
    tokens = row["tokens"]
    written, texts = [], []
    images = [s for s in row["segments"] if s["modality"] == "image"]
    if images:
        visual_id = vocab.bundles.get("visual")
        if not visual_id:
            raise ValueError(f"sample {sample} has image segments but its vocabulary names no visual bundle")
        import torch
        from PIL import Image

        model = load_visual(bundles.resolve(home.bundles, visual_id))
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for k, seg in enumerate(images):
            h, w = seg["grid"]
            ids = torch.tensor(tokens[seg["start"]:seg["start"] + seg["length"]], dtype=torch.long)
            codes = (ids - vocab.visual.start).reshape(1, h, w)
            image = to_pixels(model.decode(codes)[0])
            target = out if len(images) == 1 else out.with_name(f"{out.stem}-{k}{out.suffix or '.png'}")
            Image.fromarray(image).save(target, format="PNG")
            written.append(str(target))
    text_id = vocab.bundles.get("text")
    if text_id:
        tok = TextTokenizer.load(bundles.resolve(home.bundles, text_id))
        for seg in row["segments"]:
            if seg["modality"] == "text":
                ids = [t - vocab.text.start for t in tokens[seg["start"]:seg["start"] + seg["length"]]
                       if t in vocab.text]
                if ids:
                    texts.append(tok.decode(ids))
    sounds = [s for s in row["segments"] if s["modality"] == "audio"]
    sounds_written: list[str] = []
    if sounds:
        import numpy as np
        import soundfile as sf
        import torch

        from tokenloom.tokenizers.audio import load_audio

        audio_id = vocab.bundles.get("audio")
        if not audio_id:
            raise ValueError(f"sample {sample} has audio segments but its vocabulary names no audio bundle")
        model = load_audio(bundles.resolve(home.bundles, audio_id))
        offsets = np.array([r.start for r in vocab.audio], dtype=np.int64)
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        for k, seg in enumerate(sounds):
            frames, nlevels = seg["grid"]
            ids = np.asarray(tokens[seg["start"]:seg["start"] + seg["length"]], dtype=np.int64).reshape(frames, nlevels)
            codes = torch.from_numpy(ids - offsets[None, :nlevels])[None]
            wav = model.decode(codes, levels)[0, 0].clamp(-1, 1).numpy()
            stem = out.with_suffix("") if out.suffix.lower() == ".wav" else out
            target = stem.with_suffix(".wav") if len(sounds) == 1 else stem.with_name(f"{stem.name}-{k}.wav")
            sf.write(target, wav, model.cfg.sample_rate, subtype="PCM_16")
            sounds_written.append(str(target))
    if not written and not sounds_written and not texts:
        raise ValueError(f"sample {sample} has no image, audio or text segments to decode")
    return {"dataset": dataset, "sample_id": sample, "images": written, "audio": sounds_written, "text": texts}


# -- ingestion ----------------------------------------------------------------------------
def ingest(home: Home, inputs: Sequence[str | Path], dataset: str, cfg: RunConfig,
           text_bundle: str | None = None, visual_bundle: str | None = None, audio_bundle: str | None = None):
    from tokenloom.platform.ingest import run_ingest  # Ray is imported only by jobs that use it

    catalog = open_catalog(home, cfg)
    text_path = bundles.resolve(home.bundles, text_bundle) if text_bundle else latest_bundle(home, "text")
    text_info = bundles.load_info(text_path)
    paths, ids = {"text": str(text_path)}, {"text": text_info.id}
    visual_size = 0
    files, _ = sources.discover(inputs)
    if any(f.modality == "image" for f in files):
        visual_path = bundles.resolve(home.bundles, visual_bundle) if visual_bundle else latest_bundle(home, "visual")
        visual_info = bundles.load_info(visual_path)
        if visual_info.kind != "visual":
            raise ValueError(f"bundle {visual_info.id} is a {visual_info.kind} tokenizer, not a visual one")
        paths["visual"], ids["visual"] = str(visual_path), visual_info.id
        visual_size = int(visual_info.config["num_codes"])
    levels = codebook = 0
    if any(f.modality == "audio" for f in files):
        audio_path = bundles.resolve(home.bundles, audio_bundle) if audio_bundle else latest_bundle(home, "audio")
        audio_info = bundles.load_info(audio_path)
        if audio_info.kind != "audio":
            raise ValueError(f"bundle {audio_info.id} is a {audio_info.kind} tokenizer, not an audio one")
        paths["audio"], ids["audio"] = str(audio_path), audio_info.id
        levels, codebook = int(audio_info.config["levels"]), int(audio_info.config["codebook_size"])
    vocab = VocabManifest.build(text_info.config["vocab_size"], visual_size=visual_size, audio_levels=levels,
                                audio_codebook=codebook, bundles=ids)
    vocab.save(home.vocab)
    return run_ingest(inputs, dataset, catalog, vocab, paths, cfg.ingest, lineage={"code_version": code_version()})


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
    cfg.model.audio_ranges = tuple((r.start, r.stop) for r in vocab.audio)
    cfg.stream.group_size = cfg.stream.group_size or max(1, len(vocab.audio))
    if cfg.stream.group_size < len(vocab.audio):
        raise ValueError(f"stream.group_size {cfg.stream.group_size} cannot hold the manifest's {len(vocab.audio)} "
                         "audio levels")
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.stream.seq_len)
    run_dir = home.runs / (run_name or f"{dataset}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    files = shard_files(catalog, dataset, summary["snapshot_id"])
    result = run_training(files, cfg.model, cfg.stream, cfg.train, run_dir, resume_from=resume_from,
                          progress=progress)
    if int(os.environ.get("RANK", "0")) == 0:  # every rank trains in rank 0's run folder (the loop broadcasts it)
        (Path(result.run_dir) / "source.json").write_text(json.dumps(
            {"dataset": dataset, "snapshot_id": summary["snapshot_id"], "vocab_id": vocab.id}, indent=2))
    return summary["snapshot_id"], result


def _model_folder(path: Path) -> Path:
    """A model folder, or a training run folder holding one under model/."""
    path = Path(path)
    if (path / "model" / "model.json").is_file():
        return path / "model"
    if (path / "model.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither a model folder nor a training run with a model/ folder")


def _submodel(cfg, layers: str | None, experts: str | None, top_k: int | None):
    from tokenloom.model.elastic import parse_indices
    from tokenloom.model.unified import SubModel

    if top_k is not None and not 1 <= top_k <= cfg.top_k:
        raise ValueError(f"--top-k must be in [1, {cfg.top_k}] for this model, got {top_k}")
    return SubModel(parse_indices(layers, cfg.n_layers, "--layers") if layers else None,
                    parse_indices(experts, cfg.n_experts, "--experts") if experts else None, top_k)


def model_export(source: Path, out: Path, layers: str | None = None, experts: str | None = None,
                 top_k: int | None = None) -> dict:
    """Write a smaller standalone model: a subset of layers, of experts, and a smaller top-k."""
    from tokenloom.model.io import load_model, save_model
    from tokenloom.model.unified import export_submodel

    model, doc = load_model(_model_folder(source))
    sub = _submodel(model.cfg, layers, experts, top_k)
    small = export_submodel(model, sub)
    save_model(small.state_dict(), small.cfg, out, {"exported_from": str(Path(source).resolve()), **sub.describe(),
                                                    "experts_kept": list(sub.experts) if sub.experts else None})
    return {"out": str(out), "parameters": sum(p.numel() for p in small.parameters()),
            "source_parameters": sum(p.numel() for p in model.parameters()), "n_layers": small.cfg.n_layers,
            "n_experts": small.cfg.n_experts, "top_k": small.cfg.top_k}


def model_eval(home: Home, cfg: RunConfig, source: Path, dataset: str, at: str | None = None, batches: int = 8,
               layers: str | None = None, experts: str | None = None, top_k: int | None = None) -> dict:
    """Validation loss per modality of a model folder (optionally restricted) on a catalog snapshot."""
    from tokenloom.model.io import load_model
    from tokenloom.trainer.evaluate import evaluate

    model, doc = load_model(_model_folder(source))
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    if summary["snapshot_id"] is None:
        raise ValueError(f"dataset {dataset!r} has no committed snapshot to evaluate on")
    vocab = VocabManifest.load(home.vocab / f"{summary['vocab_id']}.json")
    if vocab.size > model.cfg.vocab_size or tuple((r.start, r.stop) for r in vocab.audio) != model.cfg.audio_ranges:
        raise ValueError(f"the model's token space does not match dataset {dataset!r}'s manifest {vocab.id}")
    cfg.stream.group_size = cfg.stream.group_size or max(1, len(vocab.audio))
    sub = _submodel(model.cfg, layers, experts, top_k)
    files = shard_files(catalog, dataset, summary["snapshot_id"])
    result = evaluate(model, files, cfg.stream, batches=batches, micro_batch_size=cfg.train.micro_batch_size, sub=sub)
    return {"model": str(_model_folder(source)), "dataset": dataset, "snapshot_id": summary["snapshot_id"],
            "submodel": sub.describe(), **result}


# -- the demo -----------------------------------------------------------------------------
def demo_config(tiny: bool = False) -> RunConfig:
    """The embedded defaults at demo size: a model this CPU trains in a couple of minutes."""
    cfg = RunConfig()
    cfg.text_tokenizer.vocab_size = 2048
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads = 128, 4, 2
    cfg.stream.seq_len = 256
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.warmup_steps = 300, 8, 30
    v = cfg.visual_tokenizer  # brief trainings: the demo shows the path, bench/ shows the quality
    v.max_minutes, v.max_pixels, v.eval_crops = 1.0, 128 * 128, 4
    a = cfg.audio_tokenizer
    a.max_minutes, a.eval_seconds = 1.0, 3.0
    if tiny:  # the integration test's size
        cfg.text_tokenizer.vocab_size = 512
        cfg.model.dim, cfg.model.n_layers = 64, 2
        cfg.stream.seq_len = 128
        cfg.train.steps, cfg.train.warmup_steps, cfg.train.micro_batch_size = 30, 5, 4
        v.channels, v.latent_channels, v.vit_dim, v.vit_depth = 8, 32, 32, 1
        v.image_size, v.batch_size, v.max_minutes, v.max_pixels, v.eval_crops = 64, 4, 0.15, 64 * 64, 1
        a.channels, a.max_channels, a.latent_dim, a.levels, a.codebook_size = 8, 64, 32, 4, 256
        a.batch_size, a.segment_seconds, a.max_minutes, a.eval_seconds = 4, 0.5, 0.15, 1.0
    return cfg


def _demo_visual_bundle(home: Home, cfg: RunConfig, progress: bool) -> dict:
    """The newest visual bundle in home trained with this recipe, or a brief new training."""
    from dataclasses import asdict as as_dict

    from tokenloom.datasets.samples import sample_photos

    recipe = json.loads(json.dumps(as_dict(cfg.visual_tokenizer)))
    for path in sorted(home.bundles.glob("visual-*"), key=lambda p: p.stat().st_mtime, reverse=True):
        info = bundles.load_info(path)
        if info.config.get("config") == recipe:
            return {"bundle_id": info.id, "reused": True, "heldout": info.config.get("heldout", {})}
    photos = (list(sample_photos("train").values()), list(sample_photos("heldout").values()))
    # one run folder per recipe: an interrupted demo continues its tokenizer training
    run_name = "demo-visual-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    resume = (home.runs / run_name / "checkpoint.pt").is_file()
    result, _ = train_visual(home, [], cfg, run_name=run_name, resume=resume, progress=progress, photos=photos)
    return {"bundle_id": result.bundle.id, "reused": False, "heldout": result.heldout}


def _demo_audio_bundle(home: Home, cfg: RunConfig, progress: bool, tiny: bool) -> dict:
    """The newest audio bundle in home trained with this recipe, or a brief new training on
    eSpeak NG speech plus tones and noise."""
    from dataclasses import asdict as as_dict

    from tokenloom.datasets.speech import sound_clips, speech_clips

    recipe = json.loads(json.dumps(as_dict(cfg.audio_tokenizer)))
    for path in sorted(home.bundles.glob("audio-*"), key=lambda p: p.stat().st_mtime, reverse=True):
        info = bundles.load_info(path)
        if info.config.get("config") == recipe:
            return {"bundle_id": info.id, "reused": True, "heldout": info.config.get("heldout", {})}
    train = [wav for wav, _ in speech_clips("train", 24 if tiny else 96)] + sound_clips()
    held = [wav for wav, _ in speech_clips("heldout", 2 if tiny else 6)]
    run_name = "demo-audio-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    resume = (home.runs / run_name / "checkpoint.pt").is_file()
    result, _ = train_audio(home, [], cfg, run_name=run_name, resume=resume, progress=progress, clips=(train, held))
    return {"bundle_id": result.bundle.id, "reused": False, "heldout": result.heldout}


def demo(home: Home, cfg: RunConfig | None = None, tiny: bool = False, progress: bool = True) -> dict:
    cfg = cfg or demo_config(tiny)
    cfg.ingest.ray.progress_bars = progress
    t0 = time.perf_counter()
    corpus = write_sample_corpus(home.corpus, max_bytes=400_000 if tiny else 2_000_000)
    write_sample_images(corpus / "images", variants=1 if tiny else 2)
    write_sample_audio(corpus / "audio", utterances=8 if tiny else 24)
    text_bundle = train_text(home, [corpus], cfg)
    visual = _demo_visual_bundle(home, cfg, progress)
    audio = _demo_audio_bundle(home, cfg, progress, tiny)
    result = ingest(home, [corpus], "stdlib-docs", cfg, text_bundle=text_bundle.id, visual_bundle=visual["bundle_id"],
                    audio_bundle=audio["bundle_id"])
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
        "visual_tokenizer": visual["bundle_id"],
        "visual_reused": visual["reused"],
        "visual_heldout": visual["heldout"],
        "audio_tokenizer": audio["bundle_id"],
        "audio_reused": audio["reused"],
        "audio_heldout": audio["heldout"],
        "modalities": catalog_stats(home, cfg, result.dataset)["stats"]["modalities"],
        "steps": trained.steps,
        "loss_first": trained.first_loss,
        "loss_last": trained.last_loss,
        "train_tokens_per_second": trained.tokens_per_second,
        "parameters": trained.parameters,
        "active_parameters": trained.active_parameters,
        "model": f"{cfg.model.n_layers} layers x dim {cfg.model.dim}, {cfg.model.n_experts} experts top-"
                 f"{cfg.model.top_k} + {cfg.model.n_shared_experts} shared",
        "modality_loss": trained.modality_loss,
        "routing": trained.routing,
        "model_dir": trained.model_dir,
        "home": str(home.root),
        "run_dir": trained.run_dir,
        "checkpoint": trained.checkpoint,
        "loss_plot": trained.loss_plot,
        "seconds": time.perf_counter() - t0,
    }
