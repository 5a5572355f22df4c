"""Training jobs that last: a run killed with SIGKILL at a random step and resumed by name ends with
the uninterrupted run's losses and weights; a half-written checkpoint is never resumed; keep_last
holds the number of checkpoints; resuming what has no checkpoint is one line and status 2."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenloom.trainer import checkpoints
from tokenloom.trainer.distributed import destroy_process_group

STEPS, EVERY, KEEP = 8, 2, 2
# the tiny recipe, smaller still: the process start, not the steps, is what these tests wait for
SMALL = ["--config", "tiny", "--steps", str(STEPS), "--json", "model.dim=32", "model.n_layers=1", "model.n_heads=1",
         "model.moe.n_experts=4", "stream.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every=1",
         f"train.checkpoint_every={EVERY}", f"train.keep_last={KEEP}"]
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def _fake_checkpoint(folder: Path, step: int | None) -> Path:
    """A folder shaped like a checkpoint; with `step`, complete (it has the manifest)."""
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    if step is not None:
        (folder / checkpoints.MANIFEST).write_text(json.dumps({"step": step}))
    return folder


def test_only_a_checkpoint_with_its_manifest_is_latest(tmp_path):
    root = tmp_path / "run" / checkpoints.ROOT
    for step in (2, 4, 10):  # step 10 sorts after step 4 (numbers, not strings)
        _fake_checkpoint(root / checkpoints.tag(step), step)
    _fake_checkpoint(root / f"{checkpoints.TMP_PREFIX}{checkpoints.tag(12)}", None)  # killed while writing
    _fake_checkpoint(root / checkpoints.tag(14), None)  # a step folder without its manifest: not complete
    latest = root / checkpoints.tag(10)
    assert checkpoints.latest_complete(root) == latest
    for given in (tmp_path / "run", root, latest):  # a run folder, its checkpoint folder, the checkpoint
        assert checkpoints.find_checkpoint(given) == latest
    assert checkpoints.find_checkpoint(root / checkpoints.tag(2)) == root / checkpoints.tag(2)

    deleted = checkpoints.prune(root, keep_last=2)
    assert sorted(p.name for p in deleted) == [f"{checkpoints.TMP_PREFIX}step-000012", "step-000002"]
    assert [p.name for p in checkpoints.complete(root)] == ["step-000004", "step-000010"]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoints.find_checkpoint(root / f"{checkpoints.TMP_PREFIX}{checkpoints.tag(12)}")
    # resumed from step 4 (or started afresh) and saved step 6: step 10 is of an abandoned line of training
    _fake_checkpoint(root / checkpoints.tag(6), 6)
    assert [p.name for p in checkpoints.prune(root, keep_last=2, current=6)] == ["step-000010"]
    assert checkpoints.latest_complete(root) == root / checkpoints.tag(6)


def test_a_checkpoint_is_due_every_n_steps_or_after_m_minutes():
    steps = checkpoints.Schedule(every=3, minutes=0, world=1)
    assert [n for n in range(1, 10) if steps.due(n)] == [3, 6, 9]
    clock = checkpoints.Schedule(every=0, minutes=0.5, world=1)
    assert not clock.due(1)
    clock.last -= 31  # half a minute and a second without a checkpoint
    assert clock.due(2)
    clock.saved()
    assert not clock.due(3)
    assert not any(checkpoints.Schedule(0, 0, 1).due(n) for n in range(1, 50))


def test_resuming_what_has_no_checkpoint_is_one_line_and_status_2(tmp_path):
    from cli_runner import run

    home = tmp_path / "home"
    (home / "runs" / "fresh").mkdir(parents=True)
    _fake_checkpoint(home / "runs" / "crashed" / checkpoints.ROOT / f"{checkpoints.TMP_PREFIX}step-000004", None)
    (home / "runs" / "crashed" / "config.json").write_text("{}")
    for args, message in [
        (("--resume", "nosuch"), "--resume nosuch: no run of that name"),
        (("--resume", "fresh"), "--resume fresh: "),
        (("--resume", "crashed"), "holds no complete checkpoint"),  # only a half-written one
        (("--resume", str(home / "runs" / "crashed" / checkpoints.ROOT)), "holds no complete checkpoint"),
        (("--run", "crashed"), "run 'crashed' already exists"),
        (("--run", "../up"), "a run name is letters"),
    ]:
        bad = run("train", "--dataset", "docs", *args, home=home)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.fixture(scope="module")
def docs_home(tmp_path_factory, stdlib_corpus, text_bundle):
    """A home with the sample corpus ingested once as dataset `docs` (in this process: the session's
    Ray runtime, see conftest)."""
    from cli_runner import run

    home = tmp_path_factory.mktemp("ckpt-home")
    shutil.copytree(text_bundle.path, home / "bundles" / text_bundle.id)
    r = run("ingest", str(stdlib_corpus), "--dataset", "docs", "--tokenizer", text_bundle.id, "--json", "--set",
            "ingest.ray.progress_bars=false", home=home)
    assert r.returncode == 0, r.stderr[-3000:]
    return home


def _clean_env(home: Path) -> dict:
    """This process's environment without a launcher's variables (a child picks its own port)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "TOKENLOOM_HOME": str(home)}


