"""The README's command lines are tests: the reference block names only options that exist, and
the step-by-step block and the Python example run as written (vector-quantize-pytorch's habit)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokenloom.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block(after_heading: str, language: str) -> str:
    section = README[README.index(after_heading):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def _reference_lines() -> list[str]:
    lines = []
    for line in _block("## The command line", "bash").splitlines():
        line = line.split("#")[0].rstrip()
        if line.startswith("tokenloom "):
            lines.append(line)
        elif line.strip() and lines:  # a continuation of the previous command
            lines[-1] += " " + line.strip()
    return lines


def _commands(line: str):
    """(command path, text) of each command a reference line shows ("catalog ls | show NAME" is two)."""
    alternatives = " ".join(line.split()[1:]).split(" | ")
    group = alternatives[0].split()[0]
    for k, text in enumerate(alternatives):
        text = text if k == 0 else f"{group} {text}"
        yield list(itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w), text.split())), text


def test_every_option_in_the_command_reference_exists():
    lines = _reference_lines()
    assert len(lines) >= 17
    runner = CliRunner()
    checked = 0
    for line in lines:
        for path, text in _commands(line):
            result = runner.invoke(app, [*path, "--help"], terminal_width=200)
            assert result.exit_code == 0, (path, result.output)
            for option in set(re.findall(r"--[a-z][a-z-]+", text)):
                assert option in result.output, f"`tokenloom {' '.join(path)}` has no {option} (README: {line})"
                checked += 1
    assert checked >= 40


@pytest.mark.integration
@pytest.mark.long
def test_the_step_by_step_block_and_the_python_example_run_as_written(tmp_path):
    home = tmp_path / "home"
    env = dict(os.environ, TOKENLOOM_HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _block("### Step by step", "bash")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    corpus = home / "corpus"
    # every bad image and audio file is named with its reason by the tokenizer trainings
    rejected = {line.split("rejected ", 1)[1].split(":")[0] for line in r.stdout.splitlines() if "rejected " in line}
    assert {Path(p).name for p in rejected if "/images/bad/" in p} == {
        "truncated.png", "corrupt.jpg", "text-not-image.png", "one-pixel.png", "decompression-bomb.png", "empty.png"}
    assert len([p for p in rejected if "/audio/bad/" in p]) == 6
    visual = json.loads((home / "eval-visual" / "metrics.json").read_text())
    assert visual["images"] == 8 and len(visual["per_image"]) == 8 and visual["codes"] > 0  # 7 odd files + retina
    assert visual["psnr"] > 0 and 0 < visual["usage"] <= 1 and (home / "eval-visual" / "grid.png").stat().st_size > 1000
    audio = json.loads((home / "eval-audio" / "metrics.json").read_text())
    assert audio["clips"] == 6 and audio["levels"] == 2 and audio["bitrate"] == 50 * 2 * 8  # 256 codes: 8 bits
    assert audio["si_sdr"] == audio["by_levels"]["2"]["si_sdr"] and len(audio["usage"]) == 4
    assert len(list((home / "eval-audio").glob("*.wav"))) == 4 and (home / "eval-audio" / "spectrograms.png").is_file()
    assert (home / "decoded" / "photo.png").stat().st_size > 100
    assert "trained 20 steps on docs" in r.stdout
    assert (home / "hello.wav").stat().st_size > 44  # generate: text -> speech with the run's own bundles
    assert "warming up over 2 of 20 steps" in r.stderr  # the derived warm-up, said once

    # mistakes with the bundles and files it made: one line, status 2 (in this process)
    from cli_runner import run

    for args, message in [
        (("tokenizer", "eval", "visual", "--bundle", "visual-nope", "--images", corpus / "images"),
         "no tokenizer bundle 'visual-nope'"),
        (("tokenizer", "eval", "visual", "--bundle", "latest", "--images", corpus / "images" / "bad"),
         "no usable images"),
        (("tokenizer", "train", "visual", "--images", corpus / "images", "factor=4"),
         "visual_tokenizer.factor must be 8 or 16"),
        (("tokenizer", "eval", "audio", "--bundle", "latest", "--audio", corpus / "audio", "--levels", "9"),
         "--levels must be 1..4"),
        (("tokenizer", "train", "audio", "--audio", corpus / "audio", "frame_rate=30"),
         "audio_tokenizer.frame_rate must be one of"),
    ]:
        bad = run(*args, home=home)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    example = _block("### From Python", "python")
    r = subprocess.run([sys.executable, "-c", example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    committed, samples = r.stdout.split()[-2:]
    assert committed == "True", "the same inputs and bundles: the ingestion is already committed"
    assert int(samples) > 500
