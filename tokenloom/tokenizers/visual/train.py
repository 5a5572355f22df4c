"""Training, evaluation and bundles of the visual tokenizer.

Training runs on random crops (torchvision RandomResizedCrop + flips) of the training
photos for a wall-clock budget, with a cosine learning-rate schedule over that budget,
periodic checkpoints (resumable: model, optimizer, RNG, step and elapsed time) and a
held-out evaluation (PSNR, SSIM from `tokenizers.metrics`, codebook usage and perplexity, plus a PNG grid of
originals beside reconstructions). The result is published as a content-addressed bundle
(safetensors weights + bundle.json); loading never unpickles.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.tokenizers import bundle
from tokenloom.tokenizers.loop import run_training
from tokenloom.tokenizers.visual.model import (
    VisualTokenizer,
    VisualTokenizerConfig,
    fit_to_budget,
    parameter_count,
    resize_images,
)

FORMAT = "tokenloom.visual/1"


# -- images as tensors --------------------------------------------------------------------
def to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """H x W x 3 uint8 -> [3, H, W] float in [0, 1]."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected an H x W x 3 uint8 RGB array, got {pixels.shape} {pixels.dtype}")
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float() / 255.0


def to_pixels(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] in [0, 1] -> H x W x 3 uint8."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def prepare(pixels: np.ndarray, cfg: VisualTokenizerConfig) -> torch.Tensor:
    """An RGB image resized into the encode-time pixel budget: [3, h*f, w*f] in [0, 1]."""
    image = to_tensor(pixels)
    size = fit_to_budget(image.shape[1], image.shape[2], cfg.max_pixels, cfg.factor)
    return resize_images(image[None], size)[0]


class CropSampler:
    """Random training crops of a fixed set of photos (torchvision v2 transforms)."""

    def __init__(self, photos: list[np.ndarray], size: int, seed: int, scale: tuple[float, float] = (0.05, 0.6)):
        from torchvision.transforms import v2

        if not photos:
            raise ValueError("no training images")
        self.photos = [torch.from_numpy(np.ascontiguousarray(p)).permute(2, 0, 1) for p in photos]
        weights = torch.tensor([math.sqrt(p.shape[1] * p.shape[2]) for p in self.photos])
        self.weights = weights / weights.sum()  # bigger photos hold more distinct crops
        self.transform = v2.Compose([
            v2.RandomResizedCrop(size, scale=scale, ratio=(3 / 4, 4 / 3), antialias=True),
            v2.RandomHorizontalFlip(),
        ])
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, n: int) -> torch.Tensor:
        picks = torch.multinomial(self.weights, n, replacement=True, generator=self.generator)
        # torchvision's transforms draw from the global RNG: seed it from ours, so a resumed run continues the stream
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.generator)))
        crops = [self.transform(self.photos[int(i)]) for i in picks]
        return torch.stack(crops).float() / 255.0

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def heldout_crops(photos: list[np.ndarray], per_photo: int, size: int, seed: int) -> list[torch.Tensor]:
    """A fixed evaluation set: `per_photo` crops of each held-out photo (plus the whole photo
    resized to size x size), the same on every call."""
    sampler = CropSampler(photos, size, seed, scale=(0.1, 0.8))
    out = []
    with torch.random.fork_rng():
        for photo in sampler.photos:
            out.append(resize_images(photo[None].float() / 255.0, (size, size))[0])
            torch.manual_seed(seed)
            out += [sampler.transform(photo).float() / 255.0 for _ in range(per_photo)]
    return out