def _kill_after_checkpoint(home: Path, name: str, past: int) -> int:
    """Start `tokenloom train --run name` and SIGKILL it once a complete checkpoint at or past step
    `past` exists; returns the newest complete step at the kill."""
    import torch

    env = {**_clean_env(home), "OMP_NUM_THREADS": str(torch.get_num_threads())}  # this process's arithmetic
    root = home / "runs" / name / checkpoints.ROOT
    with open(home / f"{name}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "train", "--dataset", "docs", "--run", name,
                                 *SMALL], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.monotonic() + 420
            while time.monotonic() < deadline and proc.poll() is None:
                latest = checkpoints.latest_complete(root)
                if latest is not None and checkpoints.read_manifest(latest)["step"] >= past:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.02)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == -signal.SIGKILL, f"the run ended by itself ({code}) before it was killed:\n" \
                                    f"{(home / f'{name}.err').read_text()[-3000:]}"
    return checkpoints.read_manifest(checkpoints.latest_complete(root))["step"]


def _document(result) -> dict:
    """The --json document of an in-process run: DeepSpeed's logger writes to the stdout the
    runner captures (in a subprocess it goes to stderr), so the document is the last thing there."""
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    return json.loads(text[text.rindex("\n{\n") + 1:] if not text.startswith("{\n") else text)


def _losses(run: Path) -> list[tuple[int, float]]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "eval" not in r]  # training windows, not evaluations



