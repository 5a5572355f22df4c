"""Held-out loss by modality: every modality of the split gets a figure, the figure is the saved
model's, and a modality the data lacks is reported missing with a reason, not a crash."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import replace
from pathlib import Path

import multimodal_data as mm
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.datasets import ShardFile, StreamConfig
from tokenloom.model import ModelConfig
from tokenloom.model.moe import MoEConfig
from tokenloom.trainer import TrainConfig
from tokenloom.trainer.distributed import destroy_process_group

MODALITIES = ("text", "image", "audio")
EVAL_BATCHES, MICRO = 2, 4


def _shard(path, samples, mix: str) -> ShardFile:
    """A data file as the sink writes it: one modality mix, named in a `modalities` column."""
    pq.write_table(pa.table({
        "tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
        "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE)),
        "modalities": pa.array([mix] * len(samples)),
    }), path)
    return ShardFile(str(path), len(samples))


def _files(folder, with_audio: bool = True) -> list[ShardFile]:
    rng = np.random.default_rng(0)
    files = [_shard(folder / "text.parquet", [mm.text_sample(rng, int(rng.integers(10, 40))) for _ in range(40)],
                    "text"),
             _shard(folder / "image.parquet", [mm.image_sample(rng) for _ in range(12)], "image+text")]
    if with_audio:
        files.append(_shard(folder / "audio.parquet", [mm.audio_sample(rng, int(rng.integers(3, 12)))
                                                       for _ in range(12)], "audio+text"))
    return files


def _model_cfg() -> ModelConfig:
    return ModelConfig(vocab_size=mm.VOCAB, audio_ranges=mm.AUDIO_RANGES, dim=32, n_layers=2, n_heads=2,
                       moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32))


def _stream_cfg(holdout: float) -> StreamConfig:
    return StreamConfig(seq_len=64, group_size=2, holdout=holdout)


def _train_cfg(**changes) -> TrainConfig:
    return TrainConfig(**{"steps": 6, "micro_batch_size": MICRO, "checkpoint_every": 3, "keep_last": 0,
                          "eval_batches": EVAL_BATCHES, "log_every": 1, **changes})


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank process group for in-process training, gone afterwards (later tests want none)."""
    with pytest.MonkeyPatch.context() as mp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            mp.setenv(key, value)
        yield
        if torch.distributed.is_initialized():
            destroy_process_group()  # through DeepSpeed: it drops its cached groups


def _train(folder, files, holdout=0.3, **changes):
    from tokenloom.trainer import train

    return train(files, _model_cfg(), _stream_cfg(holdout), _train_cfg(**changes), folder / "run", progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_rank):
    folder = tmp_path_factory.mktemp("heldout")
    files = _files(folder)
    return files, _train(folder, files)


def test_every_modality_gets_a_finite_held_out_loss_at_each_checkpoint_and_the_end(trained):
    files, result = trained
    for m in MODALITIES:
        assert math.isfinite(result.val_loss[m]["loss"]) and result.val_loss[m]["tokens"] > 0, result.val_loss
    assert [e["step"] for e in result.evaluations] == [3, 6] and result.evaluations[-1] == result.val_loss
    # the model learns between the checkpoints: the two evaluations are of different weights
    assert result.evaluations[0]["text"]["loss"] != pytest.approx(result.val_loss["text"]["loss"], rel=1e-4)
    records = [json.loads(line) for line in Path(result.run_dir, "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval") == "held-out"]
    assert [(r["step"], r["steps_done"]) for r in evals] == [(2, 3), (5, 6)]
    assert all("loss" not in r for r in evals)  # the training curve (plot_loss reads "loss") stays training
    for m in MODALITIES:
        assert evals[-1][f"val_loss_{m}"] == result.val_loss[m]["loss"]
        assert evals[-1][f"val_tokens_{m}"] == result.val_loss[m]["tokens"]


def test_held_out_loss_is_the_saved_models_on_the_held_out_rows(trained):
    from tokenloom.model.io import load_model
    from tokenloom.trainer.evaluate import evaluate

    files, result = trained
    model, _ = load_model(result.model_dir)
    val = replace(_stream_cfg(0.3), split="val")
    again = evaluate(model, files, val, batches=EVAL_BATCHES, micro_batch_size=MICRO)
    for m in MODALITIES:
        assert again[f"loss_{m}"] == pytest.approx(result.val_loss[m]["loss"], rel=1e-5, abs=1e-5)
        assert again[f"tokens_{m}"] == result.val_loss[m]["tokens"]
    # the same model on the training rows scores otherwise: the evaluation read the held-out rows
    seen = evaluate(model, files, replace(val, split="train"), batches=EVAL_BATCHES, micro_batch_size=MICRO)
    assert seen["loss_text"] != pytest.approx(again["loss_text"], rel=1e-4)
    # every mix holds rows out, a minority of its rows, and the split is small enough to be read whole
    assert all(0 < again["mixes"][mix] < f.num_rows / 2 for mix, f in zip(
        ("audio+text", "image+text", "text"), sorted(files, key=lambda f: f.path), strict=True))


def test_a_dataset_without_audio_reports_no_audio_loss_and_why(tmp_path, one_rank):
    result = _train(tmp_path, _files(tmp_path, with_audio=False), steps=3, checkpoint_every=0)
    assert math.isfinite(result.val_loss["text"]["loss"]) and math.isfinite(result.val_loss["image"]["loss"])
    assert result.val_loss["audio"]["loss"] is None and result.val_loss["audio"]["tokens"] == 0
    assert "no audio targets" in result.val_loss["audio"]["reason"]


def test_without_a_held_out_split_every_figure_is_none_with_the_reason(tmp_path, one_rank):
    result = _train(tmp_path, _files(tmp_path, with_audio=False), holdout=0.0, steps=2, checkpoint_every=0)
    assert all(result.val_loss[m]["loss"] is None for m in MODALITIES)
    assert "stream.holdout is 0" in result.val_loss["text"]["reason"]
    assert not any(json.loads(line).get("eval") for line in Path(result.run_dir, "metrics.jsonl").read_text().splitlines())


def test_eval_batches_must_not_be_negative():
    with pytest.raises(ValueError, match="train.eval_batches must be >= 0"):
        TrainConfig(eval_batches=-1).validate()


def test_a_mixture_trains_each_source_by_its_weight_and_counts_its_targets(tmp_path, one_rank):
    """Two sources 0.8 / 0.2 through the trainer: each row's source follows the weights, the targets
    counted per source add up to every target trained, and each source's count is what its rows hold."""
    from tokenloom.datasets.loader import Source
    from tokenloom.trainer import train

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b", with_audio=False)
    result = train([Source("a", tuple(a), 0.8), Source("b", tuple(b), 0.2)], _model_cfg(), _stream_cfg(0.0),
                   _train_cfg(steps=25, eval_batches=0, checkpoint_every=0, log_rows=True), tmp_path / "run",
                   progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 25 * MICRO
    share = np.mean([r["source"] == "a" for r in rows])
    assert 0.65 < share < 0.95, share  # 100 rows drawn at 0.8
    assert set(result.tokens_by_source) == {"a", "b"} and min(result.tokens_by_source.values()) > 0
    assert sum(result.tokens_by_source.values()) == result.tokens_seen
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "tokens_by_source" in r][-1]["tokens_by_source"] == result.tokens_by_source
