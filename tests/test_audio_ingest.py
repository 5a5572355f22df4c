"""Audio through the ingestion job: transcripts, pairs, long files in chunks, bad files, decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch

from tokenloom.datasets import sources
from tokenloom.jobs.config import RunConfig
from tokenloom.jobs.home import Home, open_catalog
from tokenloom.jobs.ingest import ingest
from tokenloom.jobs.tokenizer import decode_sample
from tokenloom.samples.audio import tone, write_sample_audio

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, text_bundle):
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, publish_bundle

    root = tmp_path_factory.mktemp("audio-ingest")
    home = Home(root / "home")
    inputs = root / "inputs"
    write_sample_audio(inputs, with_bad_inputs=True, utterances=3)
    sf.write(inputs / "long-tone.wav", tone((220.0, 330.0), 20.0), 16_000, subtype="PCM_16")  # 20 s, 10 chunks
    (inputs / "notes.txt").write_text("Some text beside the recordings.\n")
    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.ingest.text_first = 0.0  # media first in every sample: the layout checks below read it so
    cfg.audio_tokenizer = AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=4,
                                               codebook_size=32, code_dim=4, chunk_seconds=2.0)
    model = AudioTokenizer(cfg.audio_tokenizer)
    model.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    audio = publish_bundle(model.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg.ingest.ray.progress_bars = False
    result = ingest(home, [inputs], "sounds", cfg, {"text": text_bundle.id, "audio": audio.id})
    rows = open_catalog(home, cfg).scan("sounds").to_pylist()
    return home, cfg, inputs, result, rows, audio


def test_every_good_file_once_with_its_transcript(ingested):
    home, cfg, inputs, result, rows, _ = ingested
    files, _ = sources.discover([inputs])
    standalone = {f.path for f in files if f.modality == "audio" and not f.path.endswith(".jsonl")
                  and "/bad/" not in f.path}
    # valid but clipped recordings (odd/clipped.wav) are dropped by the audio.clipping filter:
    # counted here from the files themselves, and found in the job's filtered side file
    clipped = {p for p in standalone if np.mean(np.abs(sf.read(p, always_2d=True)[0]) >= 0.999) >
               cfg.ingest.filters.audio.max_clipping_fraction}
    assert {Path(p).name for p in clipped} == {"clipped.wav"}
    snap = open_catalog(home, cfg).snapshot("sounds").tokenloom
    filtered = [r for uri in json.loads(snap["filtered_files"]) for r in pq.read_table(uri.removeprefix("file://")).to_pylist()]
    assert {r["source"]: r["filter"] for r in filtered} == dict.fromkeys(clipped, "audio.clipping")
    standalone -= clipped
    assert {f.path for f in files if f.modality == sources.REFERENCED} == {
        str(p.resolve()) for p in (inputs / "paired").glob("*.wav")}
    audio_rows = [r for r in rows if "audio" in r["modalities"]]
    pairs = str((inputs / "pairs.jsonl").resolve())
    assert sorted(r["source"] for r in audio_rows if r["source"] != pairs) == sorted(standalone)
    assert sum(r["source"] == pairs for r in audio_rows) == 3
    assert len({r["sample_id"] for r in rows}) == len(rows) == result.samples


def test_bad_audio_is_quarantined_with_reasons(ingested):
    _, _, _, result, _, _ = ingested
    reasons = result.quarantine_reasons
    assert reasons["unreadable audio"] == 2 and reasons["empty file"] == 1
    assert reasons["zero-length audio"] == 1 and reasons["non-finite samples (NaN or infinity)"] == 2
    assert result.quarantined == 6


def test_audio_samples_follow_the_group_contract(ingested):
    home, cfg, inputs, result, rows, audio = ingested
    from tokenloom.tokenizers.vocab import VocabManifest

    vocab = VocabManifest.load(home.vocab / f"{rows[0]['vocab_id']}.json")
    assert len(vocab.audio) == 4 and all(r.size == 32 for r in vocab.audio) and vocab.bundles["audio"] == audio.id
    speech = next(r for r in rows if r["source"].endswith("speech-000.wav"))
    text, sound, tail = speech["segments"]
    frames, levels = sound["grid"]
    assert (sound["modality"], sound["attention"], levels, sound["length"]) == ("audio", "window", 4, frames * 4)
    ids = np.asarray(speech["tokens"][sound["start"]:sound["start"] + sound["length"]]).reshape(frames, 4)
    for level in range(4):  # frame-major: column l holds level-l ids
        assert all(t in vocab.audio[level] for t in ids[:, level])
    assert speech["tokens"][:2] == [vocab.bos_id, vocab.specials["<boa>"]]
    assert speech["tokens"][sound["start"] + sound["length"]] == vocab.specials["<eoa>"]
    long = next(r for r in rows if r["source"].endswith("long-tone.wav"))
    assert long["segments"][1]["grid"] == [20 * 50, 4], "20 s at 50 frames/s, encoded in 2 s chunks"


def test_decode_writes_the_audio_back(ingested, tmp_path):
    home, cfg, inputs, result, rows, _ = ingested
    speech = next(r for r in rows if r["source"].endswith("speech-000.wav"))
    doc = decode_sample(home, cfg, "sounds", speech["sample_id"], tmp_path / "speech.wav")
    assert doc["images"] == [] and len(doc["audio"]) == 1
    wav, rate = sf.read(doc["audio"][0])
    frames = speech["segments"][1]["grid"][0]
    assert rate == 16_000 and len(wav) == frames * 320
    transcript = (inputs / "speech-000.txt").read_text().strip()
    assert any(transcript in t for t in doc["text"])
    one = decode_sample(home, cfg, "sounds", speech["sample_id"], tmp_path / "coarse.wav", levels=1)
    coarse, _ = sf.read(one["audio"][0])
    assert len(coarse) == len(wav) and not np.allclose(coarse, wav)
