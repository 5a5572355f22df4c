"""One vocabulary per dataset: the first job pins the manifest, later jobs append ranges or are
refused, and no two modalities of a dataset ever share an id (checked by reading every shard)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tokenloom.tokenizers.bundle import BundleError, BundleInfo
from tokenloom.tokenizers.vocab import VocabManifest
from tokenloom.trainer.distributed import destroy_process_group


def _info(kind: str, ident: str, **config) -> BundleInfo:
    return BundleInfo(ident, kind, Path("/nonexistent") / ident, config)


TEXT, OTHER_TEXT = _info("text", "text-a", vocab_size=100), _info("text", "text-b", vocab_size=100)
VISUAL = _info("visual", "visual-a", num_codes=64)
AUDIO = _info("audio", "audio-a", levels=2, codebook_size=32)


def _ids(manifest: VocabManifest) -> dict[str, set[int]]:
    return {name: set(range(r.start, r.stop)) for name, r in manifest.ranges().items()}


@pytest.mark.parametrize("first, then", [(VISUAL, AUDIO), (AUDIO, VISUAL)], ids=["image-then-audio",
                                                                                 "audio-then-image"])
def test_a_new_modality_is_appended_after_every_existing_id(first, then):
    pinned = VocabManifest.build(100).extend({"text": TEXT, first.kind: first})
    grown = pinned.extend({"text": TEXT, then.kind: then}, "dataset 'mix'")
    assert pinned.is_prefix_of(grown) and not grown.is_prefix_of(pinned)
    assert min(min(ids) for name, ids in _ids(grown).items() if name not in _ids(pinned)) >= pinned.size
    spans = list(_ids(grown).values())
    assert sum(len(s) for s in spans) == len(set().union(*spans)), "two ranges share an id"
    assert grown.size == 16 + 100 + 64 + 2 * 32
    assert grown.extend({"text": TEXT, "visual": VISUAL, "audio": AUDIO}) is grown  # nothing new: itself
    assert VocabManifest.from_dict(grown.to_dict()) == grown


def test_a_different_bundle_for_an_existing_range_is_refused_naming_both():
    pinned = VocabManifest.build(100, visual_size=64, bundles={"text": "text-a", "visual": "visual-a"})
    with pytest.raises(BundleError, match="dataset 'mix' pins the text tokenizer text-a .* this job's is text-b"):
        pinned.extend({"text": OTHER_TEXT}, "dataset 'mix'")
    with pytest.raises(BundleError, match="visual-a .* visual-z"):
        pinned.extend({"text": TEXT, "visual": _info("visual", "visual-z", num_codes=64)})
    other = VocabManifest.build(100, visual_size=64, bundles={"text": "text-b", "visual": "visual-a"})
    assert not pinned.is_prefix_of(other)


@pytest.mark.integration
def test_image_job_then_audio_job_share_no_id_and_train(tmp_path, text_bundle, monkeypatch):
    """Images, then audio, into one dataset: every shard read back, no id used by two modalities;
    a training run on the result; a different text bundle for it: one line, status 2."""
    from cli_runner import run
    from PIL import Image

    from tokenloom.jobs.config import load_run_config
    from tokenloom.jobs.home import Home, open_catalog
    from tokenloom.jobs.ingest import ingest
    from tokenloom.jobs.train import leave_process_group, train
    from tokenloom.samples.audio import tone
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig
    from tokenloom.tokenizers.audio import publish_bundle as publish_audio
    from tokenloom.tokenizers.text import TextTokenizerConfig, train_text_tokenizer
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual

    home = Home(tmp_path / "home")
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    torch.manual_seed(0)
    # no held-out split: 8 samples with tiny's 25% held out by a hash of the (random) data file names
    # would leave the 4 canonical readers too few training samples in some runs
    cfg = load_run_config("tiny", ["train.steps=2", "train.micro_batch_size=2", "stream.seq_len=96",
                                   "stream.holdout=0"])
    cfg.ingest.ray.progress_bars = False
    v = VisualTokenizer(VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1, vit_heads=2,
                                              fusion_heads=2, max_pixels=32 * 32, codebook_size=256))
    v.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_visual(v.eval(), home.bundles)
    a = AudioTokenizer(AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=2, codebook_size=32,
                                            code_dim=4, chunk_seconds=2.0))
    a.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    audio = publish_audio(a.eval(), home.bundles)

    photos, clips = tmp_path / "photos", tmp_path / "clips"
    photos.mkdir()
    clips.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)).save(photos / f"p{i}.png")
        (photos / f"p{i}.txt").write_text(f"random picture number {i}\n")
    for i in range(5):
        sf.write(clips / f"c{i}.wav", tone((220.0 + 40 * i,), 0.6), 16_000, subtype="PCM_16")
        (clips / f"c{i}.txt").write_text(f"a tone at {220 + 40 * i} hertz\n")

    first = ingest(home, [photos], "mix", cfg, {"text": text_bundle.id, "visual": visual.id})
    second = ingest(home, [clips], "mix", cfg, {"text": text_bundle.id, "audio": audio.id})
    again = ingest(home, [photos], "mix", cfg, {"text": text_bundle.id, "visual": visual.id})
    assert (first.samples, second.samples) == (3, 5) and again.already_committed  # a re-run stays a no-op

    catalog = open_catalog(home, cfg)
    summary = catalog.summary("mix")
    vocab = home.manifest(summary["vocab_id"])
    assert [v["vocab_id"] for v in summary["vocab_history"]][-1] == vocab.id
    assert home.manifest(summary["vocab_history"][0]["vocab_id"]).is_prefix_of(vocab)
    used: dict[str, set[int]] = {"image": set(), "audio": set()}
    for row in catalog.scan("mix").to_pylist():
        for seg in row["segments"]:
            if seg["modality"] in used:
                used[seg["modality"]] |= set(row["tokens"][seg["start"]:seg["start"] + seg["length"]])
    assert used["image"] and used["audio"] and not used["image"] & used["audio"]
    assert all(t in vocab.visual for t in used["image"])
    assert all(any(t in r for r in vocab.audio) for t in used["audio"])

    import socket

    with socket.socket() as probe:  # a launcher's environment, set through monkeypatch so that it is
        probe.bind(("127.0.0.1", 0))  # removed after the test: later subprocesses must not inherit the port
        port = probe.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    _, result = train(home, "mix", cfg, progress=False)
    leave_process_group()
    if torch.distributed.is_initialized():  # a one-rank group stays up after a run: later tests want none
        destroy_process_group()  # through DeepSpeed: it drops its cached groups
    assert np.isfinite(result.last_loss) and result.modality_loss["loss_audio"] is not None

    other = train_text_tokenizer(["other words entirely, a different corpus"] * 50, home.bundles,
                                 TextTokenizerConfig(vocab_size=300))
    bad = run("ingest", str(clips), "--dataset", "mix", "--tokenizer", other.id, "--audio-tokenizer", audio.id,
              home=home.root)
    assert bad.returncode == 2 and f"pins the text tokenizer {text_bundle.id}" in bad.stderr
    assert other.id in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_adding_changing_and_removing_files(tmp_path, text_bundle):
    """3 files of 2 records, then a fourth of 1 record: 7 samples, not 13; the same inputs
    again: nothing; a changed file's samples are replaced in one snapshot; a removed file's
    samples stay until `sync`, which deletes exactly them; after each step the catalog's
    statistics equal a recount and every file verifies."""
    import json

    from tokenloom.catalog.maintenance import verify
    from tokenloom.catalog.schema import SHARD_SCHEMA
    from tokenloom.catalog.stats import shard_stats
    from tokenloom.jobs.config import RunConfig
    from tokenloom.jobs.home import Home, open_catalog
    from tokenloom.jobs.ingest import ingest

    home = Home(tmp_path / "home")
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg = RunConfig()
    cfg.ingest.ray.progress_bars = False
    docs = tmp_path / "docs"
    docs.mkdir()

    def write(name: str, *texts: str) -> None:
        (docs / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def per_source() -> dict[str, int]:
        catalog = open_catalog(home, cfg)
        table = catalog.scan("grow")
        assert json.loads(json.dumps(catalog.summary("grow")["stats"])) == shard_stats(table.cast(SHARD_SCHEMA))
        assert verify(catalog, "grow").ok
        ids = table.column("sample_id").to_pylist()
        assert len(ids) == len(set(ids))
        names = [Path(p).name for p in table.column("source").to_pylist()]
        return {n: names.count(n) for n in sorted(set(names))}

    for i in range(3):
        write(f"f{i}.jsonl", f"first record of file {i}", f"second record of file {i}")
    refs = {"text": text_bundle.id}
    first = ingest(home, [docs], "grow", cfg, refs)
    write("f3.jsonl", "the only record of a new file")
    second = ingest(home, [docs], "grow", cfg, refs)
    third = ingest(home, [docs], "grow", cfg, refs)
    assert (first.samples, first.sources) == (6, {"new": 3, "changed": 0, "unchanged": 0, "removed": 0})
    assert (second.samples, second.sources) == (1, {"new": 1, "changed": 0, "unchanged": 3, "removed": 0})
    assert third.already_committed and third.sources["new"] == 0 and third.snapshot_id == second.snapshot_id
    assert per_source() == {"f0.jsonl": 2, "f1.jsonl": 2, "f2.jsonl": 2, "f3.jsonl": 1}

    write("f0.jsonl", "rewritten", "and grown", "by one record")
    (docs / "f1.jsonl").unlink()
    fourth = ingest(home, [docs], "grow", cfg, refs)
    assert not fourth.already_committed and fourth.sources == {"new": 0, "changed": 1, "unchanged": 2, "removed": 1}
    assert (fourth.samples, fourth.deleted_samples) == (3, 2)
    assert per_source() == {"f0.jsonl": 3, "f1.jsonl": 2, "f2.jsonl": 2, "f3.jsonl": 1}  # f1 stays without sync
    catalog = open_catalog(home, cfg)
    f0 = catalog.scan("grow", where=f"source = '{docs / 'f0.jsonl'}'")
    assert len(f0) == 3 and all(v == fourth.job_id for v in f0.column("job_id").to_pylist())

    fifth = ingest(home, [docs], "grow", cfg, refs, sync=True)
    assert (fifth.samples, fifth.deleted_samples, fifth.sources["removed"]) == (0, 2, 1)
    assert per_source() == {"f0.jsonl": 3, "f2.jsonl": 2, "f3.jsonl": 1}
    sixth = ingest(home, [docs], "grow", cfg, refs, sync=True)  # f1 left the index: nothing to do
    assert sixth.already_committed and sixth.sources == {"new": 0, "changed": 0, "unchanged": 3, "removed": 0}
    assert len(open_catalog(home, cfg).history("grow")) == 4