def test_a_lock_left_by_a_process_killed_while_loading_the_comm_op_does_not_hang_the_next_start():
    """torch's lock on DeepSpeed's shm op is a file: a rank killed while it held it (at its start)
    left it, and every later start waited on it forever. Here with the lock left in the op's build
    folder (the real one: a copy elsewhere is compiled again, ~30 s), removed after the test
    whatever happens, so that a failure here does not hang the tests after it."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # torch's build folders: <it>/<op>, else <default>/<tag>/<op>
    built = sorted(Path(root).glob("deepspeed_shm_comm/*.so") if root is not None else
                   Path(get_default_build_root()).glob("*/deepspeed_shm_comm/*.so"))
    assert built, "the Makefile builds DeepSpeed's shm op before the tests"
    lock = built[0].parent / "lock"
    lock.touch()
    try:
        start = subprocess.run([sys.executable, "-m", "tokenloom.trainer.distributed"], capture_output=True, text=True,
                               timeout=120)
        assert start.returncode == 0, start.stderr[-2000:]
        assert not lock.exists()
        assert "removing" in start.stderr and "killed while it loaded" in start.stderr
    finally:
        lock.unlink(missing_ok=True)


@pytest.mark.integration
def test_a_killed_run_resumed_by_name_ends_as_the_uninterrupted_run(docs_home, monkeypatch):
    import torch
    from cli_runner import run
    from safetensors.torch import load_file

    home = docs_home
    past = random.Random().randrange(1, STEPS // EVERY - 1) * EVERY  # 2 or 4: steps before it and after it
    killed_at = _kill_after_checkpoint(home, "killed", past)
    assert past <= killed_at < STEPS, f"killed past step {past}: newest complete checkpoint {killed_at}"
    runs = home / "runs"
    root = runs / "killed" / checkpoints.ROOT
    # a crash in the middle of the next save: every shard there, the manifest not yet written
    half = root / f"{checkpoints.TMP_PREFIX}{checkpoints.tag(STEPS - 1)}"
    shutil.copytree(root / checkpoints.tag(killed_at), half, dirs_exist_ok=True)
    (half / checkpoints.MANIFEST).unlink()
    assert checkpoints.find_checkpoint(runs / "killed") == root / checkpoints.tag(killed_at)

    # the uninterrupted run and the resumption in this process (no second torch import to wait for)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    try:
        straight = _document(run("train", "--dataset", "docs", "--run", "straight", *SMALL, home=home))
        resumed = _document(run("train", "--dataset", "docs", "--resume", "killed", *SMALL, home=home))
    finally:
        if torch.distributed.is_initialized():  # a one-rank group outlives a run: later tests want none
            destroy_process_group()  # through DeepSpeed: it drops its cached groups

    assert resumed["run_dir"] == str(runs / "killed") and resumed["steps"] == STEPS - killed_at
    assert resumed["checkpoint"] == str(root / checkpoints.tag(STEPS))
    # measured on CPU, one rank and two (expert-parallel): bit for bit
    assert resumed["losses"] == pytest.approx(straight["losses"][killed_at:], rel=1e-6, abs=1e-6)
    # the run folder's log: every step once, the killed run's before the resume point, then the resumed run's
    logged, expected = _losses(runs / "killed"), _losses(runs / "straight")
    assert [s for s, _ in logged] == list(range(STEPS))
    assert [loss for _, loss in logged] == pytest.approx([loss for _, loss in expected], rel=1e-6, abs=1e-6)
    weights = load_file(runs / "killed" / "model" / "model.safetensors")
    reference = load_file(runs / "straight" / "model" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")

    # keep_last: exactly K complete checkpoints, the newest, and nothing half-written left behind
    for folder in (root, runs / "straight" / checkpoints.ROOT):
        assert [p.name for p in checkpoints.complete(folder)] == [checkpoints.tag(s) for s in (STEPS - EVERY, STEPS)]
        assert not [p for p in folder.iterdir() if p.name.startswith(checkpoints.TMP_PREFIX)]
        assert (folder / "latest").read_text() == checkpoints.tag(STEPS)
    manifest = checkpoints.read_manifest(root / checkpoints.tag(STEPS))
    summary = json.loads((runs / "killed" / "source.json").read_text())
    assert (manifest["step"], manifest["snapshot_ids"], manifest["vocab_id"]) == (
        STEPS, [summary["snapshot_id"]], summary["vocab_id"])
    assert list(manifest["bundle_ids"].values()) == [p.name for p in (home / "bundles").iterdir()]
    assert manifest["config"]["train"]["keep_last"] == KEEP and manifest["code_version"]
    record = [r for r in map(json.loads, (runs / "straight" / "metrics.jsonl").read_text().splitlines())
              if "eval" not in r][-1]
    assert record["grad_norm"] > 0 and record["lr"] > 0 and record["peak_rss_mb"] > 100


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank(monkeypatch) -> None:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)


@pytest.mark.integration
def test_fine_tuning_starts_from_the_model_it_is_given(docs_home, monkeypatch):
    """`finetune MODEL` (and `train --init-from`) start a new run from the model's weights: with
    lr 0 the weights stay the model's bit for bit, the first loss is the trained model's (far
    below a fresh model's), the architecture comes from the model, not the command line, and the
    recipe's defaults apply; a model of another token space is refused in one line."""
    import torch
    from cli_runner import run
    from safetensors.torch import load_file

    home, runs = docs_home, docs_home / "runs"
    small = [a for a in SMALL if not a.startswith("train.checkpoint_every")] + ["--steps", "30", "train.log_every=10"]
    _one_rank(monkeypatch)
    try:
        base = _document(run("train", "--dataset", "docs", "--run", "ft-base", *small, home=home))
        frozen = _document(run("finetune", "ft-base", "--dataset", "docs", "--run", "ft-lr0", "--steps", "3", "--json",
                               "model.dim=48", "stream.seq_len=64", "train.micro_batch_size=2", "train.lr=0",
                               "stream.holdout=0.25",  # the tiny recipe's split: the same first batch
                               home=home))
        tuned = _document(run("train", "--dataset", "docs", "--init-from", str(runs / "ft-base" / "model"),
                              "--run", "ft-init", *small, "train.optimizer=lazy_adamw", home=home))
        # progressive unfreezing: in its first 10 steps only the last layer (and the final norm) trains
        _document(run("finetune", "ft-base", "--dataset", "docs", "--run", "ft-unfreeze", "--steps", "3", "--json",
                      "--unfreeze-every", "10", "train.lr=1e-3", "train.log_every=1", home=home))
    finally:
        if torch.distributed.is_initialized():
            destroy_process_group()
    # all three read the same first batch: the fresh model's loss on it, then the trained model's twice
    assert frozen["first_loss"] == pytest.approx(tuned["first_loss"], rel=1e-6)
    assert base["first_loss"] - tuned["first_loss"] > 0.3  # measured: 6.435 fresh, 5.799 trained
    assert len(tuned["losses"]) == 30 and all(map(math.isfinite, tuned["losses"]))  # lazy AdamW through DeepSpeed
    assert json.loads((runs / "ft-init" / "config.json").read_text())["train"]["optimizer"] == "lazy_adamw"
    weights = load_file(runs / "ft-lr0" / "model" / "model.safetensors")
    for key, value in load_file(runs / "ft-base" / "model" / "model.safetensors").items():
        if not key.endswith("expert_bias"):  # the routers' bias steps by expert load, not by lr
            assert torch.equal(weights[key], value), key  # the model's architecture, not model.dim=48
    config = json.loads((runs / "ft-lr0" / "config.json").read_text())
    assert (config["train"]["weight_decay"], config["train"]["grad_clip"], config["train"]["checkpoint_every"]) == (
        0.01, 1.0, 50)  # the recipe's defaults
    assert json.loads((runs / "ft-lr0" / "source.json").read_text())["init_from"]["model"] == str(
        (runs / "ft-base" / "model").resolve())

    base_weights = load_file(runs / "ft-base" / "model" / "model.safetensors")
    unfrozen = load_file(runs / "ft-unfreeze" / "model" / "model.safetensors")
    assert torch.equal(unfrozen["embed.weight"], base_weights["embed.weight"]), "the embedding is unfrozen last"
    moved = [k for k in base_weights if k.startswith("blocks.0.") and not k.endswith("expert_bias")
             and not torch.equal(unfrozen[k], base_weights[k])]
    assert moved, "the last layer trains from the first step"
    records = [json.loads(x) for x in (runs / "ft-unfreeze" / "metrics.jsonl").read_text().splitlines()]
    assert [r["unfrozen_groups"] for r in records if "unfrozen_groups" in r] == [1, 1, 1]

    other = home / "other-model"
    shutil.copytree(runs / "ft-base" / "model", other)
    doc = json.loads((other / "model.json").read_text())
    doc["vocab"]["bundles"]["text"] = "text-another-bundle"  # same ranges, other tokens behind the ids
    (other / "model.json").write_text(json.dumps(doc))
    refused = run("train", "--dataset", "docs", "--init-from", str(other), *small, home=home)
    assert refused.returncode == 2 and "--init-from" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def _rows(run: Path) -> list[tuple[int, int, int]]:
    """(step, global row, CRC of the row's ids and labels) of every row a run trained on, in order."""
    records = map(json.loads, (run / "rows.jsonl").read_text().splitlines())
    return [(r["step"], r["row"], r["crc"]) for r in records]


@pytest.mark.integration
def test_a_run_saved_on_two_ranks_resumes_on_one_and_back_with_the_same_rows(docs_home, tmp_path, monkeypatch):
    """The canonical readers fix the rows whatever the number of ranks: a run stopped at step 3 on
    2 ranks and resumed on 1 (and the reverse) trains on exactly the rows, step by step, of an
    uninterrupted 1-rank run with the same rows per step (2 x 1 = 1 x 2); DeepSpeed's ZeRO shards
    of the other rank count are converted to its universal checkpoint on the way."""
    import torch
    from cli_runner import launch_ranks, run

    home, runs, steps = docs_home, docs_home / "runs", 6
    common = ["train", "--dataset", "docs", "--home", str(home), "--config", "tiny", "--steps", str(steps), "--json",
              "model.dim=32", "model.n_layers=1", "model.n_heads=1", "model.moe.n_experts=4", "stream.seq_len=64",
              "train.warmup_steps=1", "train.log_rows=true", "stream.readers=2", "train.eval_batches=0"]

    def rows_per_rank(world: int) -> list[str]:
        return [f"train.micro_batch_size={2 // world}"]

    def launch(args: list[str], world: int, name: str) -> dict:
        if world == 1:  # in this process (no interpreter and torch import to wait for)
            return _document(run(*args, *rows_per_rank(1)))
        return launch_ranks([*args, *rows_per_rank(world)], world, tmp_path, name)

    _one_rank(monkeypatch)
    try:
        straight = launch([*common, "--run", "ws-straight"], 1, "straight")
        resumes = {}
        for first, then in ((2, 1), (1, 2)):
            name = f"ws-{first}-{then}"
            launch([*common, "--run", name, "train.stop_after=3"], first, name)
            resumes[(first, then)] = launch([*common, "--resume", name], then, f"{name}-resumed")
    finally:
        if torch.distributed.is_initialized():
            destroy_process_group()
    expected = _rows(runs / "ws-straight")
    assert [s for s, _, _ in expected] == [s for s in range(steps) for _ in range(2)]
    assert [g for _, g, _ in expected] == list(range(2 * steps))
    for (first, then), resumed in resumes.items():
        name = f"ws-{first}-{then}"
        assert resumed["world_size"] == then and resumed["steps"] == steps - 3
        assert _rows(runs / name) == expected, f"saved on {first} rank(s), resumed on {then}"
        # the optimizer's state came through the conversion: the resumed losses follow the straight run's
        assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-3)
        assert (runs / name / checkpoints.ROOT / checkpoints.tag(3) / checkpoints.UNIVERSAL).is_dir()


