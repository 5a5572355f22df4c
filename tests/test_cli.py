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
