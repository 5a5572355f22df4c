"""Deduplication: the pure decision, and the ingestion job on a corpus with planted duplicates.

The planted corpus has exact copies (case and spacing changed: the same normalized text; an
image file copied with its caption), near copies (one word edited in documents of 80+ words, true
Jaccard >= 0.85 on word 5-grams; an image re-encoded, brightened, resized) and unique records
(chosen with pairwise Jaccard < 0.5). Every planted copy must be dropped with the original as
`duplicate_of`, no unique record dropped, at the default thresholds; a second job into the same
dataset is deduplicated against the first job's samples.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageEnhance

from tokenloom.catalog.schema import DUPLICATES_SCHEMA, SIGNATURES_SCHEMA
from tokenloom.datasets import dedup, sources
from tokenloom.datasets.dedup import Keys, find_duplicates, minhashes, normalize_text, shingles
from tokenloom.jobs.config import RunConfig
from tokenloom.jobs.home import Home, open_catalog
from tokenloom.jobs.ingest import ingest
from tokenloom.platform.config import DedupConfig
from tokenloom.samples.images import PHOTOS, sample_photos


def jaccard(a: str, b: str, size: int = 5) -> float:
    x, y = set(shingles(a, size)), set(shingles(b, size))
    return len(x & y) / len(x | y)


def edit_one_word(text: str, seed: int) -> str:
    words = text.split(" ")
    i = random.Random(seed).randrange(len(words) // 3, 2 * len(words) // 3)
    words[i] = words[i] + "x"
    return " ".join(words)


# -- the pure decision ----------------------------------------------------------------------

def test_normalization_and_shingles():
    assert normalize_text("  Ｈello\tWORLD \n again ") == "hello world again"
    assert dedup.text_hash("Hello  World") == dedup.text_hash("hello world\n")
    assert dedup.text_hash("hello world") != dedup.text_hash("hello worlds")
    assert shingles("too short", 5) == [b"too short"]
    assert sorted(shingles("a b c d e f", 5)) == [b"a b c d e", b"b c d e f"]


def test_content_hashes_cover_pixels_caption_and_samples():
    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    assert dedup.image_hash(pixels, "A Cat") == dedup.image_hash(pixels.copy(), "a  cat")
    assert dedup.image_hash(pixels, "a cat") != dedup.image_hash(pixels, "a dog")
    assert dedup.image_hash(pixels, None) != dedup.image_hash(pixels.reshape(2, 8, 3), None), "shape counts"
    samples = np.sin(np.arange(16_000) / 7).astype(np.float32) * 0.5
    whole, blocks = dedup.AudioHasher(), dedup.AudioHasher()
    whole.update(samples)
    for start in range(0, samples.size, 3001):  # streamed in uneven blocks: the same hash
        blocks.update(samples[start:start + 3001])
    assert whole.hexdigest("hi") == blocks.hexdigest("Hi") != whole.hexdigest("bye")
    quiet = dedup.AudioHasher()
    quiet.update(samples * 0.5)
    assert quiet.hexdigest("hi") != whole.hexdigest("hi")


def test_minhash_estimates_jaccard(corpus_texts):
    long = [t for t in corpus_texts if len(t.split()) >= 80][:20]
    edited = [edit_one_word(t, i) for i, t in enumerate(long)]
    sig = minhashes(long + edited)
    assert len(long) == 20 and sig.shape == (40, 128) and sig.dtype == np.uint32
    for i in range(len(long)):
        estimate = float((sig[i] == sig[len(long) + i]).mean())
        assert abs(estimate - jaccard(long[i], edited[i])) < 0.15


def test_decision_keeps_existing_then_smallest_source_record_and_is_order_free():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, 128, dtype=np.uint64).astype(np.uint32)
    near = base.copy()
    near[:10] = 7  # estimated Jaccard 118/128
    other = rng.integers(0, 2**32, 128, dtype=np.uint64).astype(np.uint32)
    existing = [Keys("old", content_hash="h-old", minhash=other, existing=True)]
    new = [
        Keys("b10", "b.txt", "line 10", "h1", base),
        Keys("b2", "b.txt", "line 2", "h1", base),  # exact copy of b10; line 2 sorts first
        Keys("a1", "a.txt", "line 1", "h-old", None),  # exact copy of an existing sample
        Keys("c1", "c.txt", "line 1", "h3", near),  # near copy of b2 (the kept one)
        Keys("d1", "d.txt", "line 1", "h4", other),  # near copy (identical signature) of the existing one
        Keys("e1", "e.txt", "line 1", "h5", None, phash=0b1011),
        Keys("e2", "e.txt", "line 2", "h6", None, phash=0b1011 ^ 0xFFF),  # 12 bits away: at the threshold
        Keys("e3", "e.txt", "line 3", "h7", None, phash=0b1011 ^ 0x1FFF),  # 13 bits away: kept
    ]
    want = {("b10", "b2", "exact"), ("a1", "old", "exact"), ("c1", "b2", "near-text"),
            ("d1", "old", "near-text"), ("e2", "e1", "near-image")}
    for seed in range(5):
        shuffled = random.Random(seed).sample(new, len(new))
        drops = find_duplicates(shuffled, existing)
        assert {(d.sample_id, d.duplicate_of, d.kind) for d in drops} == want
        assert [d.sample_id for d in drops] == ["a1", "b10", "c1", "d1", "e2"], "visited in (source, record) order"
    near_drop = next(d for d in drops if d.sample_id == "c1")
    assert near_drop.similarity == pytest.approx(118 / 128)
    assert next(d for d in drops if d.sample_id == "e2").similarity == pytest.approx(1 - 12 / 64)
    # switches: near kinds off leaves only exact drops; exact off leaves only near ones
    assert {d.kind for d in find_duplicates(new, existing, minhash_threshold=None, phash_threshold=None)} == {"exact"}
    assert "exact" not in {d.kind for d in find_duplicates(new, existing, exact=False)}


def test_a_chain_drops_only_what_matches_a_kept_sample():
    a = np.arange(128, dtype=np.uint32)
    b = a.copy()
    b[:20] = 10_000  # J(a, b) ~ 0.84
    c = b.copy()
    c[20:40] = 20_000  # J(b, c) ~ 0.84, J(a, c) ~ 0.69
    drops = find_duplicates([Keys("a", "s", "1", minhash=a), Keys("b", "s", "2", minhash=b),
                             Keys("c", "s", "3", minhash=c)])
    assert [(d.sample_id, d.duplicate_of) for d in drops] == [("b", "a")], "c matches only the dropped b"


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="minhash threshold"):
        find_duplicates([], minhash_threshold=1.5)
    with pytest.raises(ValueError, match="Hamming"):
        find_duplicates([], phash_threshold=65)
    with pytest.raises(ValueError, match="ingest.dedup.phash_threshold"):
        DedupConfig(phash_threshold=70).validate()


def test_phash_separates_copies_from_other_photos():
    photos = sample_photos("train")
    hashes = {name: dedup.phash(px) for name, px in photos.items()}
    names = sorted(hashes)
    others = [bin(hashes[a] ^ hashes[b]).count("1") for i, a in enumerate(names) for b in names[i + 1:]]
    img = Image.fromarray(photos["astronaut"])
    brighter = np.asarray(ImageEnhance.Brightness(img).enhance(1.1))
    assert bin(hashes["astronaut"] ^ dedup.phash(brighter)).count("1") <= DedupConfig().phash_threshold < min(others)


# -- the ingestion job --------------------------------------------------------------------

def _encode(img: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **options)
    return buffer.getvalue()


def _unique_docs(texts: list[str], count: int) -> list[str]:
    chosen: list[str] = []
    for t in texts:
        if len(t.split()) >= 80 and all(jaccard(t, c) < 0.5 for c in chosen):
            chosen.append(t)
        if len(chosen) == count:
            break
    return chosen


@pytest.fixture(scope="module")
def planted(tmp_path_factory, text_bundle, corpus_texts):
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle

    root = tmp_path_factory.mktemp("dedup")
    home = Home(root / "home")
    docs = _unique_docs(corpus_texts, 14)
    assert len(docs) == 14
    originals, later = docs[:10], docs[10:]
    job1, job2 = root / "job1", root / "job2"
    (job1 / "photos").mkdir(parents=True)
    (job1 / "z-copies").mkdir()  # sorts after photos/: the originals are the ones kept
    (job1 / "a-originals.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in originals))
    exact = {0: originals[0].upper(), 1: "  " + originals[1].replace(" ", "   ") + "\n"}  # same normalized text
    near = {2: edit_one_word(originals[2], 2), 3: edit_one_word(originals[3], 3)}
    for i, t in near.items():
        assert jaccard(t, originals[i]) >= 0.85
    copies = [exact[0], near[2], exact[1], near[3]]
    (job1 / "b-copies.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in copies))
    photos = sample_photos("train")
    names = ["astronaut", "camera", "rocket", "coins", "horse"]
    for name in names:
        Image.fromarray(photos[name]).save(job1 / "photos" / f"{name}.png")
        (job1 / "photos" / f"{name}.txt").write_text(PHOTOS[name][1] + "\n")
    # an exact copy (same pixels, same caption), and near copies: re-encoded, brightened, resized
    shutil.copy(job1 / "photos" / f"{names[0]}.png", job1 / "z-copies" / "exact.png")
    shutil.copy(job1 / "photos" / f"{names[0]}.txt", job1 / "z-copies" / "exact.txt")
    img1, img2 = Image.fromarray(photos[names[1]]), Image.fromarray(photos[names[2]])
    (job1 / "z-copies" / "reencoded.jpg").write_bytes(_encode(img1, "JPEG", quality=70))
    (job1 / "z-copies" / "brighter.png").write_bytes(_encode(ImageEnhance.Brightness(img2).enhance(1.1), "PNG"))
    small = img1.resize((img1.width * 4 // 5, img1.height * 4 // 5))
    (job1 / "z-copies" / "resized.png").write_bytes(_encode(small, "PNG"))
    # job 2: an exact and a near copy of job 1's samples, a near copy of an image, and new documents
    job2.mkdir()
    (job2 / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                             [originals[5].lower(), later[0], edit_one_word(originals[6], 6),
                                              later[1]]))
    thumb = Image.fromarray(photos[names[3]])
    thumb.resize((thumb.width * 3 // 5, thumb.height * 3 // 5)).save(job2 / "thumb.jpg", quality=80)

    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.visual_tokenizer = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                 vit_heads=2, fusion_heads=2, max_pixels=64 * 64)
    untrained = VisualTokenizer(cfg.visual_tokenizer)
    untrained.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_bundle(untrained.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg.ingest.ray.progress_bars = False
    bundles = {"text": text_bundle.id, "visual": visual.id}
    first = ingest(home, [job1], "dups", cfg, bundles)
    catalog = open_catalog(home, cfg)
    rows1 = catalog.scan("dups").to_pylist()
    snap1 = catalog.snapshot("dups")
    second = ingest(home, [job2], "dups", cfg, bundles)
    snap2 = catalog.snapshot("dups")
    rows2 = catalog.scan("dups").to_pylist()

    def sid(path, record):
        return sources.sample_id(str(path.resolve()), record)

    expected1 = {  # dropped sample id -> the kept one it duplicates, and the kind
        sid(job1 / "b-copies.jsonl", "line 1"): (sid(job1 / "a-originals.jsonl", "line 1"), "exact"),
        sid(job1 / "b-copies.jsonl", "line 2"): (sid(job1 / "a-originals.jsonl", "line 3"), "near-text"),
        sid(job1 / "b-copies.jsonl", "line 3"): (sid(job1 / "a-originals.jsonl", "line 2"), "exact"),
        sid(job1 / "b-copies.jsonl", "line 4"): (sid(job1 / "a-originals.jsonl", "line 4"), "near-text"),
        sid(job1 / "z-copies" / "exact.png", "file"): (sid(job1 / "photos" / f"{names[0]}.png", "file"), "exact"),
        sid(job1 / "z-copies" / "reencoded.jpg", "file"): (sid(job1 / "photos" / f"{names[1]}.png", "file"),
                                                         "near-image"),
        sid(job1 / "z-copies" / "brighter.png", "file"): (sid(job1 / "photos" / f"{names[2]}.png", "file"),
                                                        "near-image"),
        sid(job1 / "z-copies" / "resized.png", "file"): (sid(job1 / "photos" / f"{names[1]}.png", "file"),
                                                       "near-image"),
    }
    expected2 = {
        sid(job2 / "more.jsonl", "line 1"): (sid(job1 / "a-originals.jsonl", "line 6"), "exact"),
        sid(job2 / "more.jsonl", "line 3"): (sid(job1 / "a-originals.jsonl", "line 7"), "near-text"),
        sid(job2 / "thumb.jpg", "file"): (sid(job1 / "photos" / f"{names[3]}.png", "file"), "near-image"),
    }
    return {"catalog": catalog, "first": first, "second": second, "rows1": rows1, "rows2": rows2,
            "snap1": snap1, "snap2": snap2, "expected1": expected1, "expected2": expected2,
            "inputs1": 10 + 4 + len(names) + 4, "inputs2": 5}


def _duplicates(snap) -> list[dict]:
    files = json.loads(snap.tokenloom["duplicates_files"])
    rows = []
    for uri in files:
        table = pq.read_table(uri.removeprefix("file://"))
        assert table.schema.equals(DUPLICATES_SCHEMA)
        rows += table.to_pylist()
    return rows


@pytest.mark.integration
def test_every_planted_duplicate_is_dropped_and_no_unique_one(planted):
    rows, snap = planted["rows1"], planted["snap1"]
    expected = planted["expected1"]
    dropped = {r["sample_id"]: (r["duplicate_of"], r["kind"]) for r in _duplicates(snap)}
    assert dropped == expected
    kept = {r["sample_id"] for r in rows}
    assert len(rows) == planted["inputs1"] - len(expected), "every unique record is committed"
    assert not kept & set(expected) and {k for k, _ in expected.values()} <= kept
    counts = json.loads(snap.tokenloom["duplicate_counts"])
    assert counts == {"exact": 3, "near-image": 3, "near-text": 2}
    assert int(snap.tokenloom["duplicates"]) == len(expected)
    for r in _duplicates(snap):
        assert r["job_id"] == planted["first"].job_id and r["reason"]
        assert r["similarity"] == 1.0 if r["kind"] == "exact" else 0.8 <= r["similarity"] <= 1.0


@pytest.mark.integration
def test_rewritten_files_keep_checksums_and_stats_exact(planted):
    catalog, snap, rows = planted["catalog"], planted["snap1"], planted["rows1"]
    first = planted["first"]
    assert first.samples == len(rows) == int(snap.tokenloom["samples"])
    assert first.tokens == sum(r["num_tokens"] for r in rows) == int(snap.tokenloom["tokens"])
    stats = json.loads(snap.tokenloom["stats"])
    assert stats["samples"] == len(rows) and sum(stats["length_hist"]) == len(rows)
    assert stats["modalities"]["image"]["samples"] == sum("image" in r["modalities"] for r in rows)
    checksums = json.loads(Path(snap.tokenloom["checksums_file"].removeprefix("file://")).read_text())
    files = [f.path for f in catalog.data_files("dups", snap.snapshot_id)]
    assert sorted(checksums) == sorted(files)
    for uri in files:
        assert hashlib.sha256(Path(uri.removeprefix("file://")).read_bytes()).hexdigest() == checksums[uri]
    assert all(r["content_hash"] for r in rows), "every new shard row carries its content hash"
    signatures = pq.read_table(snap.tokenloom["signatures_file"].removeprefix("file://"))
    assert signatures.schema.equals(SIGNATURES_SCHEMA)
    by_modality = dict(zip(signatures.column("sample_id").to_pylist(), signatures.column("modality").to_pylist(),
                           strict=True))
    assert set(by_modality) == {r["sample_id"] for r in rows}, "a signature per kept sample"


@pytest.mark.integration
def test_a_second_job_is_deduplicated_against_the_dataset(planted):
    snap, rows = planted["snap2"], planted["rows2"]
    expected = planted["expected2"]
    dropped = {r["sample_id"]: (r["duplicate_of"], r["kind"]) for r in _duplicates(snap)}
    assert dropped == expected
    job2 = [r for r in rows if r["job_id"] == planted["second"].job_id]
    assert len(job2) == planted["inputs2"] - len(expected) == planted["second"].samples == 2
    assert len(rows) == len(planted["rows1"]) + 2
    assert json.loads(snap.tokenloom["duplicate_counts"]) == {"exact": 1, "near-image": 1, "near-text": 1}