STAGED = """
[model]
dim = 32
n_layers = 1
n_heads = 1
[model.moe]
n_experts = 4
[stream]
seq_len = 64
holdout = 0.25
[train]
steps = 6
micro_batch_size = 4
warmup_steps = 1
log_every = 1
log_rows = true
eval_batches = 0
[[train.stages]]
steps = 3
seq_len = 64
[[train.stages]]
steps = 3
seq_len = 128
rope_theta = 20000.0
"""


@pytest.mark.integration
def test_a_stage_switch_changes_the_row_length_and_resumes_exactly_across_it(docs_home, tmp_path, monkeypatch):
    """Two stages (64 then 128 positions per row, rows per micro-batch 4 then 2: the same positions
    per step); runs stopped before the switch (step 2) and at it (step 3) and resumed end with the
    uninterrupted run's losses and rows."""
    import torch
    from cli_runner import run

    from tokenloom.model.io import load_model

    home, runs = docs_home, docs_home / "runs"
    recipe = tmp_path / "staged.toml"
    recipe.write_text(STAGED)
    args = ["train", "--dataset", "docs", "--config", str(recipe), "--json"]
    _one_rank(monkeypatch)
    try:
        straight = _document(run(*args, "--run", "staged", home=home))
        stopped = {}
        for stop in (2, 3):
            run(*args, "--run", f"staged-{stop}", f"train.stop_after={stop}", home=home)
            stopped[stop] = _document(run(*args, "--resume", f"staged-{stop}", home=home))
    finally:
        if torch.distributed.is_initialized():
            destroy_process_group()
    rows = _rows(runs / "staged")
    per_step = [sum(1 for s, _, _ in rows if s == step) for step in range(6)]
    assert per_step == [4, 4, 4, 2, 2, 2], "rows per micro-batch follow the stage's row length"
    records = [json.loads(x) for x in (runs / "staged" / "metrics.jsonl").read_text().splitlines()]
    switch = [r for r in records if "seq_len" in r]
    assert [(r["step"], r["stage"], r["seq_len"], r["rows_per_micro_batch"]) for r in switch] == [(3, 1, 128, 2)]
    logged = [json.loads(x) for x in (runs / "staged" / "rows.jsonl").read_text().splitlines()]
    assert max(r["positions"] for r in logged if r["step"] < 3) <= 64 < max(
        r["positions"] for r in logged if r["step"] >= 3), "rows of the second stage are longer"
    for stop, resumed in stopped.items():
        assert resumed["steps"] == 6 - stop and resumed["stage"] == 1
        assert resumed["losses"] == pytest.approx(straight["losses"][stop:], rel=1e-6, abs=1e-6), f"stopped at {stop}"
        assert _rows(runs / f"staged-{stop}") == rows
    model, _ = load_model(runs / "staged" / "model")
    assert model.cfg.rope_theta == 20000.0, "the last stage's RoPE base is the model's"


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.integration
def test_follow_mode_trains_once_on_a_snapshot_ingested_during_the_run(docs_home, tmp_path, text_bundle):
    """`train --follow` while `ingest` commits new documents to the dataset: the new snapshot becomes
    a segment from the step the trainer saw it, every new token is trained exactly once (the rows
    of the segment hold exactly the new samples' tokens), and the rows before it are the ones the
    run would have read anyway."""
    home, runs = docs_home, docs_home / "runs"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    words = ["loom", "weave", "shuttle", "heddle", "warp", "weft", "bobbin", "treadle"]
    (fresh / "fresh.jsonl").write_text("".join(json.dumps({"text": f"Follow-mode document {i}: " + " ".join(
        words[(i + k) % len(words)] for k in range(12 + i))}) + "\n" for i in range(24)))
    env = {**_clean_env(home), "OMP_NUM_THREADS": "1"}
    run_dir = runs / "follow"
    train_args = ["train", "--dataset", "docs", "--run", "follow", "--follow", *SMALL[:2], "--steps", "5000", "--json",
                  "model.dim=32", "model.n_layers=1", "model.n_heads=1", "model.moe.n_experts=4", "stream.seq_len=64",
                  "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every=1", "train.follow_every=1",
                  "train.log_rows=true", "train.eval_batches=0", "stream.holdout=0"]  # every new sample trains
    with open(tmp_path / "train.err", "w") as err:
        trainer = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", *train_args], stdout=subprocess.DEVNULL,
                                   stderr=err, env=env)
    try:
        deadline = time.monotonic() + 300
        while max((r["step"] for r in _records(run_dir / "rows.jsonl")), default=-1) < 3:
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "train.err").read_text()[-3000:]
            time.sleep(0.2)
        from cli_runner import run  # in this process: the session's Ray runtime is warm

        ingest = run("ingest", str(fresh), "--dataset", "docs", "--tokenizer", text_bundle.id, "--json", "--set",
                     "ingest.ray.progress_bars=false", home=home)
        assert ingest.returncode == 0, ingest.stderr[-3000:]
        snapshot = json.loads(ingest.stdout)["snapshot_id"]
        while True:  # until the segment is read to its end and a few steps after it
            rows = _records(run_dir / "rows.jsonl")
            seen = [r["step"] for r in rows if r["segment"] == snapshot]
            if seen and rows[-1]["step"] >= max(seen) + 5:
                break
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "train.err").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        trainer.kill()
        trainer.wait(timeout=60)
    follows = [r["follow"] for r in _records(run_dir / "metrics.jsonl") if "follow" in r]
    assert [f["snapshot_id"] for f in follows] == [snapshot] and follows[0]["files"] >= 1
    first = min(r["step"] for r in rows if r["segment"] == snapshot)
    assert first == follows[0]["step"], "the segment starts at the step the trainer saw the snapshot"
    # the new samples' tokens, from the catalog (text only: a token is a position)
    from tokenloom.catalog import CatalogConfig, TokenCatalog

    job = json.loads(ingest.stdout)["job_id"]
    new_tokens = sum(TokenCatalog(CatalogConfig(), home).scan("docs", where=f"job_id = '{job}'",
                                                               columns=("num_tokens",))["num_tokens"].to_pylist())
    assert new_tokens > 0
    assert sum(r["positions"] for r in rows if r["segment"] == snapshot) == new_tokens, "exactly once"
    assert all(r["segment"] == -1 for r in rows if r["step"] < first)