# -- metrics ------------------------------------------------------------------------------
@dataclass
class EvalResult:
    psnr: float
    ssim: float
    usage: float  # fraction of the codebook used on these images
    perplexity: float  # exp(entropy) of the code histogram
    images: int
    codes: int
    num_codes: int
    per_image: list[dict] = field(default_factory=list)
    grid: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def evaluate(model: VisualTokenizer, images: list[torch.Tensor], names: list[str] | None = None,
             grid_path: Path | None = None, batch_size: int = 8) -> EvalResult:
    """Reconstruct `images` ([3, H, W] in [0, 1], sides multiples of the factor)."""
    from tokenloom.tokenizers.metrics import psnr, ssim

    if not images:
        raise ValueError("nothing to evaluate: no images")
    model.eval()
    names = names or [f"image {i}" for i in range(len(images))]
    histogram = torch.zeros(model.num_codes, dtype=torch.long)
    per_image: list[dict] = [{}] * len(images)
    recons: list[torch.Tensor] = [torch.empty(0)] * len(images)
    by_shape: dict[tuple, list[int]] = {}
    for i, image in enumerate(images):
        by_shape.setdefault(tuple(image.shape), []).append(i)
    for indices in by_shape.values():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            x = torch.stack([images[i] for i in chunk]).to(_device_of(model))
            codes = model.encode(x)
            recon = model.decode(codes).float()
            x, codes, recon = x.cpu(), codes.cpu(), recon.cpu()
            histogram += torch.bincount(codes.flatten(), minlength=model.num_codes)
            psnrs, ssims = psnr(recon, x), ssim(recon, x)
            for j, i in enumerate(chunk):
                recons[i] = recon[j]
                per_image[i] = {"name": names[i], "height": int(x.shape[2]), "width": int(x.shape[3]),
                                "grid": [int(codes.shape[1]), int(codes.shape[2])],
                                "psnr": float(psnrs[j]), "ssim": float(ssims[j])}
    probs = histogram.double() / histogram.sum()
    nonzero = probs[probs > 0]
    result = EvalResult(
        psnr=float(np.mean([p["psnr"] for p in per_image])),
        ssim=float(np.mean([p["ssim"] for p in per_image])),
        usage=float((histogram > 0).sum()) / model.num_codes,
        perplexity=float(torch.exp(-(nonzero * nonzero.log()).sum())),
        images=len(images),
        codes=int(histogram.sum()),
        num_codes=model.num_codes,
        per_image=per_image,
    )
    if grid_path is not None:
        result.grid = str(save_grid(images, recons, grid_path))
    return result


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def save_grid(originals: list[torch.Tensor], recons: list[torch.Tensor], path: Path, max_pairs: int = 12,
              cell: int = 160) -> Path:
    """PNG: each row an original beside its reconstruction (letterboxed to cell x cell, 4 px apart)."""
    from PIL import Image

    tiles = []
    pairs = list(zip(originals, recons, strict=True))
    picks = (range(len(pairs)) if len(pairs) <= max_pairs
             else sorted({round(i * (len(pairs) - 1) / (max_pairs - 1)) for i in range(max_pairs)}))
    for original, recon in (pairs[i] for i in picks):  # spread over the whole set
        for image in (original, recon):
            h, w = image.shape[1:]
            scale = cell / max(h, w)
            small = resize_images(image[None].clamp(0, 1), (max(1, round(h * scale)), max(1, round(w * scale))))[0]
            tile = torch.ones(3, cell, cell)
            top, left = (cell - small.shape[1]) // 2, (cell - small.shape[2]) // 2
            tile[:, top:top + small.shape[1], left:left + small.shape[2]] = small
            tiles.append(tile)
    path.parent.mkdir(parents=True, exist_ok=True)
    pad, rows = 4, (len(tiles) + 1) // 2
    sheet = torch.ones(3, pad + rows * (cell + pad), pad + 2 * (cell + pad))
    for k, tile in enumerate(tiles):
        top, left = pad + (k // 2) * (cell + pad), pad + (k % 2) * (cell + pad)
        sheet[:, top:top + cell, left:left + cell] = tile
    Image.fromarray(to_pixels(sheet)).save(path, format="PNG")
    return path


# -- bundles ------------------------------------------------------------------------------
def config_from_dict(doc: dict) -> VisualTokenizerConfig:
    known = VisualTokenizerConfig.__dataclass_fields__
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in doc.items() if k in known}
    return VisualTokenizerConfig(**values)


