"""User mistakes give one clear line and exit status 2, never a traceback."""

import json
import subprocess
import sys


def _run(*args, home):
    return subprocess.run([sys.executable, "-m", "tokenloom.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=120)


def test_unknown_dataset(tmp_path):
    r = _run("catalog", "show", "nope", home=tmp_path)
    assert r.returncode == 2
    assert "no dataset named 'nope'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_path_and_missing_tokenizer(tmp_path):
    r = _run("tokenizer", "train", "text", "--corpus", str(tmp_path / "none"), home=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "a.txt").write_text("some text")
    r = _run("ingest", str(tmp_path / "a.txt"), "--dataset", "d", home=tmp_path)
    assert r.returncode == 2 and "no text tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_malformed_config(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[train]\nstepz = 3\n")
    r = _run("train", "--dataset", "d", "--config", str(cfg), home=tmp_path)
    assert r.returncode == 2 and "unknown config key 'train.stepz'" in r.stderr
    r = _run("train", "--dataset", "../x", home=tmp_path)
    assert r.returncode == 2 and "invalid dataset name" in r.stderr


def test_catalog_ls_json_on_empty_home(tmp_path):
    r = _run("catalog", "ls", "--json", home=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout) == []


TINY_VISUAL = ["channels=8", "latent_channels=16", "vit_dim=16", "vit_depth=1", "vit_heads=2", "fusion_heads=2",
               "image_size=32", "batch_size=2", "max_pixels=4096", "eval_crops=1", "steps=3", "warmup_steps=1"]


def test_visual_tokenizer_train_then_eval_on_files(tmp_path):
    from tokenloom.datasets.samples import write_sample_images

    images = write_sample_images(tmp_path / "images", with_bad_inputs=True, variants=0)
    r = _run("tokenizer", "train", "visual", "--images", str(images), "--run", "t", "--json", *TINY_VISUAL,
             home=tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["bundle_id"].startswith("visual-") and doc["steps"] == 3 and doc["num_codes"] == 1024
    assert 0 < doc["heldout"]["usage"] <= 1 and doc["heldout"]["psnr"] > 0
    assert {x["path"].rsplit("/", 1)[-1] for x in doc["rejected"]} == {
        "truncated.png", "corrupt.jpg", "text-not-image.png", "one-pixel.png", "decompression-bomb.png", "empty.png"}
    r = _run("tokenizer", "eval", "visual", "--bundle", doc["bundle_id"], "--images", str(images / "odd"),
             "--out", str(tmp_path / "eval"), "--json", home=tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    ev = json.loads(r.stdout)
    assert ev["images"] == 7 and len(ev["per_image"]) == 7 and ev["codes"] > 0
    assert (tmp_path / "eval" / "grid.png").stat().st_size > 1000
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["psnr"] == ev["psnr"]
    # mistakes: an unknown bundle, a folder without images, a bad key
    r = _run("tokenizer", "eval", "visual", "--bundle", "visual-nope", "--images", str(images), home=tmp_path / "home")
    assert r.returncode == 2 and "no tokenizer bundle 'visual-nope'" in r.stderr and "Traceback" not in r.stderr
    r = _run("tokenizer", "eval", "visual", "--bundle", doc["bundle_id"], "--images", str(images / "bad"),
             home=tmp_path / "home")
    assert r.returncode == 2 and "no usable images" in r.stderr
    r = _run("tokenizer", "train", "visual", "--images", str(images), "factor=4", home=tmp_path / "home")
    assert r.returncode == 2 and "visual_tokenizer.factor must be 8 or 16" in r.stderr


TINY_AUDIO = ["channels=8", "max_channels=32", "latent_dim=16", "levels=4", "codebook_size=32", "code_dim=4",
              "batch_size=2", "segment_seconds=0.25", "steps=3", "warmup_steps=1", "eval_seconds=1.0"]


def test_audio_tokenizer_train_then_eval_on_files(tmp_path):
    from tokenloom.datasets.speech import write_sample_audio

    audio = write_sample_audio(tmp_path / "audio", with_bad_inputs=True, utterances=3)
    r = _run("tokenizer", "train", "audio", "--audio", str(audio), "--run", "a", "--json", *TINY_AUDIO,
             home=tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["bundle_id"].startswith("audio-") and doc["steps"] == 3 and doc["levels"] == 4
    assert sorted(doc["heldout"]["by_levels"]) == ["1", "2", "4"] and len(doc["heldout"]["usage"]) == 4
    assert len(doc["rejected"]) == 6, "every bad file is named with its reason"
    r = _run("tokenizer", "eval", "audio", "--bundle", doc["bundle_id"], "--audio", str(audio / "odd"), "--levels",
             "2", "--out", str(tmp_path / "eval"), "--json", home=tmp_path / "home")
    assert r.returncode == 0, r.stderr[-2000:]
    ev = json.loads(r.stdout)
    assert ev["clips"] == 6 and ev["levels"] == 2 and ev["bitrate"] == 50 * 2 * 5
    assert ev["si_sdr"] == ev["by_levels"]["2"]["si_sdr"]
    assert (tmp_path / "eval" / "spectrograms.png").is_file() and len(list((tmp_path / "eval").glob("*.wav"))) == 4
    r = _run("tokenizer", "eval", "audio", "--bundle", doc["bundle_id"], "--audio", str(audio), "--levels", "9",
             home=tmp_path / "home")
    assert r.returncode == 2 and "--levels must be 1..4" in r.stderr
    r = _run("tokenizer", "train", "audio", "--audio", str(audio), "frame_rate=30", home=tmp_path / "home")
    assert r.returncode == 2 and "audio_tokenizer.frame_rate must be one of" in r.stderr
