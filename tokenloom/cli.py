"""The `tokenloom` command: a thin shell over `tokenloom.jobs` that parses, calls a job, prints.

Every reporting command takes `--json` (one JSON document on stdout, nothing else; `catalog
query` says `--format json`) and `--home`. Mistakes a user can fix (unknown dataset, missing
path, bad config, damaged bundle) print one line on stderr and exit with status 2; anything
else is a bug and keeps its traceback. Options that take paths (`--images`, `--audio`,
`--corpus`, `--heldout`) take several at once (`--images a.png b/ c.jpg`) or repeated.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
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
pools_app = typer.Typer(help="Long-lived tokenizer services (Ray Serve): up, status, scale, down.",
                        no_args_is_help=True)
app.add_typer(pools_app, name="pools")
app.add_typer(model_app, name="model")

console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)

HomeOpt = Annotated[Path | None, typer.Option("--home", help="State folder (default ./.tokenloom or TOKENLOOM_HOME).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="Run config: a TOML file or a recipe name from "
                                                "configs/ (demo, tiny, gpu).")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Config overrides: key=value, e.g. train.steps=50")]
CatalogUriOpt = Annotated[str | None, typer.Option("--catalog-uri", help="SQLAlchemy URI of the catalog "
                                                   "(default: SQLite under home; postgresql+psycopg2://...).")]
HeldoutOpt = Annotated[list[Path] | None, typer.Option("--heldout", help="Held-out files for evaluation (default: "
                                                       "10% of the inputs, chosen by path hash).")]
MinutesOpt = Annotated[float | None, typer.Option("--max-minutes", help="Wall-clock budget (default: the config's).")]
RunOpt = Annotated[str | None, typer.Option("--run", help="Run folder name under home/runs (checkpoints, metrics, "
                                            "evaluations); with --resume, the run to continue.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue from the run's checkpoint.")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Folder for the pictures, recordings and metrics.json.")]
BundleOpt = Annotated[str, typer.Option("--bundle", help="Bundle id, path, or `latest`.")]
MULTI_PATH_OPTIONS = ("--images", "--audio", "--corpus", "--heldout")
_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from tokenloom.jobs.home import USER_ERRORS

        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
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
        with contextlib.redirect_stdout(sys.stderr):  # and Python-level prints, when stdout is not fd 1
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


def _setup(home: Path | None, config: Path | str | None = None, overrides: list[str] | None = None,
           catalog_uri: str | None = None):
    """(home, run config): the defaults, the config file or recipe, the overrides, the catalog URI."""
    from tokenloom.jobs.config import load_run_config
    from tokenloom.jobs.home import Home

    cfg = load_run_config(config, overrides or [])
    if catalog_uri:
        cfg.catalog.uri = catalog_uri
    return Home.resolve(home), cfg


def expand_multi_path_options(argv: list[str]) -> list[str]:
    """`--images a b c` -> `--images a --images b --images c`, for the options that take paths:
    the values run until the next option or `key=value` override."""
    out, taking = [], None
    for arg in argv:
        if arg.startswith("-"):
            taking = arg if arg in MULTI_PATH_OPTIONS else None
            out.append(arg)
        elif taking and out[-1] != taking and not _OVERRIDE.match(arg):
            out += [taking, arg]
        else:
            if taking and out[-1] != taking:
                taking = None
            out.append(arg)
    return out


def parse_indices(text: str | None, what: str) -> tuple[int, ...] | None:
    """'0,2,5' or '0-3,7' -> sorted unique indices (None for None); a clear error otherwise."""
    if text is None:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"{what} takes indices like 0,2,5 or 0-3, got {text!r}") from None
    if not out:
        raise ValueError(f"{what} {text!r} names no index")
    return tuple(sorted(out))


class _LazyCatalogJobs:
    """`tokenloom.jobs.catalog`, imported on first use (the CLI starts without pyiceberg)."""

    def __getattr__(self, name):
        from tokenloom.jobs import catalog

        return getattr(catalog, name)


catalog_jobs = _LazyCatalogJobs()


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@app.command()
@_user_errors
def demo(home: HomeOpt = None, json_out: JsonOpt = False,
         config: Annotated[str, typer.Option("--config", help="Recipe name or TOML file.")] = "demo",
         data_only: Annotated[bool, typer.Option("--data-only", help="Only write the sample data into "
                                                 "home/corpus and print where.")] = False,
         overrides: OverridesArg = None):
    """The main job on a recipe (configs/demo.toml): sample data -> tokenizers -> ingest -> catalog -> train."""
    from tokenloom.jobs import demo as demo_job

    home_, cfg = _setup(home, config, overrides)
    if data_only:
        doc = demo_job.write_data(home_, cfg)
        return _emit_json(doc) if json_out else console.print("\n".join(f"{k}: {v}" for k, v in doc.items()))
    with _quiet_stdout(json_out):
        summary = demo_job.demo(home_, cfg, progress=not json_out)
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
        ("filtered (quality)", f"{summary['filtered']} ({_counts(summary['filter_counts'])})"),
        ("duplicates dropped", f"{summary['duplicates']} ({_counts(summary['duplicate_counts'])})"),
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
        ("training loss by modality", ", ".join(f"{k.removeprefix('loss_')} {v:.3f}"
                                                for k, v in summary["modality_loss"].items() if v is not None)
                                      + " (last 10 steps)"),
        ("held-out loss by modality", held_out_line(summary["val_loss"])),
        ("expert balance", f"max load / mean load - 1: {summary['routing'].get('all.max_violation', float('nan')):.2f}"
                           f" (mean over layers), load entropy {summary['routing'].get('all.load_entropy', 0):.3f}"),
        ("training tokens/s", f"{summary['train_tokens_per_second']:,.0f}"),
        ("generated (poor at demo size)", f"caption of {Path(summary['generations']['photo']).name}: "
                                          f"{summary['generations']['caption']['text']!r}; image "
                                          f"{summary['generations']['image']['out']}; speech "
                                          f"{summary['generations']['speech']['out']}"),
        ("home", summary["home"]),
        ("run (metrics, loss.png, routing.png)", summary["run_dir"]),
        ("report (open in a browser)", summary["report"]),
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
    from tokenloom.jobs import tokenizer as jobs

    home_, cfg = _setup(home, config, _in_section(overrides, "text_tokenizer"))
    if vocab_size is not None:
        cfg.text_tokenizer.vocab_size = vocab_size
    info = jobs.train_text(home_, corpus, cfg)
    doc = {"bundle_id": info.id, "path": str(info.path), "vocab_size": info.config["vocab_size"]}
    if json_out:
        return _emit_json(doc)
    console.print(f"text tokenizer [bold]{info.id}[/] ({doc['vocab_size']} tokens) at {info.path}")


def _in_section(overrides: list[str] | None, section: str) -> list[str]:
    """Bare `key=value` overrides of a tokenizer command belong to its config section."""
    return [f"{section}.{o}" if "." not in o.split("=")[0] else o for o in overrides or []]


def _train_media(kind: str, inputs, heldout, max_minutes, run, resume, home, json_out, config, overrides) -> None:
    """`tokenizer train visual|audio`: one path for every media tokenizer (tokenizers.registry)."""
    from tokenloom.jobs import tokenizer as jobs

    section = jobs.config_section(kind)
    home_, cfg = _setup(home, config, _in_section(overrides, section))
    if max_minutes is not None:
        getattr(cfg, section).max_minutes = max_minutes
    with _quiet_stdout(json_out):
        trained, rejected = jobs.train(home_, kind, inputs, cfg, heldout=heldout or (), run_name=run, resume=resume,
                                       progress=not json_out)
    doc = {"bundle_id": trained.bundle.id, "path": str(trained.bundle.path), **trained.summary,
           "rejected": [{"path": p, "reason": why} for p, why in rejected]}
    if json_out:
        return _emit_json(doc)
    console.print(f"{kind} tokenizer [bold]{doc['bundle_id']}[/] at {doc['path']}: {doc['parameters']:,} parameters, "
                  f"{doc['steps']} steps in {doc['seconds']:.0f} s; run {doc['run_dir']}")
    console.print(f"  held-out: {_metrics_line(doc['heldout'])}")
    for r in doc["rejected"]:
        console.print(f"  rejected {r['path']}: {r['reason']}")


def _metrics_line(metrics: dict) -> str:
    """Held-out or evaluation metrics of any media tokenizer as one line."""
    parts = []
    for key, unit in (("psnr", " dB"), ("ssim", ""), ("si_sdr", " dB"), ("mel", ""), ("perplexity", "")):
        if isinstance(metrics.get(key), int | float):
            parts.append(f"{key.upper().replace('_', '-')} {metrics[key]:.3f}{unit}")
    usage = metrics.get("usage")
    if usage is not None:
        parts.append("codebook usage " + (f"{usage:.1%}" if isinstance(usage, float) else
                                          "per level " + ", ".join(f"{u:.0%}" for u in usage)))
    for k, v in (metrics.get("by_levels") or {}).items():
        parts.append(f"k={k}: SI-SDR {v['si_sdr']:.2f} dB at {v['bitrate'] / 1000:.1f} kbit/s")
    return "; ".join(parts)


ImagesOpt = Annotated[list[Path], typer.Option("--images", help="Image files or folders.")]
AudioOpt = Annotated[list[Path], typer.Option("--audio", help="Audio files or folders (.wav, .flac, .ogg).")]


def _media_train_command(kind: str, inputs: typer.models.OptionInfo, doc: str) -> None:
    """Register `tokenizer train KIND`: the same options for every media tokenizer but its inputs'."""

    def command(inputs_: list[Path], heldout: HeldoutOpt = None, max_minutes: MinutesOpt = None, run: RunOpt = None,
                resume: ResumeOpt = False, home: HomeOpt = None, json_out: JsonOpt = False,
                config: ConfigOpt = None, overrides: OverridesArg = None):
        _train_media(kind, inputs_, heldout, max_minutes, run, resume, home, json_out, config, overrides)

    command.__annotations__["inputs_"] = Annotated[list[Path], inputs]  # the only per-kind option
    command.__doc__ = doc
    tokenizer_train_app.command(kind)(_user_errors(command))