def publish_bundle(model: VisualTokenizer, store: Path, heldout: dict | None = None) -> bundle.BundleInfo:
    if not model.codebook_ready:
        raise ValueError("refusing to publish a visual tokenizer whose VQ codebook was never initialized")
    return bundle.publish_module(model, store, "visual", {
        "format": FORMAT,
        "config": asdict(model.cfg),
        "extra_cnn_blocks": model.extra_cnn_blocks,
        "num_codes": model.num_codes,
        "code_range": [0, model.num_codes],  # local ids; the vocabulary manifest places them in the unified space
        "factor": model.cfg.factor,
        "grid_order": "raster",
        "parameters": parameter_count(model),
        "heldout": heldout or {},
    })


def load_visual(path: Path | str) -> VisualTokenizer:
    """A visual tokenizer bundle, ready to encode/decode (eval mode, no gradients)."""
    return bundle.load_module(path, "visual", FORMAT, lambda doc: VisualTokenizer(
        config_from_dict(doc["config"]), int(doc.get("extra_cnn_blocks", 0))))


# -- training -----------------------------------------------------------------------------
@dataclass
class VisualTrainResult:
    bundle: bundle.BundleInfo
    steps: int
    seconds: float
    images_per_second: float
    heldout: dict
    run_dir: str
    parameters: int


def train_visual(train_photos: list[np.ndarray], heldout_photos: list[np.ndarray], cfg: VisualTokenizerConfig,
                 store: Path, run_dir: Path, *, extra_cnn_blocks: int = 0, resume: bool = False,
                 progress: bool = True, stop_after: int = 0, device: str | None = None) -> VisualTrainResult:
    """Train for `cfg.max_minutes` (or `cfg.steps`), evaluate on held-out crops, publish a bundle.

    `resume` continues from the run folder's checkpoint (same recipe; the step and time budgets
    may differ). `stop_after` ends this invocation after that many steps, as an interruption
    would, without changing the schedule (tests use it to check resume)."""
    cfg.validate()
    if not heldout_photos:
        raise ValueError("no held-out images: evaluation needs at least one")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    torch.manual_seed(cfg.seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = VisualTokenizer(cfg, extra_cnn_blocks).to(device)
    sampler = CropSampler(train_photos, cfg.image_size, cfg.seed)
    eval_set = heldout_crops(heldout_photos, cfg.eval_crops, cfg.image_size, cfg.seed + 1)
    grids: dict[str, str | None] = {}

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        recon, _, aux = model(batch)
        recon = recon.float()
        mse = F.mse_loss(recon, batch)
        train_psnr = -10 * math.log10(max(float(mse.detach()), 1e-10))
        return mse + 0.2 * F.l1_loss(recon, batch) + aux, {"train_psnr": train_psnr}

    def evaluate_fn(tag: str) -> dict:
        ev = evaluate(model, eval_set, grid_path=run_dir / f"eval-{tag}.png")
        grids[tag] = ev.grid
        return {k: v for k, v in ev.to_dict().items() if k not in ("per_image", "grid")}

    out = run_training(model, cfg, run_dir, sampler, loss_fn, evaluate_fn, device=device,
                       identity={"extra_cnn_blocks": extra_cnn_blocks}, resume=resume, progress=progress,
                       stop_after=stop_after, desc=f"visual tokenizer ({cfg.arch}, {cfg.quantizer})")
    info = publish_bundle(model, store, out.final)
    result = VisualTrainResult(info, out.steps, out.elapsed, out.items_per_second, out.final, str(run_dir),
                               parameter_count(model))
    (run_dir / "summary.json").write_text(json.dumps({**asdict(result), "bundle": info.id,
                                                      "grid": grids.get("final")}, indent=2, default=str))
    return result
