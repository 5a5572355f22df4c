"""Elastic training through the trainer: the sandwich rule trains the full model in every step that
draws a sub-model, and logs the full model's loss; without it a skipped layer is left alone (lazy AdamW)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_heldout_eval import _files, _model_cfg, _stream_cfg, _train_cfg, one_rank  # noqa: F401 (a fixture)

from tokenloom.model.config import ElasticConfig
from tokenloom.model.elastic import sample_submodel


def _run(folder, files, name: str, elastic: ElasticConfig | None, **train):
    from tokenloom.model.io import load_model
    from tokenloom.trainer import train as run_training

    cfg = _model_cfg() if elastic is None else replace(_model_cfg(), elastic=elastic)
    result = run_training(files, cfg, _stream_cfg(0.0),
                          _train_cfg(steps=3, warmup_steps=1, eval_batches=0, checkpoint_every=0,
                                     optimizer="lazy_adamw", **train),
                          folder / name, progress=False)
    model, _ = load_model(result.model_dir)  # parameters only: the router biases move whatever the lr
    return result, {k: v.detach().clone() for k, v in model.named_parameters()}


def _layer(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(f"blocks.{i}.")}


def test_the_sandwich_rule_trains_the_skipped_layers_and_logs_the_full_models_loss(tmp_path, one_rank):  # noqa: F811
    files = _files(tmp_path)
    # every step keeps one of the two layers (depth only); the first step's lr is 0 (warm-up), and the
    # seed is one whose steps 1 and 2 keep the same layer, so the other one is skipped in every update
    def draws(seed: int) -> list:
        cfg = replace(_model_cfg(), elastic=ElasticConfig(True, 1.0, width_prob=0.0, sparsity_prob=0.0, seed=seed))
        return [sample_submodel(cfg, step).layers for step in range(3)]

    seed = next(s for s in range(100) if draws(s)[1] == draws(s)[2])
    depth = ElasticConfig(enabled=True, depth_prob=1.0, width_prob=0.0, sparsity_prob=0.0, seed=seed)
    kept = draws(seed)[1][0]
    skipped = 1 - kept

    _, init = _run(tmp_path, files, "init", None, lr=0.0)  # lr 0: the seeded initial weights
    plain, plain_w = _run(tmp_path, files, "plain", None)
    sandwich, sandwich_w = _run(tmp_path, files, "sandwich", depth)
    alone, alone_w = _run(tmp_path, files, "alone", replace(depth, sandwich=False))

    # the logged loss of a sandwich step is the full model's: the plain run's at the same init and rows
    assert sandwich.losses[0] == pytest.approx(plain.losses[0], rel=1e-6)
    assert abs(alone.losses[0] - plain.losses[0]) > 1e-5  # the one-layer sub-model's (near it at init)
    # without the sandwich the skipped layer keeps its initial bits; with it, it is trained
    for key, value in _layer(init, skipped).items():
        assert torch.equal(alone_w[key], value), key
    assert any(not torch.equal(sandwich_w[k], v) for k, v in _layer(init, skipped).items())
    # and the update is not the plain one: the sub-model's gradient is in it too
    assert any(not torch.allclose(sandwich_w[k], plain_w[k], atol=1e-7) for k in _layer(init, kept))
