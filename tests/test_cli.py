"""User mistakes give one clear line and exit status 2, never a traceback.

The command runs in this process (tests/cli_runner.py); test_readme.py runs it as users do, in a
shell, and checks the tokenizer commands' outputs and mistakes on the files it made.
"""

import json
import subprocess
import sys

import pytest
from cli_runner import run as _run


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


def test_a_user_mistake_in_a_subprocess_is_one_line_and_status_2(tmp_path):
    """As users run it: a new interpreter, stderr holds the one line and no traceback."""
    r = subprocess.run([sys.executable, "-m", "tokenloom.cli", "catalog", "show", "nope", "--home", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no dataset named 'nope'" in r.stderr


def test_a_damaged_bundle_is_named_in_one_line(tmp_path, text_bundle):
    """A bundle whose weights were damaged on disk stops eval and ingest with its name, exit 2."""
    import shutil

    import torch

    from tokenloom.samples.images import write_sample_images
    from tokenloom.tokenizers.bundle import BundleError
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig, load_visual
    from tokenloom.tokenizers.visual.train import publish_bundle

    home = tmp_path / "home"
    shutil.copytree(text_bundle.path, home / "bundles" / text_bundle.id)
    model = VisualTokenizer(VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                  vit_heads=2, fusion_heads=2))
    model.init_codebook(torch.rand(64, 3, 32, 32))
    info = publish_bundle(model.eval(), home / "bundles")
    weights = info.path / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])  # the header length now says 2^64 - 1
    with pytest.raises(BundleError, match=f"tokenizer bundle {info.id} is damaged: .*header too large"):
        load_visual(info.path)
    images = write_sample_images(tmp_path / "images", with_bad_inputs=False, variants=0)
    for args in (("tokenizer", "eval", "visual", "--bundle", info.id, "--images", str(images)),
                 ("ingest", str(images), "--dataset", "d", "--visual-tokenizer", info.id)):
        r = _run(*args, home=home)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and f"bundle {info.id} is damaged" in r.stderr


def test_path_options_take_several_values():
    from tokenloom.cli import expand_multi_path_options as expand

    assert expand(["tokenizer", "train", "visual", "--images", "a.png", "b/", "--heldout", "c.png", "d.png",
                   "--run", "x", "steps=3"]) == [
        "tokenizer", "train", "visual", "--images", "a.png", "--images", "b/", "--heldout", "c.png",
        "--heldout", "d.png", "--run", "x", "steps=3"]
    # an override ends the paths; a repeated flag still works; other options are left alone
    assert expand(["--corpus", "a", "vocab_size=9", "b"]) == ["--corpus", "a", "vocab_size=9", "b"]
    assert expand(["--images", "a", "--images", "b"]) == ["--images", "a", "--images", "b"]
    assert expand(["ingest", "x", "y", "--set", "a=1"]) == ["ingest", "x", "y", "--set", "a=1"]