_media_train_command("visual", ImagesOpt.__metadata__[0], "Train the dual-path visual tokenizer (CNN + ViT, "
                     "cross-attention fusion, quantizer) into a bundle.")
_media_train_command("audio", AudioOpt.__metadata__[0], "Train the RVQ audio tokenizer (SEANet encoder/decoder, "
                     "ResidualVQ with quantizer dropout) into a bundle.")


def _eval_media(kind: str, bundle: str, inputs, out, home, json_out, **options) -> None:
    """`tokenizer eval visual|audio`: metrics of a bundle on anyone's files."""
    from tokenloom.jobs import tokenizer as jobs

    home_, _ = _setup(home)
    doc = jobs.evaluate(home_, kind, bundle, inputs, out, **{k: v for k, v in options.items() if v is not None})
    if json_out:
        return _emit_json(doc)
    count = doc.get("images", doc.get("clips"))
    console.print(f"{doc['bundle_id']} on {count} files: {_metrics_line(doc)}")
    for path in ([doc["grid"]] if doc.get("grid") else []) + list((doc.get("files") or {}).values())[:1]:
        console.print(f"  originals beside reconstructions: {path}")
    for r in doc["rejected"]:
        console.print(f"  rejected {r['path']}: {r['reason']}")


@tokenizer_eval_app.command("visual")
@_user_errors
def tokenizer_eval_visual(bundle: BundleOpt, images: ImagesOpt, out: OutOpt = None, home: HomeOpt = None,
                          json_out: JsonOpt = False):
    """PSNR, SSIM, codebook usage and perplexity on your images, and a grid of reconstructions."""
    _eval_media("visual", bundle, images, out, home, json_out)


