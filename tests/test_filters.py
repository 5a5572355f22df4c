"""Quality filters: the measures and the registry, and the ingestion job on planted records.

Each filter gets records planted to fail it (and only it: the preconditions are asserted), beside
good records; the job must drop exactly the planted ones, each under its filter's name, write
them to `filtered/` side files (not quarantine), and count them in the snapshot summary.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from PIL import Image

from tokenloom.catalog.schema import FILTERED_SCHEMA
from tokenloom.datasets import filters, sources
from tokenloom.datasets.filters import FILTERS, FilterConfig, first_failure
from tokenloom.jobs.config import RunConfig, apply_overrides
from tokenloom.jobs.home import Home, open_catalog
from tokenloom.jobs.ingest import ingest
from tokenloom.samples.audio import tone
from tokenloom.samples.images import PHOTOS, sample_photos


def test_text_measures():
    m = filters.text_measures("ab, cd!\nab, cd!\n\nxyz", 5)
    assert m["chars"] == 20 and m["tokens"] == 5
    assert m["alnum_fraction"] == pytest.approx(11 / 15)  # abcd abcd xyz of 15 non-space characters
    assert m["repeated_line_fraction"] == pytest.approx(7 / 17)  # the second "ab, cd!" of 7 + 7 + 3
    assert filters.text_measures("", 0) == {"chars": 0.0, "tokens": 0.0, "alnum_fraction": 0.0,
                                            "repeated_line_fraction": 0.0}


def test_each_filter_names_itself_and_zero_switches_a_bound_off():
    cfg = FilterConfig()
    cfg.text.max_chars, cfg.text.max_tokens = 100, 20
    good = {"chars": 50.0, "tokens": 10.0, "alnum_fraction": 0.9, "repeated_line_fraction": 0.0}
    assert first_failure("text", good, cfg) is None
    cases = {"text.min_chars": {"chars": 3.0}, "text.max_chars": {"chars": 300.0}, "text.min_tokens": {"tokens": 1.0},
             "text.max_tokens": {"tokens": 30.0}, "text.alnum_fraction": {"alnum_fraction": 0.1},
             "text.repeated_lines": {"repeated_line_fraction": 0.8}}
    for name, change in cases.items():
        failed = first_failure("text", good | change, cfg)
        assert failed is not None and failed[0] == name and failed[1]
    cfg.text.max_chars = 0
    assert first_failure("text", good | {"chars": 10**7}, cfg) is None
    cfg.enabled = False
    assert first_failure("text", good | {"chars": 1.0}, cfg) is None
    assert {kind for kind, _ in FILTERS.values()} == {"text", "image", "audio"}


def test_image_measures_and_filters():
    rng = np.random.default_rng(0)
    cfg = FilterConfig()
    photo = sample_photos("train")["astronaut"]
    assert first_failure("image", filters.image_measures(photo), cfg) is None
    flat = np.full((64, 64, 3), 128, np.uint8)
    flat[0, 0] = 129  # one pixel off: still near-constant
    assert first_failure("image", filters.image_measures(flat), cfg)[0] == "image.near_constant"
    thin = rng.integers(0, 256, (12, 40, 3), dtype=np.uint8)
    assert first_failure("image", filters.image_measures(thin), cfg)[0] == "image.min_side"
    strip = rng.integers(0, 256, (20, 400, 3), dtype=np.uint8)
    m = filters.image_measures(strip)
    assert m["aspect_ratio"] == 20 and first_failure("image", m, cfg)[0] == "image.aspect_ratio"


def test_audio_meter_streams_to_the_same_measures():
    rate = 16_000
    signal = np.concatenate([tone((440.0,), 1.0), np.zeros(rate, np.float32), np.ones(160, np.float32)])
    whole = filters.audio_measures(signal, rate, 1e-3)
    meter = filters.AudioMeter(rate, 1e-3)
    streamed = np.concatenate(list(meter.tap(signal[i:i + 777] for i in range(0, signal.size, 777))))
    assert np.array_equal(streamed, signal), "tap passes the blocks through unchanged"
    assert meter.measures() == pytest.approx(whole)
    assert whole["seconds"] == pytest.approx(2.01)
    windows = -(-signal.size // 320)  # 20 ms windows, the last one padded
    assert whole["silence_fraction"] == pytest.approx(50 / windows)
    assert whole["clipping_fraction"] == pytest.approx(160 / signal.size)


def test_config_is_validated_and_travels_as_a_dict():
    cfg = RunConfig()
    apply_overrides(cfg.ingest, ["filters.text.min_chars=20", "filters.audio.max_silence_fraction=0.5",
                                 "dedup.phash_threshold=8", "dedup.text=false"], "ingest.")
    assert cfg.ingest.filters.text.min_chars == 20 and cfg.ingest.dedup.phash_threshold == 8
    assert not cfg.ingest.dedup.text
    assert filters.from_dict(dataclasses.asdict(cfg.ingest.filters)) == cfg.ingest.filters
    cfg.ingest.filters.audio.max_clipping_fraction = 2.0
    with pytest.raises(ValueError, match="max_clipping_fraction must be in"):
        cfg.ingest.validate()
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(cfg.ingest, ["filters.text.min_words=3"], "ingest.")


@pytest.fixture(scope="module")
def filtered_job(tmp_path_factory, text_bundle, corpus_texts):
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, publish_bundle
    from tokenloom.tokenizers.text import TextTokenizer
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual

    root = tmp_path_factory.mktemp("filters")
    home, inputs = Home(root / "home"), root / "inputs"
    inputs.mkdir()
    count = TextTokenizer.load(text_bundle.path).encode_batch
    good = list(dict.fromkeys(t for t in corpus_texts if 200 < len(t) < 1500))[:6]  # distinct (the corpus repeats some)
    assert len(good) == 6
    one_word = next(w for w in ("function", "returned", "argument", "attribute", "interpreter")
                    if len(count([w])[0]) < 3)
    long_doc = "\n".join(t for t in corpus_texts if 1000 < len(t) < 1500)[:2600]
    very_long = "\n".join(t for t in corpus_texts if 1000 < len(t) < 4000)[:6000]
    assert (len(long_doc), len(very_long)) == (2600, 6000)
    max_tokens = len(count([long_doc])[0]) - 1
    assert max(len(ids) for ids in count(good)) <= max_tokens < len(count([very_long])[0])
    planted_text = {  # line number -> the filter that must drop it
        2: ("text.min_chars", "tiny"),
        3: ("text.max_chars", very_long),
        4: ("text.min_tokens", one_word),
        5: ("text.max_tokens", long_doc),
        6: ("text.alnum_fraction", "!!! ??? ... --- *** ### @@@ %%% ^^^ &&& ((( ))) +++ === ~~~ |||"),
        7: ("text.repeated_lines", "a line said again\n" * 6 + "and one more line at the end"),
    }
    lines = [good[0]] + [text for _, text in planted_text.values()] + good[1:] + [good[1]]  # good[1] twice
    (inputs / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    rng = np.random.default_rng(0)
    photos = sample_photos("train")
    for name in ("astronaut", "coins"):
        Image.fromarray(photos[name]).save(inputs / f"{name}.png")
        (inputs / f"{name}.txt").write_text(PHOTOS[name][1] + "\n")
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(inputs / "flat.png")
    Image.fromarray(rng.integers(0, 256, (12, 40, 3), dtype=np.uint8)).save(inputs / "thin.png")
    Image.fromarray(rng.integers(0, 256, (20, 400, 3), dtype=np.uint8)).save(inputs / "strip.png")
    sf.write(inputs / "tone.wav", tone((330.0, 440.0), 1.0), 16_000, subtype="PCM_16")
    sf.write(inputs / "silent.wav", np.zeros(32_000), 16_000, subtype="PCM_16")
    sf.write(inputs / "clipped.wav", np.clip(tone((330.0,), 1.0) * 8, -1, 1), 16_000, subtype="PCM_16")
    sf.write(inputs / "blip.wav", tone((440.0,), 0.1), 16_000, subtype="PCM_16")
    sf.write(inputs / "long.wav", tone((220.0,), 12.0), 16_000, subtype="PCM_16")

    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.ingest.ray.progress_bars = False
    # the filters are under test here; the duplicate line checks that dedup can be switched off
    cfg.ingest.dedup.enabled = False
    cfg.ingest.filters.text.max_chars, cfg.ingest.filters.text.min_tokens = 5000, 3
    cfg.ingest.filters.text.max_tokens = max_tokens
    cfg.ingest.filters.audio.max_seconds = 10.0
    cfg.visual_tokenizer = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                 vit_heads=2, fusion_heads=2, max_pixels=64 * 64)
    untrained = VisualTokenizer(cfg.visual_tokenizer)
    untrained.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_visual(untrained.eval(), home.bundles)
    cfg.audio_tokenizer = AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=4,
                                               codebook_size=32, code_dim=4, chunk_seconds=2.0)
    model = AudioTokenizer(cfg.audio_tokenizer)
    model.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    audio = publish_bundle(model.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    result = ingest(home, [inputs], "quality", cfg, {"text": text_bundle.id, "visual": visual.id, "audio": audio.id})
    catalog = open_catalog(home, cfg)
    texts = str((inputs / "texts.jsonl").resolve())
    expected = {sources.sample_id(texts, f"line {n}"): name for n, (name, _) in planted_text.items()}
    for file, name in (("flat.png", "image.near_constant"), ("thin.png", "image.min_side"),
                       ("strip.png", "image.aspect_ratio"), ("silent.wav", "audio.silence"),
                       ("clipped.wav", "audio.clipping"), ("blip.wav", "audio.min_seconds"),
                       ("long.wav", "audio.max_seconds")):
        expected[sources.sample_id(str((inputs / file).resolve()), "file")] = name
    return result, catalog.snapshot("quality"), catalog.scan("quality").to_pylist(), expected, len(lines) + 5 + 5


@pytest.mark.integration
def test_each_filter_drops_exactly_its_planted_records(filtered_job):
    result, snap, rows, expected, inputs = filtered_job
    tl = snap.tokenloom
    filtered = []
    for uri in json.loads(tl["filtered_files"]):
        table = pq.read_table(uri.removeprefix("file://"))
        assert table.schema.equals(FILTERED_SCHEMA), "filtered side files have the filtered schema"
        filtered += table.to_pylist()
    assert {r["sample_id"]: r["filter"] for r in filtered} == expected
    assert all(r["reason"] and r["job_id"] == result.job_id for r in filtered)
    modality = {r["filter"]: r["modality"] for r in filtered}
    assert all(modality[name] == name.split(".")[0] for name in expected.values())
    assert int(tl["filtered"]) == len(expected) == len(filtered)
    counts = json.loads(tl["filter_counts"])
    assert counts == {name: list(expected.values()).count(name) for name in set(expected.values())}
    # filtered records are valid input: not quarantined, not committed; everything else is committed
    assert result.quarantined == 0
    kept = {r["sample_id"] for r in rows}
    assert not kept & set(expected)
    assert len(rows) == result.samples == inputs - len(expected)


@pytest.mark.integration
def test_dedup_switched_off_keeps_a_repeated_record(filtered_job):
    _, snap, rows, _, _ = filtered_job
    assert snap.tokenloom["duplicates"] == "0" and json.loads(snap.tokenloom["duplicates_files"]) == []
    hashes = [r["content_hash"] for r in rows]
    assert len(hashes) - len(set(hashes)) == 1, "the line given twice is kept twice"
