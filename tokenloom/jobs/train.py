"""Model jobs: train the unified model on a catalog snapshot, evaluate a model on one, export a
smaller elastic sub-model.

The dataset's snapshot fixes the data files and its vocabulary manifest fixes the token space
(`trainer.fit`); the trainer does the rest. A run folder records which snapshot and manifest it
trained on (`source.json`), and so does every checkpoint's manifest, with the bundles and the code
version (facts the trainer may not look up itself: it does not import `jobs`). `--resume` takes a
run name, a run folder or a checkpoint folder, and a resumed run continues in its own run folder.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from tokenloom.catalog.store import NotAnAncestor
from tokenloom.datasets import ShardFile, shard_files
from tokenloom.jobs.home import Home, code_version, model_folder, open_catalog

log = logging.getLogger("tokenloom")


def _snapshot(home: Home, cfg, dataset: str, at: str | None, purpose: str):
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(dataset, at)
    if summary["snapshot_id"] is None:
        raise ValueError(f"dataset {dataset!r} has no committed snapshot to {purpose}")
    vocab = home.manifest(summary["vocab_id"])
    for entry in summary.get("vocab_history", []):  # every job's files must mean what this manifest says
        if entry["vocab_id"] != vocab.id and not home.manifest(entry["vocab_id"]).is_prefix_of(vocab):
            raise ValueError(f"dataset {dataset!r}: snapshot {entry['snapshot_id']} was written with vocabulary "
                             f"{entry['vocab_id']}, which {vocab.id} does not extend; its ids would be misread. "
                             "Train on a snapshot before the change (--at) or re-ingest into a new dataset")
    return catalog, summary, vocab


def resume_point(home: Home, ref: str | Path) -> Path:
    """The checkpoint `--resume` names: a run's name (under the home's runs/), a run folder, a run's
    checkpoint/ folder or one checkpoint; a run's newest complete checkpoint."""
    from tokenloom.trainer.checkpoints import find_checkpoint

    path = Path(ref)
    if len(path.parts) == 1 and (home.runs / path).is_dir():
        path = home.runs / path
    if not path.exists():
        raise FileNotFoundError(f"--resume {ref}: no run of that name in {home.runs} and no such folder")
    try:
        return find_checkpoint(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--resume {ref}: {exc}") from None


def run_folder(home: Home, dataset: str, run_name: str | None, checkpoint: Path | None,
               refuse_existing: bool = False) -> Path:
    """Where a run writes: `--run NAME`, else the run folder a resumed checkpoint belongs to, else a
    new one. `refuse_existing` (the command line): a named run that exists already is continued
    only by resuming it (the demo trains its `demo` run afresh on every call)."""
    if run_name is not None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", run_name):
            raise ValueError(f"--run {run_name!r}: a run name is letters, digits, '.', '_' and '-'")
        folder = home.new_dir(dataset, run_name)
        owner = _owning_run(checkpoint)
        resuming_it = owner is not None and owner.resolve() == folder.resolve()
        if refuse_existing and (folder / "config.json").exists() and not resuming_it:
            raise ValueError(f"run {run_name!r} already exists in {home.runs}; continue it with --resume {run_name} "
                             "or choose another --run")
        return folder
    return _owning_run(checkpoint) or home.new_dir(dataset)


def _owning_run(checkpoint: Path | None) -> Path | None:
    """The run folder holding `checkpoint` (`<run>/checkpoint/<tag>`), when it is one."""
    if checkpoint is None or checkpoint.parent.name != "checkpoint":
        return None
    run = checkpoint.parent.parent
    return run if (run / "config.json").is_file() else None


def initial_weights(home: Home, ref: str | Path, cfg, vocab) -> tuple[dict, dict]:
    """`--init-from`: a trained model's weights and where they came from, for a new run on a dataset
    whose manifest is the model's token space (the same manifest, or one that extends it with the
    same size: a model cannot read ids it has no embedding for). The run takes the model's
    architecture (`cfg.model` is replaced; its elastic settings are kept from the run's config)."""
    from dataclasses import replace

    from tokenloom.model.io import load_model
    from tokenloom.tokenizers.vocab import VocabManifest
    from tokenloom.trainer.fit import check_model_fits

    path = Path(ref)
    if len(path.parts) == 1 and (home.runs / path).is_dir():
        path = home.runs / path
    folder = model_folder(path)
    model, doc = load_model(folder)
    if "vocab" in doc:
        theirs = VocabManifest.from_dict(doc["vocab"])
        if theirs.id != vocab.id and not theirs.is_prefix_of(vocab):
            raise ValueError(f"--init-from {ref}: the model was trained on vocabulary {theirs.id}, which the "
                             f"dataset's manifest {vocab.id} does not extend; its ids would mean other tokens")
    check_model_fits(model.cfg, vocab.size, [(r.start, r.stop) for r in vocab.audio],
                     f"the dataset's manifest {vocab.id} (--init-from {ref})")
    cfg.model = replace(model.cfg, elastic=cfg.model.elastic)
    return model.state_dict(), {"model": str(folder.resolve()), "steps": doc.get("steps")}


def source_specs(cfg, dataset: str | None, at: str | None, mix: str | None) -> list:
    """What a run trains on: `--dataset` (at `--at`), a `--mix a=0.7,b=0.3`, or `[[stream.sources]]`."""
    from tokenloom.datasets import SourceSpec
    from tokenloom.datasets.loader import parse_mix

    given = [name for name, v in (("--dataset", dataset), ("--mix", mix), ("[[stream.sources]]", cfg.stream.sources))
             if v]
    if len(given) != 1:
        raise ValueError("name the data once: --dataset NAME, --mix a=0.7,b=0.3 or [[stream.sources]] in the config"
                         + (f" (got {' and '.join(given)})" if given else ""))
    if mix:
        specs = [SourceSpec(name, weight) for name, weight in parse_mix(mix)]
    elif dataset:
        specs = [SourceSpec(dataset, 1.0, at or "")]
    else:
        specs = list(cfg.stream.sources)
        for spec in specs:
            if not spec.dataset or not spec.weight > 0:
                raise ValueError(f"every [[stream.sources]] entry needs a dataset and a weight > 0, got {spec}")
    if at and not dataset:
        raise ValueError("--at goes with --dataset; in a mixture give each source its own `at`")
    return specs


def _sources(home: Home, cfg, specs: list, pinned: dict[str, int]):
    """Each source's snapshot (its `at`, else the snapshot a resumed checkpoint pinned, else the
    current one) and files, and the manifest they train with: the largest of theirs, which every other
    must be a prefix of (the same ids mean the same tokens)."""
    from tokenloom.datasets.loader import Source

    sources, vocab, catalog, snapshots = [], None, None, {}
    for spec in specs:
        at = spec.at or (str(pinned[spec.dataset]) if spec.dataset in pinned else None)
        catalog, summary, theirs = _snapshot(home, cfg, spec.dataset, at, "train on")
        snapshots[spec.dataset] = summary["snapshot_id"]
        sources.append(Source(spec.dataset, tuple(shard_files(catalog, spec.dataset, summary["snapshot_id"])),
                              spec.weight, summary["snapshot_id"]))
        if vocab is None or theirs.size > vocab.size:
            vocab, theirs = theirs, vocab
        if theirs is not None and theirs.id != vocab.id and not theirs.is_prefix_of(vocab):
            raise ValueError(f"the sources' vocabularies differ: {theirs.id} and {vocab.id} (neither extends the "
                             "other), so one id would mean two tokens; mix datasets that share a vocabulary")
    return catalog, sources, vocab, snapshots


def follower(home: Home, cfg, sources) -> object:
    """Follow mode's poll: `poll(seen)` -> [(source, snapshot id, files of new rows, deleted sample
    ids)] for every snapshot committed to a source after the one `seen` names, in commit order
    (`TokenCatalog.additions`: a snapshot that replaced rows contributes its job's own files, not the
    files it rewrote, whose rows were streamed already, and the ids of the rows it deleted, which
    the run stops reading)."""
    def poll(seen: dict[str, int]) -> list:
        catalog = open_catalog(home, cfg)
        out = []
        for src in sources:
            current = catalog.snapshot(src.name)
            if current is None or current.snapshot_id == seen[src.name]:
                continue
            try:
                added = catalog.additions(src.name, seen[src.name])
            except NotAnAncestor:
                log.warning("follow: %s's snapshot %s is no longer an ancestor of the current one; not following",
                            src.name, seen[src.name])
                continue
            except Exception as exc:  # noqa: BLE001 - rank 0 alone polls: raising would leave the other ranks waiting
                log.error("follow: cannot read the snapshots of %s committed after %s (%s: %s); trying again at "
                          "the next poll", src.name, seen[src.name], type(exc).__name__, exc)
                continue
            for a in added:
                out.append((src.name, a.snapshot.snapshot_id, [ShardFile(f.path, f.record_count) for f in a.files],
                            a.deleted))
        return out

    return poll


def train(home: Home, dataset: str | None, cfg, at: str | None = None, progress: bool = True,
          run_name: str | None = None, resume_from: str | Path | None = None, refuse_existing: bool = False,
          init_from: str | Path | None = None, mix: str | None = None, follow: bool = False):
    """Train on a snapshot, or a mixture of datasets' snapshots: (snapshot id of the first source,
    trainer.TrainResult). `resume_from`: see `resume_point`; `refuse_existing`: see `run_folder`;
    `init_from`: a model folder or run (`initial_weights`) whose weights start a new run; `mix`:
    `a=0.7,b=0.3`; `follow`: keep reading what ingestion commits to the sources while training."""
    from tokenloom.trainer import train as run_training
    from tokenloom.trainer.checkpoints import read_manifest
    from tokenloom.trainer.fit import fit_to_vocabulary

    if init_from is not None and resume_from is not None:
        raise ValueError("--init-from starts a new run from a model's weights, --resume continues a run: give one")
    specs = source_specs(cfg, dataset, at, mix)
    cfg.stream.sources = specs
    label = "+".join(s.dataset for s in specs)
    checkpoint = resume_point(home, resume_from) if resume_from is not None else None
    pinned = (read_manifest(checkpoint) or {}).get("sources", {}) if checkpoint is not None else {}
    run_dir = run_folder(home, label, run_name, checkpoint, refuse_existing)
    catalog, sources, vocab, snapshots = _sources(home, cfg, specs, pinned)
    init_state, init_doc = initial_weights(home, init_from, cfg, vocab) if init_from is not None else (None, None)
    fit_to_vocabulary(cfg.model, cfg.stream, vocab.size, [(r.start, r.stop) for r in vocab.audio])
    if not cfg.train.warmup_steps:
        log.info("train.warmup_steps is not set: warming up over %d of %d steps (10%% of the run)",
                 cfg.train.warmup, cfg.train.steps)
    provenance = {"dataset": label, "snapshot_ids": list(snapshots.values()), "sources": snapshots,
                  "vocab_id": vocab.id, "bundle_ids": dict(sorted(vocab.bundles.items())),
                  "code_version": code_version(), **({"init_from": init_doc} if init_doc else {})}
    result = run_training(sources, cfg.model, cfg.stream, cfg.train, run_dir, resume_from=checkpoint, progress=progress,
                          provenance=provenance, init_state=init_state,
                          follow=follower(home, cfg, sources) if follow else None)
    first = snapshots[specs[0].dataset]
    if int(os.environ.get("RANK", "0")) == 0:  # every rank trains in rank 0's run folder (the loop broadcasts it)
        from tokenloom.model.io import annotate_model

        (Path(result.run_dir) / "source.json").write_text(json.dumps(
            {"dataset": label, "snapshot_id": first, "sources": snapshots, "vocab_id": vocab.id,
             **({"segments": result.segments} if result.segments else {}),
             **({"init_from": init_doc} if init_doc else {})}, indent=2))
        if result.model_dir:  # the token space travels with the model: generation reads it from here
            annotate_model(result.model_dir, **generation_facts(vocab, cfg.stream))
    return first, result


def generation_facts(vocab, stream_cfg) -> dict:
    """What a model folder needs to generate: its manifest and the stream layout it learned."""
    return {"vocab": vocab.to_dict(), "stream": {"audio_window": stream_cfg.audio_window,
                                                 "seq_len": stream_cfg.seq_len}}


def _submodel(cfg, layers: tuple[int, ...] | None, experts: tuple[int, ...] | None, top_k: int | None):
    from tokenloom.model.elastic import SubModel

    sub = SubModel(layers, experts, top_k)
    sub.check(cfg)
    return sub


def evaluate(home: Home, cfg, source: Path, dataset: str, at: str | None = None, batches: int = 8,
             layers: tuple[int, ...] | None = None, experts: tuple[int, ...] | None = None,
             top_k: int | None = None) -> dict:
    """Validation loss per modality of a model folder (optionally an elastic sub-model) on a snapshot."""
    from tokenloom.model.io import load_model
    from tokenloom.trainer.evaluate import evaluate as run_eval
    from tokenloom.trainer.fit import check_model_fits, fit_stream

    folder = model_folder(source)
    model, _ = load_model(folder)
    catalog, summary, vocab = _snapshot(home, cfg, dataset, at, "evaluate on")
    check_model_fits(model.cfg, vocab.size, [(r.start, r.stop) for r in vocab.audio],
                     f"dataset {dataset!r}'s manifest {vocab.id}")
    fit_stream(cfg.stream, len(vocab.audio))
    sub = _submodel(model.cfg, layers, experts, top_k)
    files = shard_files(catalog, dataset, summary["snapshot_id"])
    result = run_eval(model, files, cfg.stream, batches=batches, micro_batch_size=cfg.train.micro_batch_size, sub=sub)
    return {"model": str(folder), "dataset": dataset, "snapshot_id": summary["snapshot_id"],
            "submodel": sub.describe(), **result}


def export(source: Path, out: Path, layers: tuple[int, ...] | None = None, experts: tuple[int, ...] | None = None,
           top_k: int | None = None, tier: str | None = None) -> dict:
    """Write a smaller standalone model: a subset of layers, of experts, and a smaller top-k, or
    a deployment tier's documented cut (`model.elastic.TIERS`)."""
    from tokenloom.model.elastic import export_submodel, tier_submodel
    from tokenloom.model.io import load_model, save_model

    folder = model_folder(source)
    model, doc = load_model(folder)
    if tier is not None:
        if (layers, experts, top_k) != (None, None, None):
            raise ValueError("--tier sets the layers, experts and top-k itself; give it alone")
        sub = tier_submodel(model.cfg, tier)
    else:
        sub = _submodel(model.cfg, layers, experts, top_k)
    small = export_submodel(model, sub)
    carried = {k: doc[k] for k in ("vocab", "stream") if k in doc}  # the token space goes with the export
    if "vocab" not in carried and (folder.parent / "source.json").is_file():
        carried["source"] = json.loads((folder.parent / "source.json").read_text())
    save_model(small.state_dict(), small.cfg, out, {"exported_from": str(Path(source).resolve()), **sub.describe(),
                                                    "experts_kept": list(sub.experts) if sub.experts else None,
                                                    **carried})
    return {"out": str(out), "tier": tier, "parameters": sum(p.numel() for p in small.parameters()),
            "source_parameters": sum(p.numel() for p in model.parameters()), "n_layers": small.cfg.n_layers,
            "n_experts": small.cfg.moe.n_experts, "top_k": small.cfg.moe.top_k}


def leave_process_group() -> int:
    """End this rank's part in a multi-process run; returns its rank (only rank 0 reports)."""
    from tokenloom.trainer.distributed import shutdown_distributed

    return shutdown_distributed()


def evaluate_tiers(home: Home, cfg, source: Path, dataset: str, at: str | None = None, batches: int = 8,
                   new_tokens: int = 64) -> dict:
    """For each deployment tier: parameters (total and active per token), validation loss per
    modality, greedy text generation speed with the KV cache, and memory (weights plus the KV
    cache's tensors; on a GPU the allocator's peak)."""
    import time

    import numpy as np
    import torch

    from tokenloom.jobs.generate import Generator
    from tokenloom.model.elastic import TIERS, export_submodel, tier_submodel
    from tokenloom.model.generate import Cursor, Request, SamplingConfig
    from tokenloom.model.generate import generate as decode
    from tokenloom.tokenizers.sequence import TextPart
    from tokenloom.trainer.evaluate import evaluate as run_eval
    from tokenloom.trainer.fit import check_model_fits, fit_stream
    from tokenloom.trainer.loop import active_parameters

    gen = Generator.load(home, source)
    catalog, summary, vocab = _snapshot(home, cfg, dataset, at, "evaluate on")
    check_model_fits(gen.model.cfg, vocab.size, [(r.start, r.stop) for r in vocab.audio],
                     f"dataset {dataset!r}'s manifest {vocab.id}")
    fit_stream(cfg.stream, len(vocab.audio))
    files = shard_files(catalog, dataset, summary["snapshot_id"])
    prompt = gen.prompt_chunk([TextPart(np.arange(min(8, vocab.text.size)))])
    rows = []
    for tier in TIERS:
        sub = tier_submodel(gen.model.cfg, tier)
        small = export_submodel(gen.model, sub).eval()
        total = sum(p.numel() for p in small.parameters())
        losses = run_eval(small, files, cfg.stream, batches=batches, micro_batch_size=cfg.train.micro_batch_size)
        decode(small, gen.space, prompt, Cursor.after(prompt), Request("text", max_new_tokens=4),
               SamplingConfig(temperature=0))  # warm-up
        started = time.perf_counter()
        made = decode(small, gen.space, prompt, Cursor.after(prompt), Request("text", max_new_tokens=new_tokens),
                      SamplingConfig(temperature=0))
        seconds = time.perf_counter() - started
        weights = sum(t.numel() * t.element_size() for t in small.state_dict().values())
        # the cache the decoder allocates: keys and values per layer for every position of the run
        kv = 2 * small.cfg.n_layers * (len(prompt) + new_tokens + 2) * small.cfg.dim * small.embed.weight.element_size()
        rows.append({"tier": tier, **sub.describe(), "n_layers": small.cfg.n_layers,
                     "n_experts": small.cfg.moe.n_experts, "top_k": small.cfg.moe.top_k, "parameters": total,
                     "active_parameters": active_parameters(small.cfg, total), **losses,
                     "generated": made.positions, "tokens_per_second": made.positions / max(seconds, 1e-9),
                     "memory_bytes": weights + kv,
                     "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None})
    doc = {"model": str(gen.folder), "dataset": dataset, "snapshot_id": summary["snapshot_id"], "tiers": rows}
    run = gen.folder.parent
    if (run / "metrics.jsonl").is_file():  # a run's model: the table goes with the run (the report shows it)
        saved = run / "evaluations" / f"tiers-{dataset}-{summary['snapshot_id']}.json"
        saved.parent.mkdir(exist_ok=True)
        saved.write_text(json.dumps(doc, indent=2))
        doc["saved"] = str(saved)
    return doc