@tokenizer_eval_app.command("audio")
@_user_errors
def tokenizer_eval_audio(bundle: BundleOpt, audio: AudioOpt, out: OutOpt = None, home: HomeOpt = None,
                         json_out: JsonOpt = False,
                         levels: Annotated[int | None, typer.Option("--levels", help="Decode from the first K levels "
                                                                    "(default: all).")] = None):
    """SI-SDR, mel distance, bitrate and codebook usage per level on your audio, with spectrograms and WAVs."""
    _eval_media("audio", bundle, audio, out, home, json_out, levels=levels)


@tokenizer_app.command("decode")
@_user_errors
def tokenizer_decode(
    dataset: Annotated[str, typer.Option("--dataset")],
    sample: Annotated[str, typer.Option("--sample", help="sample_id of a committed sample.")],
    out: Annotated[Path, typer.Option("--out", help="File to write: PNG for images, WAV for audio, MP4 for "
                                      "video (several: FILE-0, FILE-1, ...).")],
    levels: Annotated[int | None, typer.Option("--levels", help="Audio: decode from the first K RVQ levels.")] = None,
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, catalog_uri: CatalogUriOpt = None,
):
    """Turn a committed sample's tokens back into images, audio and video (and its text segments into text)."""
    from tokenloom.jobs import tokenizer as jobs

    home_, cfg = _setup(home, catalog_uri=catalog_uri)
    doc = jobs.decode_sample(home_, cfg, dataset, sample, out, at=at, levels=levels)
    if json_out:
        return _emit_json(doc)
    for path in doc["images"] + doc["audio"] + doc["videos"]:
        console.print(f"wrote {path}")
    for text in doc["text"]:
        console.print(f"text: {text}", highlight=False)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


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
    sync: Annotated[bool, typer.Option("--sync", help="Also delete the samples of ingested files that are gone "
                                                      "from the input folders.")] = False,
    pools: Annotated[str | None, typer.Option("--pools", help="job: this job's own pools (default); service: the "
                                                              "services `tokenloom pools up` started.")] = None,
):
    """Tokenize inputs on the modality pools (Ray Data) and commit them as one snapshot: new files
    are tokenized, a changed file's samples are replaced in the same snapshot, unchanged files are
    skipped."""
    from tokenloom.jobs.ingest import ingest as run_ingest

    home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    if ray_address:
        cfg.ingest.ray.address = ray_address
    if pools:
        cfg.ingest.pools_mode = pools
        cfg.ingest.validate()
    cfg.ingest.ray.progress_bars = not json_out
    with _quiet_stdout(json_out):
        r = run_ingest(home_, paths, dataset, cfg, {"text": tokenizer, "visual": visual_tokenizer,
                                                    "audio": audio_tokenizer}, sync=sync)
    if json_out:
        return _emit_json(r)
    verb = "already committed as" if r.already_committed else "committed"
    console.print(f"[bold]{r.dataset}[/]: {verb} snapshot {r.snapshot_id} (job {r.job_id})")
    console.print(f"  samples {r.samples:,}  tokens {r.tokens:,}  quarantined {r.quarantined}"
                  + (f" {r.quarantine_reasons}" if r.quarantined else ""))
    if r.filtered or r.duplicates:
        console.print(f"  filtered {r.filtered} {r.filter_counts}  duplicates dropped {r.duplicates} {r.duplicate_counts}")
    if r.sources:
        console.print("  input files: " + ", ".join(f"{v} {k}" for k, v in r.sources.items())
                      + (" (only new and changed files are tokenized)" if r.sources.get("unchanged") else "")
                      + (f"; {r.deleted_samples} old samples deleted" if r.deleted_samples else ""))
    for path, why in r.skipped_files:
        console.print(f"  skipped {path}: {why}")
    for line in pool_lines(r.pools):
        console.print("  " + line)