@pytest.mark.integration
def test_a_text_only_dataset_and_a_run_without_routing_still_make_a_report(docs_home, tmp_path):
    """No audio or image in the dataset, a run whose metrics hold no routing figures and no PNGs:
    the report still renders (in Chromium, without console errors) and says what is missing."""
    from browser import inspect_page, need_browser
    from cli_runner import run

    need_browser()
    dense = tmp_path / "dense-run"
    dense.mkdir()
    (dense / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 6.0 - 0.1 * s, "lr": 1e-3,
                                                             "grad_norm": 1.0, "tokens_per_second": 1000.0}) + "\n"
                                                 for s in range(5)))
    doc = run("report", "docs", "--run", str(dense), "--out", str(tmp_path / "report"), "--samples", "2", "--json",
              home=docs_home).json()
    html = Path(doc["report"]).read_text()
    assert doc["samples"] == 2 and doc["runs"] == ["dense-run"]
    assert "audio+text" not in html and "no per-pool figures" not in html
    pools = html.split("<h3>Ingestion pools</h3>", 1)[1].split("</table>", 1)[0]
    assert "<td>text</td>" in pools and "<td>image</td>" not in pools  # the job's one pool, with its figures
    seen = inspect_page(Path(doc["report"]), tmp_path / "report.png")
    assert seen["errors"] == [] and seen["audio"] == 0 and seen["rendered"] == seen["plots"] >= 4, seen
    bad = run("report", "docs", "--run", "nosuch", "--out", str(tmp_path / "r2"), home=docs_home)
    assert bad.returncode == 2 and "--run nosuch" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
