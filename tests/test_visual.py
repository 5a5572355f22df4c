"""The dual-path visual tokenizer: shapes, determinism, bundles, resume, evaluation."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tokenloom.tokenizers.visual import (
    VisualTokenizer,
    VisualTokenizerConfig,
    evaluate,
    fit_to_budget,
    load_visual,
    matched_baseline,
    parameter_count,
    prepare,
    train_visual,
)
from tokenloom.tokenizers.visual.train import publish_bundle

TINY = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1, vit_heads=2, fusion_heads=2,
                             precision="fp32",  # runs compared bit for bit: no timing probe
                             image_size=32, batch_size=2, max_pixels=48 * 64, eval_crops=1, warmup_steps=2,
                             max_minutes=1000.0, eval_every_s=1e9, checkpoint_every_s=1e9)


def ready(model: VisualTokenizer) -> VisualTokenizer:
    """An untrained tokenizer with its VQ codebook initialized (k-means on random images), in eval mode."""
    model.init_codebook(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    return model.eval()


@pytest.fixture(scope="module")
def photos():
    from tokenloom.samples.images import sample_photos

    train = sample_photos("train")
    return [train["astronaut"], train["rocket"], train["camera"]], list(sample_photos("heldout").values())


@pytest.mark.parametrize("quantizer", ["fsq", "vq", "lfq", "simvq"])
@pytest.mark.parametrize("arch", ["dual", "cnn"])
def test_encode_decode_shapes_and_determinism(arch, quantizer):
    torch.manual_seed(0)
    model = VisualTokenizer(replace(TINY, arch=arch, quantizer=quantizer, codebook_size=64)).eval()
    x = torch.rand(2, 3, 40, 56)  # not square: a 5 x 7 grid at factor 8
    if quantizer == "vq":
        with pytest.raises(ValueError, match="codebook is not initialized"):
            model.encode(x)
    ready(model)
    codes = model.encode(x)
    assert codes.shape == (2, 5, 7) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < model.num_codes
    assert torch.equal(codes, model.encode(x)), "encoding must be deterministic"
    images = model.decode(codes)
    assert images.shape == (2, 3, 40, 56) and float(images.min()) >= 0 and float(images.max()) <= 1
    assert torch.equal(images, model.decode(codes))
    # decoding the codes gives what the forward pass reconstructs
    recon, fwd_codes, _ = model(x)
    assert torch.equal(fwd_codes, codes)
    torch.testing.assert_close(recon.clamp(0, 1), images, atol=1e-5, rtol=1e-5)


def test_factor_16_and_bad_shapes():
    model = ready(VisualTokenizer(replace(TINY, factor=16, image_size=32)))
    assert model.encode(torch.rand(1, 3, 32, 48)).shape == (1, 2, 3)
    with pytest.raises(ValueError, match="multiples of 16"):
        model.encode(torch.rand(1, 3, 40, 48))
    with pytest.raises(ValueError, match=r"\[batch, 3, H, W\]"):
        model.encode(torch.rand(3, 32, 32))
    with pytest.raises(ValueError, match="codes must lie in"):
        model.decode(torch.full((1, 2, 2), model.num_codes))


@pytest.mark.parametrize("h,w", [(1, 1), (7, 3000), (4000, 3000), (512, 768), (64, 64), (100, 37)])
def test_fit_to_budget_keeps_aspect_and_budget(h, w):
    oh, ow = fit_to_budget(h, w, 256 * 256, 8)
    assert oh % 8 == 0 and ow % 8 == 0 and oh >= 8 and ow >= 8
    assert oh * ow <= 256 * 256
    if min(h, w) >= 64:  # aspect ratio kept up to rounding to whole cells
        assert abs(oh / ow - h / w) / (h / w) < 0.1


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="visual_tokenizer.factor"):
        replace(TINY, factor=4).validate()
    with pytest.raises(ValueError, match="visual_tokenizer.quantizer"):
        replace(TINY, quantizer="pq").validate()


def test_baseline_matches_parameter_count():
    cfg = VisualTokenizerConfig()
    dual = parameter_count(VisualTokenizer(cfg))
    base_cfg, extra = matched_baseline(cfg)
    base = VisualTokenizer(base_cfg, extra)
    assert base.vit is None and base.fusion is None and extra > 0
    assert abs(parameter_count(base) - dual) / dual < 0.05


def test_bundle_round_trip_gives_identical_codes(tmp_path, photos):
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="never initialized"):
        publish_bundle(VisualTokenizer(TINY), tmp_path)
    model = ready(VisualTokenizer(TINY))
    info = publish_bundle(model, tmp_path)
    assert info.id.startswith("visual-") and (info.path / "model.safetensors").is_file()
    assert not list(info.path.glob("*.pt")), "bundles hold no pickles"
    loaded = load_visual(info.path)
    x = prepare(photos[1][0], TINY)[None]
    assert torch.equal(model.encode(x), loaded.encode(x))
    assert torch.equal(model.decode(model.encode(x)), loaded.decode(loaded.encode(x)))
    assert publish_bundle(loaded, tmp_path).id == info.id, "same weights, same id"


def test_prepare_fits_the_pixel_budget(photos):
    x = prepare(photos[1][0], TINY)  # chelsea, 300 x 451
    assert x.shape[1] * x.shape[2] <= TINY.max_pixels and x.shape[1] % 8 == 0 and x.shape[2] % 8 == 0
    assert x.shape[2] > x.shape[1], "landscape stays landscape"


def test_training_improves_and_resume_continues(tmp_path, photos):
    cfg = replace(TINY, steps=12)
    store, run = tmp_path / "bundles", tmp_path / "run"
    untrained = evaluate(ready(VisualTokenizer(cfg)), [prepare(p, cfg) for p in photos[1]])
    full = train_visual(photos[0], photos[1], cfg, store, tmp_path / "full", progress=False, device="cpu")
    assert full.steps == 12 and full.heldout["psnr"] > untrained.psnr
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["heldout_psnr"] == pytest.approx(full.heldout["psnr"])
    assert (tmp_path / "full" / "eval-final.png").is_file()

    # interrupted at step 5, then resumed to 12: the same weights as the uninterrupted run
    train_visual(photos[0], photos[1], cfg, store, run, progress=False, stop_after=5, device="cpu")
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 5
    with pytest.raises(ValueError, match="another config"):
        train_visual(photos[0], photos[1], replace(cfg, lr=1e-4), store, run, resume=True, progress=False)
    with pytest.raises(ValueError, match="already holds a training run"):
        train_visual(photos[0], photos[1], cfg, store, run, progress=False)
    with pytest.raises(ValueError, match="nothing to resume"):
        train_visual(photos[0], photos[1], cfg, store, tmp_path / "none", resume=True, progress=False)
    resumed = train_visual(photos[0], photos[1], cfg, store, run, resume=True, progress=False, device="cpu")
    assert resumed.steps == 12
    assert resumed.bundle.id == full.bundle.id, "resume must continue exactly where the run stopped"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13)), "no step logged twice after a resume"


def test_evaluate_metrics_and_grid(tmp_path, photos):
    torch.manual_seed(0)
    model = ready(VisualTokenizer(TINY))
    images = [prepare(p, TINY) for p in photos[1]]
    ev = evaluate(model, images, names=["a", "b"], grid_path=tmp_path / "grid.png")
    assert ev.images == 2 and len(ev.per_image) == 2 and ev.per_image[0]["name"] == "a"
    assert 0 < ev.usage <= 1 and 1 <= ev.perplexity <= model.num_codes
    assert ev.codes == sum(p["grid"][0] * p["grid"][1] for p in ev.per_image)
    from PIL import Image

    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (2 * 164 + 4, 2 * 164 + 4, 3), "two rows of original | reconstruction, 160 px cells"
    assert grid[4:164, 4:164].std() > 10, "the original is drawn in its cell"
    # a perfect reconstruction scores higher than this one: PSNR is a real measurement
    perfect = evaluate(_Identity(model), images)
    assert perfect.psnr > 60 and perfect.ssim > 0.99 and ev.psnr < perfect.psnr


class _Identity(torch.nn.Module):
    """Stands in for a tokenizer whose decoder is exact (encode keeps the image)."""

    def __init__(self, model):
        super().__init__()
        self.num_codes = model.num_codes
        self._last = None

    def encode(self, x):
        self._last = x
        return torch.zeros(x.shape[0], x.shape[2] // 8, x.shape[3] // 8, dtype=torch.long)

    def decode(self, codes):
        return self._last


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_codebook_diversity_loss_spreads_the_codes(weight):
    """`vq_diversity` reaches the quantizer: optimizing latents bunched on a few codes against the
    quantizer's loss (codebook frozen, so only the loss can move them) spreads them over many
    codes with the diversity term, and leaves them bunched without it."""
    model = VisualTokenizer(replace(TINY, vq_diversity=weight))
    g = torch.Generator().manual_seed(1)
    model.init_codebook(torch.rand(64, 3, 32, 32, generator=g))  # 1,024 vectors for the 512 codes
    model.train()
    start = model.quantizer.codebook[0].detach().clone() if model.quantizer.codebook.ndim == 2 else None
    assert start is not None
    z = (model.quantizer.project_out(start)[None] + 0.01 * torch.randn(256, 16, generator=g))[None]
    z = z.detach().clone().requires_grad_(True)
    before = model.quantizer(z, freeze_codebook=True)[1].unique().numel()
    opt = torch.optim.Adam([z], lr=0.05)
    for _ in range(60):
        opt.zero_grad()
        model.quantizer(z, freeze_codebook=True)[2].sum().backward()
        opt.step()
    after = model.quantizer(z, freeze_codebook=True)[1].unique().numel()
    assert before <= 4
    if weight:
        assert after >= 4 * before + 8, (before, after)
    else:
        assert after <= before + 2, (before, after)
