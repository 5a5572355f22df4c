"""`tokenloom task-data` and `tokenloom rl` as a user runs them: the README's RL block as written
(task records -> BPE -> ingest -> SFT -> RL), then a resume of the RL run through the command line,
and mistakes that end in one line and status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import deepspeed  # noqa: F401  (its logger binds the test's stdout now, not a command's captured one)
import pytest
from cli_runner import run

ROOT = Path(__file__).resolve().parents[1]


def test_task_data_writes_the_records_and_refuses_unknown_tasks(tmp_path):
    doc = run("task-data", "--task", "add", "--out", tmp_path, "--records", "30", "--buckets", "0,1", "--json").json()
    lines = [json.loads(line)["text"] for line in (tmp_path / "add.jsonl").read_text().splitlines()]
    assert doc["records"] == len(lines) == 30 and doc["buckets"] == ["1 digit", "2 digits"]
    for line in lines:  # every record is a correct sum of at most two-digit numbers
        a, b, total = map(int, re.fullmatch(r"add (\d+)\+(\d+) = (\d+)", line).groups())
        assert a + b == total and max(a, b) < 100
    for args, message in [(("--task", "nope"), "unknown task 'nope'"), (("--task", "sort", "--buckets", "0,7"),
                                                                          "has buckets 0..3")]:
        bad = run("task-data", *args, "--out", tmp_path)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.integration
@pytest.mark.long
def test_the_readme_rl_block_runs_and_an_rl_run_resumes(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme[readme.index("### RL post-training"):], re.S).group(1)
    home = tmp_path / "home"
    env = dict(os.environ, TOKENLOOM_HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"4 RL steps on sort \(urb buffer\): reward", r.stdout), r.stdout[-2000:]
    run_dir = home / "runs" / "sort-rl"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in records if "reward" in x]
    assert [x["step"] for x in steps] == [0, 1, 2, 3]
    assert [x["queries"] for x in steps] == [list(range(4 * k, 4 * k + 4)) for k in range(4)]  # U-RB order
    assert all(0 <= x["reward"] <= 1 and x["entropy"] >= 0 for x in steps)
    assert all(0 < x["rollout_busy"] <= 1 if x["rounds"] else x["rollout_busy"] is None for x in steps)
    assert (run_dir / "rl.png").stat().st_size > 10_000 and (run_dir / "model" / "model.safetensors").is_file()

    # the RL'd model generates like any other, and the run continues from its checkpoint
    out = run("generate", run_dir, "--to", "text", "--prompt", "sort 3 1 2 =", "--max-new-tokens", "8",
              "--temperature", "0", "--json", home=home).json()
    assert out["text"].startswith(" ")
    doc = run("rl", "sort-sft", "--config", "rl", "--resume", "sort-rl", "--steps", "6", "rl.eval_queries=4", "--json",
              home=home).json()
    assert doc["steps"] == 2 and doc["run_dir"] == str(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if "reward" in x] == [0, 1, 2, 3, 4, 5]
    bad = run("rl", "sort-sft", "--config", "rl", "--resume", "sort-rl", "--steps", "8", "rl.group_size=4", home=home)
    assert bad.returncode == 2 and "other RL settings (group_size)" in bad.stderr
    bad = run("rl", "sort-sft", "--config", "rl", "--task", "nope", home=home)
    assert bad.returncode == 2 and "unknown task 'nope'" in bad.stderr
