"""The report job: a dataset (at a snapshot) and training runs as one self-contained HTML page.

It gathers what the catalog and the run folders already hold (summary, lineage, side tables via
SQL, metrics.jsonl, the runs' PNGs and generations), decodes a few seeded samples per modality mix
back through the bundles their vocabulary names, and hands plain data to `report.page.render`.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenloom.jobs.home import Home, open_catalog
from tokenloom.report import figures
from tokenloom.report.page import b64, render

REASON_TABLES = (("quarantine", "reason", "quarantine_reasons", "Quarantined inputs"),
                 ("filtered", "filter", "filter_counts", "Filtered by quality filters"),
                 ("duplicates", "kind", "duplicate_counts", "Duplicates removed"))
MAX_TOKENS_SHOWN = 160
MAX_REASON_ROWS = 15


def _reasons(home: Home, cfg, dataset: str, chain) -> list[dict]:
    """Per side table: counts by reason over the snapshot's lineage (from the job summaries) and the
    records themselves, with their detailed reasons and sources (SQL over the side table)."""
    from collections import Counter

    from tokenloom.catalog.query import query

    out = []
    for table, key, summary_key, title in REASON_TABLES:
        counts: Counter = Counter()
        for snap in chain:
            counts.update(json.loads(snap.tokenloom.get(summary_key, "{}")))
        sql = (f'SELECT {key} AS kind, reason, source FROM "{dataset}".{table} ORDER BY 1, 2, 3 '
               f'LIMIT {MAX_REASON_ROWS}')
        rows = query(open_catalog(home, cfg), sql, {dataset: str(chain[-1].snapshot_id)}).to_pylist()
        out.append({"title": title, "counts": dict(counts),
                    "rows": [{"reason": f"{r['kind']}: {r['reason']}" if r["kind"] != r["reason"] else r["reason"],
                              "examples": r["source"]} for r in rows]})
    return out


def _history(catalog, dataset: str, chain) -> list[dict]:
    tags = catalog.tags(dataset)
    rows = []
    for s in chain:
        tl = s.tokenloom
        rows.append({"snapshot_id": s.snapshot_id, "operation": s.operation, "job_id": tl.get("job_id", ""),
                     "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime(s.timestamp_ms / 1000)),
                     "samples": int(tl.get("samples", 0)), "tokens": int(tl.get("tokens", 0)),
                     "quarantined": int(tl.get("quarantined", 0)), "vocab_id": tl.get("vocab_id", ""),
                     "bundles": ", ".join(json.loads(tl.get("bundle_ids", "[]"))),
                     "sources": tl.get("source_changes", ""),
                     "tags": ", ".join(t for t, sid in tags.items() if sid == s.snapshot_id)})
    return rows


def _samples(home: Home, catalog, dataset: str, snapshot_id: int, per_mix: int, seed: int) -> list:
    """`per_mix` seeded samples of each modality mix, decoded: [(mix, [sample view])]."""
    from PIL import Image
    from pyiceberg.expressions import In

    from tokenloom.jobs.tokenizer import part_decoder
    from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart, VideoPart

    index = catalog.scan(dataset, at=snapshot_id, columns=("sample_id", "modalities"))
    ids, mixes = index.column("sample_id").to_pylist(), index.column("modalities").to_pylist()
    rng = np.random.default_rng(seed)
    chosen = []
    for mix in sorted(set(mixes)):
        members = sorted(i for i, m in zip(ids, mixes, strict=True) if m == mix)
        chosen += [members[k] for k in sorted(rng.choice(len(members), min(per_mix, len(members)), replace=False))]
    rows = catalog.scan(dataset, at=snapshot_id, where=In("sample_id", chosen) if chosen else None,
                        columns=("sample_id", "source", "modalities", "tokens", "segments", "vocab_id")).to_pylist()
    rows = sorted(rows, key=lambda r: (r["modalities"], r["sample_id"])) if chosen else []
    decoders: dict = {}
    grouped: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            vocab = home.manifest(row["vocab_id"])
            view = {"sample_id": row["sample_id"], "source": row["source"], "parts": [],
                    "segments": ", ".join(f"{s['modality']}[{s['start']}:+{s['length']}]"
                                          + (f" grid {tuple(s['grid'])}" if s["grid"] else "") for s in row["segments"])}
            for part in SampleLayout(vocab).disassemble(row["tokens"], row["segments"]):
                if isinstance(part, VideoPart):  # shown as a film strip of its frames, then its sound
                    draw = decoders.setdefault(("visual", vocab.bundles.get("visual")),
                                               part_decoder(home, "visual", vocab.bundles.get("visual"), None))
                    strip = np.concatenate([draw(ImagePart(codes), None) for codes in part.frames], axis=1)
                    target = Path(tmp) / f"strip-{row['sample_id']}.png"
                    Image.fromarray(strip).save(target)
                    view["parts"].append({"kind": "image", "png": b64(target.read_bytes()),
                                          "grid": (len(part.frames), *part.frames.shape[1:])})
                    if not part.audio:
                        continue
                    part = AudioPart(np.concatenate(part.audio))
                kind = {TextPart: "text", ImagePart: "visual", AudioPart: "audio"}[type(part)]
                key = (kind, vocab.bundles.get(kind))
                if key not in decoders:
                    decoders[key] = part_decoder(home, kind, key[1], None, per_token=True)
                if kind == "text":
                    view["parts"].append({"kind": "text", "tokens": decoders[key](part)[:MAX_TOKENS_SHOWN]})
                    continue
                target = Path(tmp) / f"{len(decoders)}-{row['sample_id']}.{'png' if kind == 'visual' else 'wav'}"
                decoders[key](part, target)
                if kind == "visual":
                    view["parts"].append({"kind": "image", "png": b64(target.read_bytes()), "grid": part.codes.shape})
                else:
                    view["parts"].append({"kind": "audio", "wav": b64(target.read_bytes()),
                                          "spectrogram": b64(figures.spectrogram_png(target))})
            grouped.setdefault(row["modalities"], []).append(view)
    return sorted(grouped.items())


def _run(home: Home, ref: str) -> tuple[str, Path]:
    path = Path(ref)
    if len(path.parts) == 1 and (home.runs / path).is_dir():
        path = home.runs / path
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"--run {ref}: no run folder with metrics.jsonl (a run name under {home.runs} or "
                                "a run folder)")
    return path.name, path


def _runs(home: Home, refs: list[str]) -> dict:
    loaded = {}
    for ref in refs:
        name, path = _run(home, ref)
        loaded[name] = (path, [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()])
    records = {name: recs for name, (_, recs) in loaded.items()}
    overlays = [figures.run_curves(records, "loss_by_modality", "training loss by modality (held-out: diamonds)",
                                   "run-loss"),
                figures.run_curves(records, "lr", "learning rate", "run-lr"),
                figures.run_curves(records, "grad_norm", "gradient norm (before clipping)", "run-grad", log_y=True),
                figures.run_curves(records, "tokens_per_second", "training tokens/s", "run-speed"),
                figures.run_curves(records, "fill_ratio", "row fill ratio", "run-fill")]
    items = []
    for k, (name, (path, recs)) in enumerate(loaded.items()):
        train = [r for r in recs if "loss" in r and "eval" not in r]
        rows = [("folder", str(path)), ("steps logged", len(train)),
                ("last loss", f"{train[-1]['loss']:.4f}" if train else "none")]
        if (path / "source.json").is_file():
            rows.append(("trained on", (path / "source.json").read_text()))
        evals = [r for r in recs if r.get("eval") == "held-out"]
        if evals:
            rows.append(("held-out loss (last)", ", ".join(f"{k.removeprefix('val_loss_')} {v:.3f}" for k, v in
                                                            evals[-1].items() if k.startswith("val_loss_") and v)))
        heat = figures.routing_balance(recs, f"run-{k}-routing")
        images = [{"title": title, "png": b64((path / f).read_bytes())}
                  for f, title in (("loss.png", "loss.png"), ("routing.png", "routing.png: expert load heatmap"))
                  if (path / f).is_file()]
        items.append({"name": name, "rows": rows, "figures": [heat] if heat else [], "images": images,
                      "generations": _generations(path / "generations"), "tiers": _tiers(path / "evaluations")})
    return {"figures": [f for f in overlays if f], "list": items}


TIER_COLUMNS = ("tier", "n_layers", "n_experts", "top_k", "parameters", "active_parameters", "loss", "loss_text",
                "loss_image", "loss_audio", "tokens_per_second", "memory_bytes")


def _tiers(folder: Path) -> list[dict]:
    """The elastic sub-model (deployment tier) evaluations `model eval --tiers` saved with the run."""
    out = []
    for f in sorted(folder.glob("tiers-*.json")) if folder.is_dir() else []:
        doc = json.loads(f.read_text())
        fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else f"{v:,}"  # noqa: E731
        out.append({"title": f"deployment tiers on {doc['dataset']}@{doc['snapshot_id']}", "columns": TIER_COLUMNS,
                    "rows": [[fmt(r.get(c)) if c != "tier" else r[c] for c in TIER_COLUMNS] for r in doc["tiers"]]})
    return out


def _generations(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        if f.suffix == ".png":
            out.append({"title": f.name, "kind": "image", "data": b64(f.read_bytes())})
        elif f.suffix == ".wav":
            out.append({"title": f.name, "kind": "audio", "data": b64(f.read_bytes())})
        elif f.suffix == ".txt":
            out.append({"title": f.name, "kind": "text", "data": f.read_text()[:2000]})
    return out


def report(home: Home, cfg, dataset: str, out: Path, at: str | None = None, runs: list[str] | None = None,
           samples: int = 3, seed: int = 0) -> dict:
    """Write the report of `dataset` (at `at`) and `runs` into `out/index.html`; returns what it holds."""
    from tokenloom.catalog.stats import hist_edges

    if samples < 0:
        raise ValueError(f"--samples must be >= 0, got {samples}")
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    if summary["snapshot_id"] is None:
        raise ValueError(f"dataset {dataset!r} has no committed snapshot to report on")
    snap = catalog.snapshot(dataset, summary["snapshot_id"])
    chain = catalog.ancestry(dataset, snap)
    reasons = _reasons(home, cfg, dataset, chain)
    stats = summary["stats"]
    dataset_doc = {
        "name": dataset, "snapshot_id": summary["snapshot_id"],
        "rows": [("samples", f"{summary['samples']:,}"), ("tokens", f"{summary['tokens']:,}"),
                 ("vocabulary", summary.get("vocab_id")), ("bundles", ", ".join(summary.get("bundle_ids", []))),
                 ("data files", summary.get("data_files")), ("quarantined (all jobs)", summary["total_quarantined"]),
                 ("filtered (all jobs)", summary.get("total_filtered", 0)),
                 ("duplicates (all jobs)", summary.get("total_duplicates", 0))],
        "figures": [figures.token_mix(stats), figures.length_histogram(stats["length_hist"], hist_edges())]
        + [figures.reasons(r["counts"], r["title"], f"reasons-{i}") for i, r in enumerate(reasons) if r["counts"]],
        "history": _history(catalog, dataset, chain), "reasons": reasons,
        # the job's per-pool figures (platform/pools.pool_figures), one table row per pool
        "pools": [{"pool": m, **f} for m, f in sorted(json.loads(snap.tokenloom.get("pools", "{}")).items())],
    }
    views = _samples(home, catalog, dataset, summary["snapshot_id"], samples, seed)
    doc = {"dataset": dataset_doc, "samples": views, "runs": _runs(home, runs or []),
           "samples_note": f"{samples} seeded samples (seed {seed}) per modality mix, decoded with the bundles their "
                           f"vocabulary names; text shown as its tokens (the first {MAX_TOKENS_SHOWN})."}
    path = render(doc, Path(out))
    return {"report": str(path), "bytes": path.stat().st_size, "dataset": dataset,
            "snapshot_id": summary["snapshot_id"], "samples": sum(len(v) for _, v in views),
            "runs": [i["name"] for i in doc["runs"]["list"]], "plots": len(dataset_doc["figures"])
            + len(doc["runs"]["figures"]) + sum(len(i["figures"]) for i in doc["runs"]["list"])}

