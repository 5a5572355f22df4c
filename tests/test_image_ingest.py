"""Images through the ingestion job: routing, captions, pairs, bad files, the visual pool, decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenloom.datasets import sources
from tokenloom.jobs.config import RunConfig
from tokenloom.jobs.home import Home, open_catalog
from tokenloom.jobs.ingest import ingest
from tokenloom.jobs.tokenizer import decode_sample
from tokenloom.samples.images import write_bad_images, write_odd_images, write_sample_images

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, text_bundle):
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle

    root = tmp_path_factory.mktemp("image-ingest")
    home = Home(root / "home")
    inputs = root / "inputs"
    write_sample_images(inputs / "photos", with_bad_inputs=False, variants=1)
    bad = write_bad_images(inputs / "bad")
    odd = write_odd_images(inputs / "odd")
    (inputs / "notes.txt").write_text("A plain text document that sits beside the pictures.\n")
    # a text corpus whose records carry image metadata (a URL) stays a text corpus
    (inputs / "web.jsonl").write_text(json.dumps({"text": "A web page.", "image": "https://x.org/a.png"}) + "\n")
    write_sample_images(root / "outside-src", with_bad_inputs=False, variants=0)
    shutil.copy(root / "outside-src" / "camera.png", root / "outside.png")
    (inputs / "odd" / "grayscale.txt").write_bytes(b"caption \xff broken")  # a caption that is not UTF-8
    pairs = inputs / "more-pairs.jsonl"
    pairs.write_text("\n".join([
        json.dumps({"image": "photos/rocket.webp", "text": "A rocket, paired by a jsonl record."}),
        json.dumps({"text": "A text-only line of a pairs file."}),
        json.dumps({"image": "photos/missing.png", "text": "names a file that does not exist"}),
        json.dumps({"image": "../outside.png", "text": "escapes its folder"}),
        json.dumps({"image": "/etc/hostname", "text": "an absolute path"}),
        "{not json",
    ]) + "\n")
    # bundles: the shared text BPE and an (untrained) tiny visual tokenizer: ingestion is what is tested
    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.ingest.text_first = 0.0  # media first in every sample: the layout checks below read it so
    cfg.visual_tokenizer = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                 vit_heads=2, fusion_heads=2, max_pixels=64 * 64)
    untrained = VisualTokenizer(cfg.visual_tokenizer)
    untrained.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_bundle(untrained.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg.ingest.ray.progress_bars = False
    cfg.ingest.ray.num_cpus = 0
    result = ingest(home, [inputs], "mixed", cfg, {"text": text_bundle.id, "visual": visual.id})
    rows = open_catalog(home, cfg).scan("mixed").to_pylist()
    return home, cfg, inputs, result, rows, bad, odd, visual


def test_routing_captions_and_pairs_files(tmp_path):
    write_sample_images(tmp_path, with_bad_inputs=False, variants=0)
    files, skipped = sources.discover([tmp_path])
    kinds = {Path(f.path).name: f.modality for f in files}
    assert kinds["retina.jpg"] == "image" and kinds["retina.txt"] == sources.CAPTION
    assert kinds["pairs.jsonl"] == "image", "a .jsonl whose first record names an image is a pairs file"
    assert kinds["rocket.webp"] == "image" and kinds["coins.bmp"] == "image"
    # images a pairs file names are samples of that file, not samples of their own (but count for lineage)
    assert kinds["astronaut.jpg"] == sources.REFERENCED
    assert not skipped
    # a single image given alone brings its caption into the lineage
    alone, _ = sources.discover([tmp_path / "retina.jpg"])
    assert {Path(f.path).name: f.modality for f in alone} == {"retina.jpg": "image", "retina.txt": sources.CAPTION}


def test_every_good_image_is_committed_once(ingested):
    home, cfg, inputs, result, rows, bad, odd, _ = ingested
    files, _ = sources.discover([inputs])
    standalone = {f.path for f in files if f.modality == "image" and not f.path.endswith(".jsonl")
                  and "/bad/" not in f.path} - {str((inputs / "odd" / "grayscale.png").resolve())}  # bad caption
    referenced = {f.path for f in files if f.modality == sources.REFERENCED}
    assert len(referenced) == 5  # 4 photos of photos/pairs.jsonl + the rocket of more-pairs.jsonl
    images = [r for r in rows if any(s["modality"] == "image" for s in r["segments"])]
    by_source: dict[str, int] = {}
    for r in images:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    pairs_files = {str(p.resolve()) for p in inputs.rglob("*pairs.jsonl")}
    assert {s for s in by_source if s not in pairs_files} == standalone
    assert all(by_source[s] == 1 for s in standalone)
    assert sum(by_source.get(s, 0) for s in pairs_files) == 5
    assert not referenced & set(by_source), "a paired image is not also a sample of its own"
    assert len({r["sample_id"] for r in rows}) == len(rows), "no sample twice"
    assert result.samples == len(rows)


def test_bad_images_are_quarantined_with_their_reason(ingested):
    home, cfg, inputs, result, rows, bad, odd, _ = ingested
    reasons = result.quarantine_reasons
    assert reasons["truncated or corrupt image"] == 2
    assert reasons["content is not an image (looks like UTF-8 text)"] == 1
    assert reasons["image too small"] == 1
    assert reasons["decompression bomb"] == 1
    assert reasons["empty file"] == 1
    assert reasons["caption is not valid UTF-8"] == 1
    assert reasons["image file not found"] == 1
    assert reasons["image path leaves the pairs file's folder"] == 1
    assert reasons["image path must be relative to the pairs file's folder"] == 1
    assert reasons["malformed JSON"] == 1
    assert result.quarantined == sum(reasons.values()) == 11


def test_image_samples_follow_the_shard_contract(ingested):
    home, cfg, inputs, result, rows, *_ , visual = ingested
    from tokenloom.tokenizers.vocab import VocabManifest

    vocab = VocabManifest.load(home.vocab / f"{rows[0]['vocab_id']}.json")
    assert vocab.visual.size == 512 and vocab.bundles["visual"] == visual.id
    assert sorted(rows[0]["bundle_ids"]) == sorted([visual.id, vocab.bundles["text"]])
    captioned = next(r for r in rows if r["source"].endswith("retina.jpg"))
    text, image, tail = captioned["segments"]
    assert (text["modality"], text["length"], image["modality"], image["attention"]) == ("text", 2, "image",
                                                                                          "bidirectional")
    h, w = image["grid"]
    assert h * w == image["length"] and h * 8 * w * 8 <= 64 * 64
    toks = captioned["tokens"]
    assert toks[:2] == [vocab.bos_id, vocab.specials["<boi>"]] and toks[-1] == vocab.eos_id
    assert toks[image["start"] + image["length"]] == vocab.specials["<eoi>"]
    assert all(t in vocab.visual for t in toks[image["start"]:image["start"] + image["length"]])
    assert captioned["modalities"] == "image+text"
    text_only = [r for r in rows if r["modalities"] == "text"]
    assert {Path(r["source"]).name for r in text_only} == {"notes.txt", "more-pairs.jsonl", "web.jsonl"}


def test_decode_turns_a_sample_back_into_its_image(ingested, tmp_path):
    home, cfg, inputs, result, rows, *_ = ingested
    sample = next(r for r in rows if r["source"].endswith("retina.jpg"))
    doc = decode_sample(home, cfg, "mixed", sample["sample_id"], tmp_path / "retina")  # no suffix: PNG
    from PIL import Image

    decoded = np.asarray(Image.open(doc["images"][0]))
    h, w = next(s for s in sample["segments"] if s["modality"] == "image")["grid"]
    assert decoded.shape == (h * 8, w * 8, 3)
    caption = (inputs / "photos" / "retina.txt").read_text().strip()
    assert any(caption in t for t in doc["text"])
    with pytest.raises(ValueError, match="no sample"):
        decode_sample(home, cfg, "mixed", "nope", tmp_path / "x.png")


def test_image_pool_worker_edge_cases(tmp_path, text_bundle):
    """The pool's callable on its own: empty and text-only batches, a one-row-high image, a bad file."""
    import io

    import pyarrow as pa
    from PIL import Image

    from tokenloom.platform.ingest import RECORD_SCHEMA
    from tokenloom.platform.workers import ImagePoolWorker
    from tokenloom.tokenizers.sequence import TextPart
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle
    from tokenloom.tokenizers.vocab import VocabManifest

    torch.manual_seed(0)
    cfg = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1, vit_heads=2, fusion_heads=2,
                                max_pixels=64 * 64)
    untrained = VisualTokenizer(cfg)
    untrained.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_bundle(untrained.eval(), tmp_path)
    vocab = VocabManifest.build(text_bundle.config["vocab_size"], visual_size=1024)
    # the quality filters are off: this test feeds a flat 8x400 strip (which they drop, see
    # tests/test_filters.py) to check how the tokenizer lays out an extreme shape
    no_filters = {"enabled": False}
    worker = ImagePoolWorker({"text": str(text_bundle.path), "visual": str(visual.path)}, vocab.to_dict(),
                             quality=no_filters)

    def batch(rows):
        cols = {name: [r.get(name) for r in rows] for name in RECORD_SCHEMA.names}
        return pa.table(cols, schema=RECORD_SCHEMA)

    assert worker(batch([])).num_rows == 0
    out = worker(batch([{"sample_id": "t", "payload": "only words", "modality": "text"}])).to_pylist()
    assert out[0]["segments"][0]["modality"] == "text" and out[0]["error"] is None

    thin = io.BytesIO()
    Image.fromarray(np.full((8, 400, 3), 200, np.uint8)).save(thin, "PNG")
    out = worker(batch([
        {"sample_id": "thin", "payload": None, "blob": thin.getvalue(), "modality": "image"},
        {"sample_id": "bad", "payload": "caption", "blob": b"not an image at all", "modality": "image"},
        {"sample_id": "q", "payload": None, "error": "quarantined upstream", "modality": "image"},
    ])).to_pylist()
    seg = out[0]["segments"][1]
    assert seg["modality"] == "image" and seg["grid"][0] == 1 and seg["length"] == seg["grid"][1]
    assert out[0]["tokens"][-2:] == [vocab.specials["<eoi>"], vocab.eos_id], "no caption: <eoi> <eos>"
    assert out[1]["tokens"] is None and out[1]["error"].startswith("content is not an image")
    assert out[2]["error"] == "quarantined upstream" and out[2]["tokens"] is None
    # with the default filters the same strip is valid input the pool marks as filtered, unencoded
    default = ImagePoolWorker({"text": str(text_bundle.path), "visual": str(visual.path)}, vocab.to_dict())
    marked = default(batch([{"sample_id": "thin", "payload": None, "blob": thin.getvalue(),
                             "modality": "image"}])).to_pylist()[0]
    assert (marked["filter"], marked["error"], marked["modality"]) == ("image.min_side", None, "image")
    assert marked["tokens"] is None and marked["filter_reason"].startswith("smallest side 8 px")

    # ingest.text_first: that share of captioned images is laid out caption first (text -> image)
    first = ImagePoolWorker({"text": str(text_bundle.path), "visual": str(visual.path)}, vocab.to_dict(), 1.0,
                            quality=no_filters)
    row = {"sample_id": "c", "payload": "a thin grey bar", "blob": thin.getvalue(), "modality": "image"}
    out = first(batch([row])).to_pylist()[0]
    assert [s["modality"] for s in out["segments"]] == ["text", "image", "text"]
    assert out["tokens"][-2:] == [vocab.specials["<eoi>"], vocab.eos_id] and out["segments"][0]["length"] > 2
    ids = [f"sample-{i}" for i in range(2000)]
    share = np.mean([isinstance(first._layout(i, [object()], np.zeros(1))[0], TextPart) for i in ids])
    assert share == 1.0
    first.text_first = 0.5
    share = np.mean([isinstance(first._layout(i, [object()], np.zeros(1))[0], TextPart) for i in ids])
    assert 0.45 < share < 0.55  # a fixed hash of the sample id picks half
