"""The ingestion job: resolve the tokenizer bundles the inputs need, pin their vocabulary, and
run the Ray Data ingestion (`platform.ingest`) into one catalog snapshot.

One vocabulary per dataset: the first job pins the manifest; later jobs reuse it or append
ranges for new modalities (`tokenizers.vocab.VocabManifest.extend`), so no two modalities of a
dataset ever share an id and no id changes its meaning between jobs.

Which bundles are needed follows from the inputs: text always; visual when they hold images;
audio when they hold audio; both for video. Each is given by id, path or `latest` (the default), and hashed
again before any worker loads it, so a damaged bundle stops the job with its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenloom.datasets import sources
from tokenloom.jobs.home import Home, code_version, open_catalog
from tokenloom.tokenizers.vocab import VocabManifest, manifest_from_bundles

# modality of the inputs -> tokenizer kinds it needs (a video: frames and sound)
MEDIA_BUNDLES = {"image": ("visual",), "audio": ("audio",), "video": ("visual", "audio")}


def ingest(home: Home, inputs: Sequence[str | Path], dataset: str, cfg, bundle_refs: dict[str, str | None] | None = None,
           sync: bool = False):
    """Tokenize `inputs` into `dataset`; `bundle_refs` maps kind ("text", "visual", "audio") to an
    id, a path or "latest" (missing or None: latest). `sync`: also delete the samples of indexed
    files that are gone from the input folders."""
    from tokenloom.platform.ingest import run_ingest  # Ray is imported only by jobs that use it

    refs = bundle_refs or {}
    if cfg.ingest.pools_mode == "service" and not cfg.ingest.ray.address:
        from tokenloom.jobs.pools import load_state

        cfg.ingest.ray.address = load_state(home)["address"]  # the cluster `pools up` deployed to
    catalog = open_catalog(home, cfg)
    files, _ = sources.discover(inputs)
    # the bundles the inputs need, and any named explicitly: a first job pins ranges for all of them
    kinds = {"text"} | {kind for f in files for kind in MEDIA_BUNDLES.get(f.modality, ())}
    kinds |= {kind for kind, ref in refs.items() if ref}
    infos = {kind: home.bundle(refs.get(kind), kind) for kind in sorted(kinds)}
    vocab = dataset_vocabulary(home, catalog, dataset, infos)
    vocab.save(home.vocab)
    return run_ingest(inputs, dataset, catalog, vocab, {k: str(i.path) for k, i in infos.items()}, cfg.ingest,
                      lineage={"code_version": code_version()}, sync=sync)


def dataset_vocabulary(home: Home, catalog, dataset: str, infos: dict) -> VocabManifest:
    """The manifest a job writes with: the dataset's pinned one, extended by appended ranges for
    modalities it lacks (or refused, when a bundle differs from the one behind an existing range);
    for a new dataset, the manifest of the job's bundles."""
    pinned_id = catalog.summary(dataset).get("vocab_id") if catalog.exists(dataset) else None
    if not pinned_id:
        return manifest_from_bundles(infos)
    return home.manifest(pinned_id).extend(infos, f"dataset {dataset!r}")
