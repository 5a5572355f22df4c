"""The `tokenloom` command: a thin shell over `tokenloom.api`.

Every reporting command takes `--json` (one JSON document on stdout, nothing else; `catalog
query` says `--format json`) and `--home`. Mistakes a user can fix (unknown dataset, missing path, bad config) print one
line on stderr and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="TokenLoom: multimodal tokenization platform and streaming MoE training.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
tokenizer_app = typer.Typer(help="Train, evaluate and decode with tokenizers.", no_args_is_help=True)
tokenizer_train_app = typer.Typer(help="Train a tokenizer bundle.", no_args_is_help=True)
tokenizer_eval_app = typer.Typer(help="Evaluate a tokenizer bundle on your files.", no_args_is_help=True)
catalog_app = typer.Typer(help="Query the dataset catalog.", no_args_is_help=True)
model_app = typer.Typer(help="Export and evaluate trained models.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")
tokenizer_app.add_typer(tokenizer_train_app, name="train")
tokenizer_app.add_typer(tokenizer_eval_app, name="eval")
app.add_typer(catalog_app, name="catalog")
app.add_typer(model_app, name="model")

console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)

HomeOpt = Annotated[Path | None, typer.Option("--home", help="State folder (default ./.tokenloom or TOKENLOOM_HOME).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Run config (TOML).")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Config overrides: key=value, e.g. train.steps=50")]
CatalogUriOpt = Annotated[str | None, typer.Option("--catalog-uri", help="SQLAlchemy URI of the catalog "
                                                   "(default: SQLite under home; postgresql+psycopg2://...).")]


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from tokenloom.catalog import DatasetNotFound

        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, DatasetNotFound, PermissionError) as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@contextlib.contextmanager
def _quiet_stdout(active: bool):
    """With --json, stdout carries the document alone: libraries that print (DeepSpeed, Ray)
    are sent to stderr at the file-descriptor level for the duration of the job."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _emit_json(doc) -> None:
    def default(o):
        if is_dataclass(o):
            return asdict(o)
        if isinstance(o, Decimal):
            return int(o) if o == o.to_integral_value() else float(o)
        return str(o)  # paths, timestamps, and whatever else a query returns

    sys.stdout.write(json.dumps(doc, default=default, indent=2) + "\n")


def _setup(home: Path | None, config: Path | None = None, overrides: list[str] | None = None, base=None,
           catalog_uri: str | None = None):
    from tokenloom import api
    from tokenloom.runconfig import load_run_config

    cfg = load_run_config(config, overrides or [], base=base)
    if catalog_uri:
        cfg.catalog.uri = catalog_uri
    return api, api.Home.resolve(home), cfg


