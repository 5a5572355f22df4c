"""The tokenizers' training loop picks its precision by measurement ("auto") without side effects,
and a resumed run keeps the precision its checkpoint records."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from tokenloom.tokenizers import loop
from tokenloom.tokenizers.loop import choose_precision


class Counter:
    """A sampler with its own RNG state, as the tokenizers' samplers have."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)

    def batch(self, n):
        return torch.randn(n, 4, generator=self.gen)

    def state(self):
        return self.gen.get_state()

    def load_state(self, state):
        self.gen.set_state(state)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))  # stands for a VQ codebook's EMA statistics

    def forward(self, x):
        self.ema += x.mean(0).detach()  # a forward in train mode changes state, as VQ's does
        return self.lin(x)


def loss_slow_in(slow_bf16: bool, model: Model):
    def loss_fn(batch):
        bf16 = torch.is_autocast_enabled("cpu")
        time.sleep(0.03 if bf16 == slow_bf16 else 0.0)
        torch.rand(1)  # draws from the global RNG, as dropout would
        return model(batch).float().pow(2).mean(), {}
    return loss_fn


class Cfg:
    precision = "auto"
    bf16_autocast = False
    batch_size = 3


@pytest.mark.parametrize("slow_bf16", [True, False])
def test_auto_picks_the_faster_precision_and_leaves_no_trace(slow_bf16):
    model, sampler = Model(), Counter()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sampler_before, rng_before = sampler.state().clone(), torch.get_rng_state()
    bf16, how = choose_precision(Cfg(), torch.device("cpu"), model, sampler, loss_slow_in(slow_bf16, model),
                                 lambda b, d: b)
    assert bf16 is (not slow_bf16) and how["why"] == "probe"
    assert (how["bf16_step_s"] > how["fp32_step_s"]) is slow_bf16
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "model and buffers restored"
    assert torch.equal(sampler.state(), sampler_before) and torch.equal(torch.get_rng_state(), rng_before)
    assert all(p.grad is None for p in model.parameters())


def test_configured_precision_skips_the_probe():
    def never(batch):
        raise AssertionError("no probe when the precision is configured")

    for precision, bf16_autocast, want in (("fp32", False, False), ("bf16", False, True), ("auto", True, True)):
        cfg = Cfg()
        cfg.precision, cfg.bf16_autocast = precision, bf16_autocast
        assert choose_precision(cfg, torch.device("cpu"), Model(), Counter(), never, lambda b, d: b)[0] is want


def test_a_resumed_run_keeps_its_checkpoint_precision(tmp_path, monkeypatch):
    from tokenloom.samples.images import sample_photos
    from tokenloom.tokenizers.visual import VisualTokenizerConfig, train_visual

    photos = list(sample_photos("train").values())[:2], list(sample_photos("heldout").values())[:1]
    cfg = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1, vit_heads=2, fusion_heads=2,
                                image_size=32, batch_size=2, max_pixels=48 * 64, eval_crops=1, warmup_steps=2,
                                max_minutes=1000.0, eval_every_s=1e9, checkpoint_every_s=1e9, steps=4)
    assert cfg.precision == "auto"
    monkeypatch.setattr(loop, "choose_precision", lambda *a, **k: (True, {"precision": "auto", "bf16": True,
                                                                          "why": "probe"}))
    run = tmp_path / "run"
    train_visual(*photos, cfg, tmp_path / "bundles", run, progress=False, stop_after=2, device="cpu")
    assert torch.load(run / "checkpoint.pt", weights_only=True)["bf16"] is True
    assert json.loads((run / "precision.json").read_text())["bf16"] is True

    def no_probe(*a, **k):
        raise AssertionError("a resume must not probe again")

    monkeypatch.setattr(loop, "choose_precision", no_probe)
    # the configured precision may differ on resume: the checkpoint's choice holds
    train_visual(*photos, replace(cfg, precision="fp32"), tmp_path / "bundles", run, resume=True, progress=False,
                 device="cpu")
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 4 and state["bf16"] is True