@catalog_app.command("ls")
@_user_errors
def catalog_ls(home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """List datasets with their latest snapshot's counts."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    rows = catalog_jobs.ls(home_, cfg)
    if json_out:
        return _emit_json(rows)
    t = Table("dataset", "snapshot", "samples", "tokens", "quarantined (all jobs)", "snapshots")
    for r in rows:
        t.add_row(r["dataset"], str(r["snapshot_id"]), f"{r['samples']:,}", f"{r['tokens']:,}",
                  str(r["total_quarantined"]), str(r["snapshots"]))
    console.print(t)


def pool_lines(pools: dict[str, dict]) -> list[str]:
    """One line per tokenizer pool of a job: what it ran as, records and tokens, rates and busy share."""
    def rate(x):
        return f"{x:,.0f}/s" if x is not None else "-"

    def how(p):
        return "service" if p["mode"] == "service" else f"{p['mode']}, {p['min_actors']}-{p['max_actors']} actors"

    def busy(p):
        return f", busy {p['busy_fraction']:.0%}" if p.get("busy_fraction") is not None else ""

    return [f"{m} pool ({how(p)}): {p['records']:,} records, {p['tokens']:,} tokens in {p['seconds']:.1f} s "
            f"({rate(p['records_per_second'])} records, {rate(p['tokens_per_second'])} tokens){busy(p)}, "
            f"on {len(p.get('nodes') or {})} node(s)" for m, p in sorted(pools.items())]


def _print_services(doc: dict) -> None:
    t = Table(title=f"tokenizer services at {doc['http']} ({doc['application']})")
    for col in ("service", "status", "replicas", "bounds", "label"):
        t.add_column(col)
    for name, svc in doc["services"].items():
        bounds = f"{svc['min_replicas']}-{svc['max_replicas']}" if "min_replicas" in svc else "-"
        t.add_row(name, svc["status"], ", ".join(f"{k.lower()} {v}" for k, v in svc["replicas"].items()) or "0",
                  bounds, svc.get("label") or "-")
    console.print(t)


@pools_app.command("up")
@_user_errors
def pools_up(dataset: Annotated[str | None, typer.Option("--dataset", help="Answer HTTP with this dataset's "
                                                                            "vocabulary (default: a new one's).")] = None,
             home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
             overrides: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value.")] = None):
    """Deploy a tokenizer service per modality (the newest bundles) and the HTTP gateway on 127.0.0.1."""
    from tokenloom.jobs import pools

    home_, cfg = _setup(home, config, overrides)
    doc = pools.up(home_, cfg, dataset)
    return _emit_json(doc) if json_out else _print_services(doc)


@pools_app.command("status")
@_user_errors
def pools_status(home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None):
    """Each service's replicas by state and its replica bounds."""
    from tokenloom.jobs import pools

    home_, cfg = _setup(home, config)
    doc = pools.status(home_, cfg)
    return _emit_json(doc) if json_out else _print_services(doc)


@pools_app.command("scale")
@_user_errors
def pools_scale(modality: Annotated[str, typer.Argument(help="text, image or audio.")],
                min_replicas: Annotated[int, typer.Option("--min", help="Fewest replicas.")],
                max_replicas: Annotated[int, typer.Option("--max", help="Most replicas.")],
                home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None):
    """New replica bounds for one service (the autoscaler moves between them)."""
    from tokenloom.jobs import pools

    home_, cfg = _setup(home, config)
    doc = pools.scale(home_, cfg, modality, min_replicas, max_replicas)
    return _emit_json(doc) if json_out else _print_services(doc)


@pools_app.command("down")
@_user_errors
def pools_down(home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None):
    """Delete the services (and stop the local Ray head `pools up` started)."""
    from tokenloom.jobs import pools

    home_, cfg = _setup(home, config)
    doc = pools.down(home_, cfg)
    return _emit_json(doc) if json_out else console.print("tokenizer services deleted"
                                                          + (", local Ray stopped" if doc["stopped_ray"] else ""))


@catalog_app.command("show")
@_user_errors
def catalog_show(name: str, at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag.")] = None,
                 home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
                 catalog_uri: CatalogUriOpt = None):
    """Counts, quarantine and lineage of a dataset snapshot (latest by default)."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    s = catalog_jobs.show(home_, cfg, name, at)
    if json_out:
        return _emit_json(s)
    t = Table(title=f"dataset {name}", show_header=False)
    for key in ("snapshot_id", "tags", "samples", "tokens", "total_quarantined", "total_filtered", "total_duplicates",
                "job_id", "job_samples", "job_tokens", "quarantined", "quarantine_reasons", "filtered", "filter_counts",
                "duplicates", "duplicate_counts", "deleted_samples", "data_files",
                "vocab_id", "bundle_ids", "sources_hash", "code_version"):
        t.add_row(key, str(s.get(key)))
    if len(s.get("vocab_history", [])) > 1:  # the manifest grew by appended ranges
        t.add_row("vocab_history", ", ".join(f"{v['vocab_id']} (from snapshot {v['snapshot_id']})"
                                             for v in s["vocab_history"]))
    if s.get("timestamp_ms"):
        t.add_row("committed", _when(s["timestamp_ms"]))
    for line in pool_lines(s.get("pools") or {}):
        t.add_row("pool", line)
    console.print(t)


@catalog_app.command("history")
@_user_errors
def catalog_history(name: str, home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Snapshots of a dataset, oldest first."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    rows = catalog_jobs.history(home_, cfg, name)
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
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    s = catalog_jobs.stats(home_, cfg, name, at)
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
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    doc = catalog_jobs.tag(home_, cfg, name, tag, at)
    if json_out:
        return _emit_json(doc)
    console.print(f"tagged {name}@{doc['snapshot_id']} as [bold]{tag}[/]")


@catalog_app.command("query")
@_user_errors
def catalog_query(sql: str, fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
                  at: Annotated[list[str] | None, typer.Option(
                      "--at", help="SNAPSHOT|TAG (the one dataset that has it) or NAME=SNAPSHOT|TAG; repeatable. "
                      "All of that dataset's tables are read at that snapshot.")] = None,
                  home: HomeOpt = None, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Read-only SQL (DuckDB) over the catalog. Each dataset NAME is a table of its samples; NAME.samples,
    NAME.quarantine, NAME.filtered, NAME.duplicates and NAME.sources are its tables at the same snapshot
    (quote a name with dashes: "my-data".quarantine)."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    if fmt not in ("table", "csv", "json"):
        raise ValueError(f"--format must be table, csv or json, got {fmt!r}")
    result = catalog_jobs.query(home_, cfg, sql, at)
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


@catalog_app.command("diff")
@_user_errors
def catalog_diff(name: str, a: Annotated[str, typer.Argument(help="Snapshot id or tag to compare from.")],
                 b: Annotated[str, typer.Argument(help="Snapshot id or tag to compare to.")],
                 home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
                 catalog_uri: CatalogUriOpt = None):
    """What snapshot B holds that A does not and the reverse: samples per modality mix, sources."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    d = catalog_jobs.diff(home_, cfg, name, a, b)
    if json_out:
        return _emit_json(d)
    sm, src = d["samples"], d["sources"]
    console.print(f"[bold]{name}[/] {d['from_snapshot']} -> {d['to_snapshot']}: samples +{sm['added']:,} "
                  f"-{sm['removed']:,}; sources +{len(src['added'])} -{len(src['removed'])} "
                  f"~{len(src['changed'])}")
    t = Table("modalities", "added", "removed")
    for mix, counts in sm["by_modalities"].items():
        t.add_row(mix, f"{counts['added']:,}", f"{counts['removed']:,}")
    console.print(t)
    s = Table("source", "change")
    for what in ("added", "removed", "changed"):
        for path in src[what]:
            s.add_row(path, what)
    if s.row_count:
        console.print(s)


@catalog_app.command("expire")
@_user_errors
def catalog_expire(name: str,
                   older_than: Annotated[float, typer.Option("--older-than", help="Expire snapshots committed more "
                                                             "than this many hours ago.")],
                   retain_last: Annotated[int, typer.Option("--retain-last", help="Always keep the N newest "
                                                            "snapshots.")] = 1,
                   dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
                   home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None,
                   catalog_uri: CatalogUriOpt = None):
    """Expire old snapshots (never the current or a tagged one); totals, lineage and the source index
    stay exact. Run `catalog gc` afterwards to delete the files only they needed."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    r = catalog_jobs.expire(home_, cfg, name, older_than * 3600, retain_last, dry_run)
    if json_out:
        return _emit_json(r)
    verb = "would expire" if dry_run else "expired"
    console.print(f"{name}: {verb} {len(r.expired)} snapshots, kept {len(r.kept)}"
                  + (f" ({', '.join(map(str, r.expired))})" if r.expired else ""))


@catalog_app.command("verify")
@_user_errors
def catalog_verify(name: str, at: AtOpt = None, home: HomeOpt = None, json_out: JsonOpt = False,
                   config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None):
    """Re-read every data file of a snapshot and compare it with the checksum recorded at commit."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    report = catalog_jobs.verify(home_, cfg, name, at)
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
    """Delete files no live snapshot needs: data files left by jobs that died before committing or
    needed only by expired snapshots, and unused manifests and metadata files."""
    home_, cfg = _setup(home, config, catalog_uri=catalog_uri)
    reports = catalog_jobs.gc(home_, cfg, name, older_than * 3600, dry_run)
    if json_out:
        return _emit_json(reports)
    for r in reports:
        verb = "would delete" if dry_run else "deleted"
        console.print(f"{r.dataset}: {verb} {len(r.deleted)} unreferenced data files and "
                      f"{len(r.deleted_metadata)} metadata files, kept {len(r.kept_recent)} younger "
                      f"than {older_than} h, {r.referenced} referenced")


@app.command()
@_user_errors
def train(
    dataset: Annotated[str | None, typer.Option("--dataset", help="The dataset to train on (or --mix, or "
                                                "[[stream.sources]] in the config).")] = None,
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    mix: Annotated[str | None, typer.Option("--mix", help="A mixture of datasets and weights, e.g. "
                                            "a=0.7,b=0.3 (rows drawn by weight, seeded).")] = None,
    follow: Annotated[bool, typer.Option("--follow", help="Keep reading what ingestion commits to the datasets "
                                         "while training (each new snapshot read once, in commit order).")] = False,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    run: Annotated[str | None, typer.Option("--run", help="Run folder name under home/runs (default: "
                                            "DATASET-TIME-ID, or the resumed run's).")] = None,
    resume: Annotated[str | None, typer.Option("--resume", help="Continue a run from its newest complete "
                                               "checkpoint: a run name, a run folder or a checkpoint folder.")] = None,
    init_from: Annotated[str | None, typer.Option("--init-from", help="Start a new run from a trained model's "
                                                  "weights (a model folder, a run folder or run name).")] = None,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None,
    overrides: OverridesArg = None,
):
    """Train the model on a catalog snapshot, streaming its shards (DeepSpeed, ZeRO-1); checkpoints
    every train.checkpoint_every steps (atomically; the newest train.keep_last are kept)."""
    home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    _train_and_report(home_, cfg, dataset, at, steps, run, resume, init_from, json_out, mix=mix, follow=follow)


@app.command()
@_user_errors
def finetune(
    model: Annotated[str, typer.Argument(help="The model to fine-tune: a model folder, a run folder or run name.")],
    dataset: Annotated[str, typer.Option("--dataset")],
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    run: Annotated[str | None, typer.Option("--run", help="Run folder name under home/runs.")] = None,
    unfreeze_every: Annotated[int, typer.Option("--unfreeze-every", help="Progressive unfreezing: the last layer "
                                                "trains first, one more every N steps (0: all at once).")] = 0,
    home: HomeOpt = None, json_out: JsonOpt = False,
    config: Annotated[str | None, typer.Option("--config", help="A config file or recipe (default: the finetune "
                                               "recipe, configs/finetune.toml).")] = "finetune",
    catalog_uri: CatalogUriOpt = None, overrides: OverridesArg = None,
):
    """Fine-tune a trained model on a dataset: a new run from its weights with the fine-tuning recipe
    (lr 2e-5, warm-up then cosine, clipping 1.0, weight decay 0.01, held-out loss per modality at
    every checkpoint)."""
    home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    if unfreeze_every:
        if unfreeze_every < 0:
            raise ValueError(f"--unfreeze-every must be >= 0, got {unfreeze_every}")
        cfg.train.unfreeze_every, cfg.train.optimizer = unfreeze_every, "lazy_adamw"
    _train_and_report(home_, cfg, dataset, at, steps, run, None, model, json_out)


def _train_and_report(home_, cfg, dataset: str | None, at: str | None, steps: int | None, run: str | None,
                      resume: str | None, init_from: str | None, json_out: bool, mix: str | None = None,
                      follow: bool = False) -> None:
    from tokenloom.jobs import train as jobs

    if steps is not None:
        cfg.train.steps = steps
    with _quiet_stdout(json_out):
        snapshot_id, r = jobs.train(home_, dataset, cfg, at=at, progress=not json_out, run_name=run,
                                    resume_from=resume, refuse_existing=True, init_from=init_from, mix=mix,
                                    follow=follow)
        rank = jobs.leave_process_group()
    if rank != 0:  # one report per run, from rank 0
        return
    dataset = "+".join(s.dataset for s in cfg.stream.sources)
    doc = {"dataset": dataset, "snapshot_id": snapshot_id, **asdict(r)}
    if json_out:
        return _emit_json(doc)
    console.print(f"trained {r.steps} steps on {dataset}@{snapshot_id}: loss {r.first_loss:.3f} -> {r.last_loss:.3f}, "
                  f"{r.tokens_per_second:,.0f} tokens/s ({r.data_share:.1%} of it reading and packing rows); "
                  f"outputs in {r.run_dir}")
    if r.checkpoint:
        console.print(f"checkpoint: {r.checkpoint}")
    per = ", ".join(f"{k.removeprefix('loss_')} {v:.3f}" for k, v in r.modality_loss.items() if v is not None)
    console.print(f"training loss per modality (last 10 steps): {per}; model in {r.model_dir}")
    console.print(f"held-out loss per modality: {held_out_line(r.val_loss)}")
    if len(r.tokens_by_source) > 1 or r.segments:
        console.print("training targets per source: " + ", ".join(f"{k} {v:,}" for k, v in r.tokens_by_source.items())
                      + (f"; followed {len(r.segments)} new snapshot(s)" if r.segments else ""))


def held_out_line(val_loss: dict) -> str:
    """A held-out evaluation (`trainer.TrainResult.val_loss`) as one line: each modality's loss and
    the targets it rests on, or why there is none."""
    per = {m: v for m, v in val_loss.items() if isinstance(v, dict)}
    reasons = {v.get("reason") for v in per.values()}
    if not per or all(v["loss"] is None for v in per.values()) and len(reasons) == 1:
        return f"none: {reasons.pop() if per else 'not evaluated'}"
    parts = [f"{m} {v['loss']:.3f} ({v['tokens']:,} targets)" if v["loss"] is not None else f"{m}: none ({v['reason']})"
             for m, v in per.items()]
    return ", ".join(parts) + f"; after step {val_loss['step']}, {val_loss['rows']:,} held-out rows"


LayersOpt = Annotated[str | None, typer.Option("--layers", help="Layers to keep, e.g. 0,2,3 or 0-2 (default: all).")]
ExpertsOpt = Annotated[str | None, typer.Option("--experts", help="Experts to keep, e.g. 0-7 (default: all).")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Experts per token (default: the model's).")]


@model_app.command("export")
@_user_errors
def model_export(
    source: Annotated[Path, typer.Argument(help="A training run folder or a model folder.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the smaller model.")],
    layers: LayersOpt = None, experts: ExpertsOpt = None, top_k: TopKOpt = None,
    tier: Annotated[str | None, typer.Option("--tier", help="A deployment tier instead of explicit cuts: full, mid "
                                             "(~60% of layers and experts) or edge (~35%, top-1).")] = None,
    json_out: JsonOpt = False,
):
    """Write a smaller standalone model: fewer layers, fewer experts, a smaller top-k (elastic sub-model)."""
    from tokenloom.jobs import train as jobs

    doc = jobs.export(source, out, parse_indices(layers, "--layers"), parse_indices(experts, "--experts"), top_k,
                      tier)
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
    tiers: Annotated[bool, typer.Option("--tiers", help="One table over the deployment tiers (full, mid, edge): "
                                        "parameters, loss per modality, generation speed, memory.")] = False,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None,
    overrides: OverridesArg = None,
):
    """Loss per modality of a model (optionally restricted to a sub-model) on a catalog snapshot."""
    from tokenloom.jobs import train as jobs

    home_, cfg = _setup(home, config, overrides, catalog_uri=catalog_uri)
    if tiers:
        if (layers, experts, top_k) != (None, None, None):
            raise ValueError("--tiers evaluates the documented tier cuts; give it without --layers/--experts/--top-k")
        doc = jobs.evaluate_tiers(home_, cfg, source, dataset, at, batches)
        if json_out:
            return _emit_json(doc)
        table = Table(title=f"deployment tiers of {doc['model']} on {dataset}@{doc['snapshot_id']}")
        for column in ("tier", "layers", "experts", "top-k", "parameters", "active", "loss", "text", "image",
                       "audio", "gen tokens/s", "memory MB"):
            table.add_column(column, justify="left" if column == "tier" else "right")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for r in doc["tiers"]:
            table.add_row(r["tier"], str(r["n_layers"]), str(r["n_experts"]), str(r["top_k"]), f"{r['parameters']:,}",
                          f"{r['active_parameters']:,}", fmt(r["loss"]), fmt(r["loss_text"]), fmt(r["loss_image"]),
                          fmt(r["loss_audio"]), f"{r['tokens_per_second']:,.0f}", f"{r['memory_bytes'] / 2**20:.1f}")
        console.print(table)
        return
    doc = jobs.evaluate(home_, cfg, source, dataset, at, batches, parse_indices(layers, "--layers"),
                        parse_indices(experts, "--experts"), top_k)
    if json_out:
        return _emit_json(doc)
    per = ", ".join(f"{k.removeprefix('loss_')} {v:.3f}" for k, v in doc.items()
                    if k.startswith("loss_") and v is not None)
    console.print(f"{dataset}@{doc['snapshot_id']}: loss {doc['loss']:.3f} ({per}) over {doc['tokens']:,.0f} tokens")


def parse_grid(text: str | None) -> tuple[int, int] | None:
    """`16x16` -> (16, 16)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"--grid takes ROWSxCOLS, e.g. 16x16; got {text!r}")
    return int(match.group(1)), int(match.group(2))


@app.command("task-data")
@_user_errors
def task_data_command(
    task: Annotated[str, typer.Option("--task", help="A verifiable task: sort, add or countdown.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for <task>.jsonl (ingest it for the SFT start).")],
    records: Annotated[int, typer.Option("--records")] = 4000,
    buckets: Annotated[str, typer.Option("--buckets", help="Difficulty buckets, e.g. 0,1 (default: all).")] = "",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    json_out: JsonOpt = False,
):
    """Write a task's supervised records (prompt and answer) for the SFT model RL starts from."""
    from tokenloom.jobs.rl import task_data

    doc = task_data(task, out, records, buckets, seed)
    if json_out:
        return _emit_json(doc)
    console.print(f"wrote {doc['records']:,} {doc['task']} records ({', '.join(doc['buckets'])}) to {doc['path']}")


@app.command("rl")
@_user_errors
def rl_command(
    model: Annotated[str, typer.Argument(help="The starting model: a model folder, a run folder or run name.")],
    task: Annotated[str | None, typer.Option("--task", help="sort, add or countdown (default: rl.task).")] = None,
    buffer: Annotated[str | None, typer.Option("--buffer", help="urb (default), sync or april.")] = None,
    hints: Annotated[bool, typer.Option("--hints", help="Adaptive hints (AHRL) for hard buckets.")] = False,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    rollout_actors: Annotated[int | None, typer.Option("--rollout-actors", help="Ray actors generating "
                                                       "(0: in this process).")] = None,
    max_minutes: MinutesOpt = None,
    run: RunOpt = None,
    resume: Annotated[str | None, typer.Option("--resume", help="Continue an RL run from its newest complete "
                                               "checkpoint: a run name, run folder or checkpoint.")] = None,
    pools: Annotated[str, typer.Option("--pools", help="Encode prompts and decode replies here (local) or through "
                                       "the long-lived text service of `pools up` (service).")] = "local",
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, overrides: OverridesArg = None,
):
    """RL post-training on a verifiable task: rollout actors, the unbiased replay buffer, GSPO with
    IcePop gates, optional adaptive hints; metrics.jsonl, rl.png and the model in the run folder."""
    from tokenloom.jobs.rl import rl

    home_, cfg = _setup(home, config, overrides)
    for key, value in (("task", task), ("buffer", buffer), ("steps", steps), ("rollout_actors", rollout_actors),
                       ("max_minutes", max_minutes)):
        if value is not None:
            setattr(cfg.rl, key, value)
    cfg.rl.hints = cfg.rl.hints or hints
    with _quiet_stdout(json_out):
        doc = rl(home_, model, cfg, run_name=run, resume_from=resume, progress=not json_out, pools=pools)
    if json_out:
        return _emit_json(doc)
    console.print(f"{doc['steps']} RL steps on {doc['task']} ({doc['buffer']} buffer"
                  f"{', hints' if doc['hints'] else ''}): reward {doc['reward_first']:.3f} -> {doc['reward_last']:.3f}; "
                  f"pass@1 {doc['pass_at_1_start'].get('pass1', float('nan')):.3f} -> "
                  f"{doc['pass_at_1'].get('pass1', float('nan')):.3f}; outputs in {doc['run_dir']}")
    console.print("pass@1 per bucket: " + ", ".join(f"{k.removeprefix('pass1/')} {v:.2f}"
                                                   for k, v in doc["pass_at_1"].items() if k != "pass1"))


@app.command("generate")
@_user_errors
def generate_command(
    source: Annotated[Path, typer.Argument(help="A training run folder or a model folder.")],
    to: Annotated[str, typer.Option("--to", help="What to generate: text, image, audio or video.")],
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text (after any media).")] = None,
    image: Annotated[Path | None, typer.Option("--image", help="An image to caption (or to continue from).")] = None,
    audio: Annotated[Path | None, typer.Option("--audio", help="A recording to transcribe.")] = None,
    grid: Annotated[str | None, typer.Option("--grid", help="Image (or video frame) size in codes, ROWSxCOLS "
                                             "(default: the visual tokenizer's training crop; a video: a 4:3 "
                                             "frame within ingest.video's frame budget).")] = None,
    seconds: Annotated[float, typer.Option("--seconds", help="Audio: at most this long; video: this long.")] = 2.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Text: at most this many tokens.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 for greedy.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    out: Annotated[Path | None, typer.Option("--out", help="File to write (text, PNG, WAV or MP4); default: under "
                                             "home/generations/.")] = None,
    pools: Annotated[str, typer.Option("--pools", help="Tokenize the prompt here (local) or through the "
                                       "long-lived tokenizer services of `pools up` (service).")] = "local",
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, overrides: OverridesArg = None,
):
    """Generate from a trained model: continue text, caption an image, transcribe audio, draw an
    image, speak a text or make a video with its sound, with the model's own tokenizers (KV-cache
    decoding)."""
    from tokenloom.jobs import generate as jobs
    from tokenloom.jobs.config import load_run_config
    from tokenloom.jobs.home import Home

    video = load_run_config(config, overrides).ingest.video  # a video's frame rate and frame budget
    doc = jobs.generate(Home.resolve(home), source, to, prompt, image, audio, parse_grid(grid), seconds,
                        max_new_tokens, temperature, top_k, top_p, seed, out, pools=pools, video=video)
    if json_out:
        return _emit_json(doc)
    made = doc["text"] if to == "text" else doc["out"]
    console.print(f"{made}", highlight=False, soft_wrap=True)
    console.print(f"[dim]{doc['positions']} positions in {doc['seconds']:.2f}s "
                  f"({doc['positions_per_second']:,.0f}/s), mean log-probability {doc['logprob_mean']}[/]",
                  highlight=False)


@app.command("report")
@_user_errors
def report_command(
    dataset: Annotated[str, typer.Argument(help="The dataset to report on.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the report (index.html, self-contained).")],
    at: Annotated[str | None, typer.Option("--at", help="Snapshot id or tag (default: current).")] = None,
    run: Annotated[list[str] | None, typer.Option("--run", help="A training run (name or folder) to show; "
                                                  "repeatable, runs are overlaid.")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Decoded samples per modality mix.")] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Which samples (seeded choice).")] = 0,
    home: HomeOpt = None, json_out: JsonOpt = False, config: ConfigOpt = None, catalog_uri: CatalogUriOpt = None,
):
    """An HTML report of a dataset and training runs: snapshot lineage, token mix, lengths, quarantine
    and filter reasons, decoded samples (text tokens, images, audio players) and run curves; one
    self-contained file that opens from disk."""
    from tokenloom.jobs import report as jobs

    home_, cfg = _setup(home, config, None, catalog_uri=catalog_uri)
    doc = jobs.report(home_, cfg, dataset, out, at=at, runs=run or [], samples=samples, seed=seed)
    if json_out:
        return _emit_json(doc)
    console.print(f"report of {dataset}@{doc['snapshot_id']} ({doc['samples']} samples, {doc['plots']} plots, "
                  f"{doc['bytes'] / 1e6:.1f} MB): {doc['report']}")


def main() -> None:  # pragma: no cover
    import logging

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("tokenloom").setLevel(logging.INFO)
    app(args=expand_multi_path_options(sys.argv[1:]), prog_name="tokenloom")


if __name__ == "__main__":  # pragma: no cover
    main()