def _tokenizer_setup(home, config, overrides, section: str, max_minutes: float | None, resume: bool, run):
    """A tokenizer training's setup: bare `key=value` overrides belong to `section`."""
    api, home_, cfg = _setup(home, config, [f"{section}.{o}" if "." not in o.split("=")[0] else o
                                            for o in overrides or []])
    if max_minutes is not None:
        getattr(cfg, section).max_minutes = max_minutes
    if resume and not run:
        raise ValueError("--resume needs --run NAME (the run folder to continue)")
    return api, home_, cfg


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@app.command()
@_user_errors
def demo(home: HomeOpt = None, json_out: JsonOpt = False, tiny: Annotated[bool, typer.Option(help="Test size.")] = False,
         overrides: OverridesArg = None):
    """The main job on the embedded defaults: corpus -> tokenizer -> ingest -> catalog -> train."""
    from tokenloom import api

    api_, home_, cfg = _setup(home, None, overrides, base=api.demo_config(tiny))
    with _quiet_stdout(json_out):
        summary = api_.demo(home_, cfg, tiny=tiny, progress=not json_out)
    if json_out:
        return _emit_json(summary)
    t = Table(title="TokenLoom demo", show_header=False)
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["quarantine_reasons"].items()) or "none"
    rows = [
        ("dataset", summary["dataset"]),
        ("snapshot", str(summary["snapshot_id"])),
        ("samples", f"{summary['samples']:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("quarantined inputs", f"{summary['quarantined']} ({reasons})"),
        ("text tokenizer", summary["text_tokenizer"]),
        ("visual tokenizer", f"{summary['visual_tokenizer']} ("
                             f"{'reused' if summary['visual_reused'] else 'trained now'}; held-out PSNR "
                             f"{summary['visual_heldout'].get('psnr', float('nan')):.1f} dB, codebook usage "
                             f"{summary['visual_heldout'].get('usage', float('nan')):.0%})"),
        ("audio tokenizer", f"{summary['audio_tokenizer']} ("
                            f"{'reused' if summary['audio_reused'] else 'trained now'}; held-out SI-SDR "
                            f"{summary['audio_heldout'].get('si_sdr', float('nan')):.1f} dB with all levels)"),
        ("samples by modality", ", ".join(f"{k}: {v['samples']:,} samples / {v['tokens']:,} tokens"
                                          for k, v in summary["modalities"].items())),
        ("model", f"{summary['parameters']:,} parameters ({summary['active_parameters']:,} active per token): "
                  f"{summary['model']}"),
        ("steps", str(summary["steps"])),
        ("loss first -> last", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}"),
        ("final loss by modality", ", ".join(f"{k.removeprefix('loss_')} {v:.3f}"
                                             for k, v in summary["modality_loss"].items() if v is not None)),
        ("expert balance", f"max load / mean load - 1: {summary['routing'].get('all.max_violation', float('nan')):.2f}"
                           f" (mean over layers), load entropy {summary['routing'].get('all.load_entropy', 0):.3f}"),
        ("training tokens/s", f"{summary['train_tokens_per_second']:,.0f}"),
        ("home", summary["home"]),
        ("run (metrics, loss.png, routing.png)", summary["run_dir"]),
        ("checkpoint", str(summary["checkpoint"])),
        ("wall time", f"{summary['seconds']:.0f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)


@tokenizer_train_app.command("text")
@_user_errors
def tokenizer_train_text(
    corpus: Annotated[list[Path], typer.Option("--corpus", help="Files or folders (.txt, .jsonl).")],
    vocab_size: Annotated[int | None, typer.Option("--vocab-size", help="Default: text_tokenizer.vocab_size.")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, overrides: OverridesArg = None,
):
    """Train a byte-level BPE (HF tokenizers) and publish it as a versioned bundle."""
    api, home_, cfg = _setup(home, config, overrides)
    if vocab_size is not None:
        cfg.text_tokenizer.vocab_size = vocab_size
    info = api.train_text(home_, corpus, cfg)
    doc = {"bundle_id": info.id, "path": str(info.path), "vocab_size": info.config["vocab_size"]}
    if json_out:
        return _emit_json(doc)
    console.print(f"text tokenizer [bold]{info.id}[/] ({doc['vocab_size']} tokens) at {info.path}")


@tokenizer_train_app.command("visual")
@_user_errors
def tokenizer_train_visual(
    images: Annotated[list[Path], typer.Option("--images", help="Image files or folders to train on.")],
    heldout: Annotated[list[Path] | None, typer.Option("--heldout", help="Held-out images for evaluation "
                                                       "(default: 10% of --images, chosen by path hash).")] = None,
    max_minutes: Annotated[float | None, typer.Option("--max-minutes", help="Wall-clock budget "
                                                      "(default: visual_tokenizer.max_minutes).")] = None,
    run: Annotated[str | None, typer.Option("--run", help="Run folder name under home/runs (checkpoints, metrics, "
                                            "eval grids); give an existing one with --resume to continue.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's checkpoint.")] = False,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, overrides: OverridesArg = None,
):
    """Train the dual-path visual tokenizer (CNN + ViT, cross-attention fusion, quantizer) into a bundle."""
    api, home_, cfg = _tokenizer_setup(home, config, overrides, "visual_tokenizer", max_minutes, resume, run)
    with _quiet_stdout(json_out):
        r, skipped = api.train_visual(home_, images, cfg, heldout=heldout or (), run_name=run, resume=resume,
                                      progress=not json_out)
    doc = {"bundle_id": r.bundle.id, "path": str(r.bundle.path), "num_codes": r.bundle.config["num_codes"],
           "parameters": r.parameters, "steps": r.steps, "seconds": round(r.seconds, 1),
           "images_per_second": round(r.images_per_second, 2), "heldout": r.heldout, "run_dir": r.run_dir,
           "rejected": [{"path": p, "reason": why} for p, why in skipped]}
    if json_out:
        return _emit_json(doc)
    h = r.heldout
    console.print(f"visual tokenizer [bold]{r.bundle.id}[/] ({doc['num_codes']} codes, {r.parameters:,} parameters) "
                  f"at {r.bundle.path}")
    console.print(f"  {r.steps} steps in {r.seconds:.0f} s; held-out PSNR {h['psnr']:.2f} dB, SSIM {h['ssim']:.3f}, "
                  f"codebook usage {h['usage']:.1%}, perplexity {h['perplexity']:.0f}; run {r.run_dir}")
    for path, why in skipped:
        console.print(f"  rejected {path}: {why}")


@tokenizer_eval_app.command("visual")
@_user_errors
def tokenizer_eval_visual(
    bundle: Annotated[str, typer.Option("--bundle", help="Visual bundle id or path.")],
    images: Annotated[list[Path], typer.Option("--images", help="Image files or folders.")],
    out: Annotated[Path | None, typer.Option("--out", help="Folder for grid.png and metrics.json.")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False,
):
    """PSNR, SSIM, codebook usage and perplexity on your images, and a grid of reconstructions."""
    api, home_, _ = _setup(home)
    doc = api.eval_visual(home_, bundle, images, out)
    if json_out:
        return _emit_json(doc)
    console.print(f"{doc['bundle_id']} on {doc['images']} images: PSNR {doc['psnr']:.2f} dB, SSIM {doc['ssim']:.3f}, "
                  f"codebook usage {doc['usage']:.1%} of {doc['num_codes']}, perplexity {doc['perplexity']:.0f}")
    console.print(f"  originals beside reconstructions: {doc['grid']}")
    for r in doc["rejected"]:
        console.print(f"  rejected {r['path']}: {r['reason']}")


@tokenizer_train_app.command("audio")
@_user_errors
def tokenizer_train_audio(
    audio: Annotated[list[Path], typer.Option("--audio", help="Audio files or folders (.wav, .flac, .ogg).")],
    heldout: Annotated[list[Path] | None, typer.Option("--heldout", help="Held-out audio for evaluation "
                                                       "(default: 10% of --audio, chosen by path hash).")] = None,
    max_minutes: Annotated[float | None, typer.Option("--max-minutes", help="Wall-clock budget "
                                                      "(default: audio_tokenizer.max_minutes).")] = None,
    run: Annotated[str | None, typer.Option("--run", help="Run folder name under home/runs; with --resume, "
                                            "the run to continue.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's checkpoint.")] = False,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, overrides: OverridesArg = None,
):
    """Train the RVQ audio tokenizer (SEANet encoder/decoder, ResidualVQ with quantizer dropout) into a bundle."""
    api, home_, cfg = _tokenizer_setup(home, config, overrides, "audio_tokenizer", max_minutes, resume, run)
    with _quiet_stdout(json_out):
        r, skipped = api.train_audio(home_, audio, cfg, heldout=heldout or (), run_name=run, resume=resume,
                                     progress=not json_out)
    doc = {"bundle_id": r.bundle.id, "path": str(r.bundle.path), "levels": r.bundle.config["levels"],
           "codebook_size": r.bundle.config["codebook_size"], "frame_rate": r.bundle.config["frame_rate"],
           "parameters": r.parameters, "steps": r.steps, "seconds": round(r.seconds, 1),
           "audio_seconds_per_second": round(r.seconds_of_audio_per_second, 2), "heldout": r.heldout,
           "run_dir": r.run_dir, "rejected": [{"path": p, "reason": why} for p, why in skipped]}
    if json_out:
        return _emit_json(doc)
    h = r.heldout
    console.print(f"audio tokenizer [bold]{r.bundle.id}[/] ({doc['levels']} levels x {doc['codebook_size']} codes, "
                  f"{doc['frame_rate']:g} frames/s, {r.parameters:,} parameters) at {r.bundle.path}")
    levels = ", ".join(f"k={k}: {v['si_sdr']:.1f} dB" for k, v in h["by_levels"].items())
    console.print(f"  {r.steps} steps in {r.seconds:.0f} s; held-out SI-SDR {levels}; mel {h['mel']:.3f}; "
                  f"usage per level {', '.join(f'{u:.0%}' for u in h['usage'])}; run {r.run_dir}")
    for path, why in skipped:
        console.print(f"  rejected {path}: {why}")


@tokenizer_eval_app.command("audio")
@_user_errors
def tokenizer_eval_audio(
    bundle: Annotated[str, typer.Option("--bundle", help="Audio bundle id or path.")],
    audio: Annotated[list[Path], typer.Option("--audio", help="Audio files or folders.")],
    levels: Annotated[int | None, typer.Option("--levels", help="Decode from the first K levels (default: all).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder for spectrograms.png, WAVs, metrics.json.")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False,
):
    """SI-SDR, mel distance, bitrate and codebook usage per level on your audio, with spectrograms and WAVs."""
    api, home_, _ = _setup(home)
    doc = api.eval_audio(home_, bundle, audio, levels=levels, out_dir=out)
    if json_out:
        return _emit_json(doc)
    console.print(f"{doc['bundle_id']} on {doc['clips']} files ({doc['seconds']:.1f} s): with {doc['levels']} levels "
                  f"SI-SDR {doc['si_sdr']:.2f} dB, mel {doc['mel']:.3f}, {doc['bitrate'] / 1000:.1f} kbit/s")
    for k, v in doc["by_levels"].items():
        console.print(f"  k={k}: SI-SDR {v['si_sdr']:.2f} dB, mel {v['mel']:.3f}, {v['bitrate'] / 1000:.1f} kbit/s")
    console.print(f"  codebook usage per level: {', '.join(f'{u:.0%}' for u in doc['usage'])}")
    console.print(f"  spectrograms and WAVs: {doc['files'].get('spectrograms')}")
    for r in doc["rejected"]:
        console.print(f"  rejected {r['path']}: {r['reason']}")


@tokenizer_app.command("decode")
@_user_errors
def tokenizer_decode(
    dataset: Annotated[str, typer.Option("--dataset")],
    sample: Annotated[str, typer.Option("--sample", help="sample_id of a committed sample.")],
    out: Annotated[Path, typer.Option("--out", help="File to write: PNG for images, WAV for audio "
                                      "(several: FILE-0, FILE-1, ...).")],
    levels: Annotated[int | None, typer.Option("--levels", help="Audio: decode from the first K RVQ levels.")] = None,
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, catalog_uri: CatalogUriOpt = None,
):
    """Turn a committed sample's tokens back into images and audio (and its text segments into text)."""
    api, home_, cfg = _setup(home, catalog_uri=catalog_uri)
    doc = api.decode_sample(home_, cfg, dataset, sample, out, at=at, levels=levels)
    if json_out:
        return _emit_json(doc)
    for path in doc["images"] + doc["audio"]:
        console.print(f"wrote {path}")
    for text in doc["text"]:
        console.print(f"text: {text}", highlight=False)


@app.command()
@_user_errors
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders to tokenize.")],
    dataset: Annotated[str, typer.Option("--dataset", help="Catalog dataset to commit into.")],
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Text bundle id or path (default: newest).")] = None,
    visual_tokenizer: Annotated[str | None, typer.Option("--visual-tokenizer", help="Visual bundle id or path "
                                                         "(default: newest; used when inputs hold images).")] = None,
    audio_tokenizer: Annotated[str | None, typer.Option("--audio-tokenizer", help="Audio bundle id or path "
                                                        "(default: newest; used when inputs hold audio).")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Ray cluster (default: local).")] = None,
    catalog_uri: CatalogUriOpt = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value (repeatable).")] = None,
):
    """Tokenize inputs on the modality pools (Ray Data) and commit them as one snapshot."""
    api, home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    if ray_address:
        cfg.ingest.ray.address = ray_address
    cfg.ingest.ray.progress_bars = not json_out
    with _quiet_stdout(json_out):
        r = api.ingest(home_, paths, dataset, cfg, text_bundle=tokenizer, visual_bundle=visual_tokenizer,
                       audio_bundle=audio_tokenizer)
    if json_out:
        return _emit_json(r)
    verb = "already committed as" if r.already_committed else "committed"
    console.print(f"[bold]{r.dataset}[/]: {verb} snapshot {r.snapshot_id} (job {r.job_id})")
    console.print(f"  samples {r.samples:,}  tokens {r.tokens:,}  quarantined {r.quarantined}"
                  + (f" {r.quarantine_reasons}" if r.quarantined else ""))
    for path, why in r.skipped_files:
        console.print(f"  skipped {path}: {why}")


@catalog_app.command("ls")
@_user_errors
def catalog_ls(home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """List datasets with their latest snapshot's counts."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    rows = api.catalog_ls(home_, cfg)
    if json_out:
        return _emit_json(rows)
    t = Table("dataset", "snapshot", "samples", "tokens", "quarantined (all jobs)", "snapshots")
    for r in rows:
        t.add_row(r["dataset"], str(r["snapshot_id"]), f"{r['samples']:,}", f"{r['tokens']:,}",
                  str(r["total_quarantined"]), str(r["snapshots"]))
    console.print(t)


@catalog_app.command("show")
@_user_errors
def catalog_show(name: str, at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag.")] = None,
                 home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
                 catalog_uri: CatalogUriOpt = None):
    """Counts, quarantine and lineage of a dataset snapshot (latest by default)."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    s = api.catalog_show(home_, cfg, name, at)
    if json_out:
        return _emit_json(s)
    t = Table(title=f"dataset {name}", show_header=False)
    for key in ("snapshot_id", "tags", "samples", "tokens", "total_quarantined", "job_id", "job_samples", "job_tokens",
                "quarantined", "quarantine_reasons", "data_files",
                "vocab_id", "bundle_ids", "sources_hash", "code_version"):
        t.add_row(key, str(s.get(key)))
    if s.get("timestamp_ms"):
        t.add_row("committed", _when(s["timestamp_ms"]))
    console.print(t)


@catalog_app.command("history")
@_user_errors
def catalog_history(name: str, home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Snapshots of a dataset, oldest first."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    rows = api.catalog_history(home_, cfg, name)
    if json_out:
        return _emit_json(rows)
    t = Table("snapshot", "committed", "tags", "job", "samples", "tokens", "quarantined", "total rows")
    for r in rows:
        t.add_row(str(r["snapshot_id"]), _when(r["timestamp_ms"]), ", ".join(r["tags"]), str(r["job_id"]),
                  f"{r['samples']:,}", f"{r['tokens']:,}", str(r["quarantined"]), f"{r['total_records']:,}")
    console.print(t)


AtOpt = Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")]


@catalog_app.command("stats")
@_user_errors
def catalog_stats(name: str, at: AtOpt = None, home: HomeOpt = None, json_out: JsonOpt = False,
                  config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Per-modality counts and the sequence-length histogram, stored at commit (no data is read)."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    s = api.catalog_stats(home_, cfg, name, at)
    if json_out:
        return _emit_json(s)
    st = s["stats"]
    console.print(f"[bold]{name}[/] @ {s['snapshot_id']} {('(' + ', '.join(s['tags']) + ')') if s['tags'] else ''}: "
                  f"{st['samples']:,} samples, {st['tokens']:,} tokens, {s['total_quarantined']} quarantined")
    t = Table("modality", "samples", "tokens", "share of tokens")
    for modality, m in st["modalities"].items():
        t.add_row(modality, f"{m['samples']:,}", f"{m['tokens']:,}", f"{m['tokens'] / max(st['tokens'], 1):.1%}")
    console.print(t)
    h = Table("sequence length", "samples", "")
    peak = max(st["length_hist"]) or 1
    edges = s["length_hist_edges"]
    for b, count in enumerate(st["length_hist"]):
        if count:
            h.add_row(f"[{edges[b]}, {edges[b + 1]})", f"{count:,}", "#" * max(1, round(40 * count / peak)))
    console.print(h)


@catalog_app.command("tag")
@_user_errors
def catalog_tag(name: str, tag: str, at: AtOpt = None, home: HomeOpt = None, json_out: JsonOpt = False,
                config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Name a snapshot (default: the current one); read it later with --at TAG."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    doc = api.catalog_tag(home_, cfg, name, tag, at)
    if json_out:
        return _emit_json(doc)
    console.print(f"tagged {name}@{doc['snapshot_id']} as [bold]{tag}[/]")


@catalog_app.command("query")
@_user_errors
def catalog_query(sql: str, fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
                  home: HomeOpt = None, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Read-only SQL (DuckDB) over the catalog; each dataset is a table of its current snapshot."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    if fmt not in ("table", "csv", "json"):
        raise ValueError(f"--format must be table, csv or json, got {fmt!r}")
    result = api.catalog_query(home_, cfg, sql)
    if fmt == "csv":
        import pyarrow.csv as pacsv

        sink = sys.stdout.buffer
        pacsv.write_csv(result, sink)
        sink.flush()
        return None
    rows = result.to_pylist()
    if fmt == "json":
        return _emit_json(rows)
    t = Table(*result.column_names)
    for row in rows[:200]:
        t.add_row(*(str(v) for v in row.values()))
    console.print(t)
    if len(rows) > 200:
        console.print(f"... {len(rows) - 200} more rows (use --format csv)")


@catalog_app.command("verify")
@_user_errors
def catalog_verify(name: str, at: AtOpt = None, home: HomeOpt = None, json_out: JsonOpt = False,
                   config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Re-read every data file of a snapshot and compare it with the checksum recorded at commit."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    report = api.catalog_verify(home_, cfg, name, at)
    if json_out:
        _emit_json(report)
    else:
        for p in report.problems:
            console.print(f"[red]{p['path']}[/]: {p['problem']}", highlight=False, soft_wrap=True)
        console.print(f"{name}@{report.snapshot_id}: {report.files_checked} files checked, "
                      f"{len(report.problems)} problems")
    if not report.ok:
        raise typer.Exit(1)


@catalog_app.command("gc")
@_user_errors
def catalog_gc(name: Annotated[str | None, typer.Argument(help="Dataset (default: all).")] = None,
               older_than: Annotated[float, typer.Option("--older-than", help="Grace period in hours.")] = 1.0,
               dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
               home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
               catalog_uri: CatalogUriOpt = None):
    """Delete data files no snapshot references (left by jobs that died before committing)."""
    api, home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    reports = api.catalog_gc(home_, cfg, name, older_than * 3600, dry_run)
    if json_out:
        return _emit_json(reports)
    for r in reports:
        verb = "would delete" if dry_run else "deleted"
        console.print(f"{r.dataset}: {verb} {len(r.deleted)} unreferenced files, kept {len(r.kept_recent)} younger "
                      f"than {older_than} h, {r.referenced} referenced")


@app.command()
@_user_errors
def train(
    dataset: Annotated[str, typer.Option("--dataset")],
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Checkpoint folder to continue from.")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None,
    overrides: OverridesArg = None,
):
    """Train the model on a catalog snapshot, streaming its shards (DeepSpeed, ZeRO-1)."""
    api, home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    if steps is not None:
        cfg.train.steps = steps
    with _quiet_stdout(json_out):
        snapshot_id, r = api.train(home_, dataset, cfg, at=at, progress=not json_out, resume_from=resume)
        from tokenloom.trainer.distributed import shutdown_distributed

        rank = shutdown_distributed()
    if rank != 0:  # one report per run, from rank 0
        return
    doc = {"dataset": dataset, "snapshot_id": snapshot_id, **asdict(r)}
    if json_out:
        return _emit_json(doc)
    console.print(f"trained {r.steps} steps on {dataset}@{snapshot_id}: loss {r.first_loss:.3f} -> {r.last_loss:.3f}, "
                  f"{r.tokens_per_second:,.0f} tokens/s; outputs in {r.run_dir}")
    per = ", ".join(f"{k.removeprefix('loss_')} {v:.3f}" for k, v in r.modality_loss.items() if v is not None)
    console.print(f"final loss per modality: {per}; model in {r.model_dir}")


LayersOpt = Annotated[str | None, typer.Option("--layers", help="Layers to keep, e.g. 0,2,3 or 0-2 (default: all).")]
ExpertsOpt = Annotated[str | None, typer.Option("--experts", help="Experts to keep, e.g. 0-7 (default: all).")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Experts per token (default: the model's).")]


@model_app.command("export")
@_user_errors
def model_export(
    source: Annotated[Path, typer.Argument(help="A training run folder or a model folder.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the smaller model.")],
    layers: LayersOpt = None, experts: ExpertsOpt = None, top_k: TopKOpt = None, json_out: JsonOpt = False,
):
    """Write a smaller standalone model: fewer layers, fewer experts, a smaller top-k (elastic sub-model)."""
    from tokenloom import api

    doc = api.model_export(source, out, layers, experts, top_k)
    if json_out:
        return _emit_json(doc)
    console.print(f"exported {doc['n_layers']} layers, {doc['n_experts']} experts, top-{doc['top_k']}: "
                  f"{doc['parameters']:,} of {doc['source_parameters']:,} parameters -> {doc['out']}")


@model_app.command("eval")
@_user_errors
def model_eval(
    source: Annotated[Path, typer.Argument(help="A training run folder or a model folder.")],
    dataset: Annotated[str, typer.Option("--dataset")],
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    batches: Annotated[int, typer.Option("--batches", help="Batches to evaluate.")] = 8,
    layers: LayersOpt = None, experts: ExpertsOpt = None, top_k: TopKOpt = None,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None,
    overrides: OverridesArg = None,
):
    """Loss per modality of a model (optionally restricted to a sub-model) on a catalog snapshot."""
    api, home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    doc = api.model_eval(home_, cfg, source, dataset, at, batches, layers, experts, top_k)
    if json_out:
        return _emit_json(doc)
    per = ", ".join(f"{m} {doc[f'loss_{m}']:.3f}" for m in ("text", "image", "audio") if doc[f"loss_{m}"] is not None)
    console.print(f"{dataset}@{doc['snapshot_id']}: loss {doc['loss']:.3f} ({per}) over {doc['tokens']:,.0f} tokens")


def main() -> None:  # pragma: no cover
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
