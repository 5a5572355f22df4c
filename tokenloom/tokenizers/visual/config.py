"""Configuration of the visual tokenizer (no torch import: the run config reads it cheaply)."""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHS = ("dual", "cnn")
QUANTIZERS = ("fsq", "vq", "lfq", "simvq")


@dataclass
class VisualTokenizerConfig:
    """Architecture, quantizer and training recipe of a visual tokenizer bundle."""

    arch: str = "dual"  # "dual" (CNN + ViT + fusion) or "cnn" (single-path ablation)
    factor: int = 8  # pixels per code side: 8 or 16
    channels: int = 32  # CNN width after the stem; doubles per downsampling, capped at latent_channels
    latent_channels: int = 128  # width at the bottleneck (CNN path output, decoder input)
    bottleneck_blocks: int = 1  # residual blocks at the bottleneck (the baseline adds more)
    vit_dim: int = 128
    vit_depth: int = 2
    vit_heads: int = 4
    fusion_heads: int = 4
    quantizer: str = "vq"  # chosen by measurement over fsq and lfq: see bench/RESULTS.md
    fsq_levels: tuple[int, int, int, int] = (8, 5, 5, 5)  # 1000 codes
    # vq / lfq / simvq (lfq: a power of two). 512: at the 15-minute CPU budget it reconstructs as well
    # as 1024 codes (held-out PSNR equal in two side-by-side runs) and uses 83% of its codes against 74%
    # (bench/RESULTS.md, "Visual: 512 codes against 1024")
    codebook_size: int = 512
    vq_code_dim: int = 8  # vq: low-dimensional code lookup keeps more codes alive
    vq_cosine: bool = False  # vq: l2-normalized codes and inputs (cosine similarity lookup)
    vq_decay: float = 0.99  # vq: EMA decay of the codebook
    vq_dead_code: int = 2  # vq: codes whose EMA cluster size falls below this are re-seeded from the batch
    # vq: weight of vector-quantize-pytorch's codebook diversity loss (minus the entropy of the
    # batch's mean soft assignment, softmax of -distance x temperature): pushes the encoder to
    # spread its vectors over the codebook; 0 = off
    vq_diversity: float = 0.0
    vq_diversity_temperature: float = 100.0
    # simvq (Zhu et al. 2024, vector-quantize-pytorch's SimVQ): a frozen random codebook through one
    # learned linear map, so every code moves with every update (no dead codes by construction);
    # the rotation trick (Fifty et al. 2024) carries gradients through the quantizer
    simvq_code_dim: int = 0  # frozen codebook width; 0 = latent_channels
    # training
    image_size: int = 128  # square training crops
    max_pixels: int = 256 * 256  # encode-time pixel budget; aspect ratio kept
    batch_size: int = 16
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    steps: int = 100_000  # upper bound; max_minutes usually ends training first
    max_minutes: float = 10.0
    eval_every_s: float = 120.0
    checkpoint_every_s: float = 60.0
    eval_crops: int = 12  # held-out crops per held-out photo (usage needs enough codes to be meaningful)
    seed: int = 0
    threads: int = 0  # torch threads; 0 = torch's default
    # "auto": bf16 autocast on CUDA, and on a CPU where a probe step at the run's start is >= 1.2x
    # faster in bf16 (an AMX Xeon: 1.7x for the visual tokenizer; an AVX2-only EPYC: bf16 is far
    # slower), else fp32 (tokenizers/loop.py choose_precision); "bf16" / "fp32" force it
    precision: str = "auto"
    bf16_autocast: bool = False  # older spelling of precision = "bf16" (true forces bf16)

    def validate(self) -> None:
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"visual_tokenizer.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"visual_tokenizer.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"visual_tokenizer.quantizer must be one of {QUANTIZERS}, got {self.quantizer!r}")
        if self.factor not in (8, 16):
            raise ValueError(f"visual_tokenizer.factor must be 8 or 16, got {self.factor}")
        if self.image_size % self.factor:
            raise ValueError(f"visual_tokenizer.image_size {self.image_size} is not a multiple of factor {self.factor}")
        if self.max_pixels < self.factor * self.factor:
            raise ValueError(f"visual_tokenizer.max_pixels must hold at least one {self.factor}x{self.factor} cell")
        if self.quantizer == "lfq" and self.codebook_size & (self.codebook_size - 1):
            raise ValueError(f"lfq needs a power-of-two codebook_size, got {self.codebook_size}")
        if self.vit_dim % self.vit_heads or self.vit_dim % self.fusion_heads or self.vit_dim % 4:
            raise ValueError("visual_tokenizer.vit_dim must be divisible by 4 (2-D positions), vit_heads and "
                             f"fusion_heads; got {self.vit_dim}, {self.vit_heads}, {self.fusion_heads}")
        if self.vq_diversity < 0 or self.vq_diversity_temperature <= 0:
            raise ValueError("visual_tokenizer.vq_diversity must be >= 0 and vq_diversity_temperature positive")
        for name in ("channels", "latent_channels"):
            value = getattr(self, name)
            if value < 1 or value % min(8, value):
                raise ValueError(f"visual_tokenizer.{name} must be a multiple of 8 (group norm), or below 8; got {value}")

    @property
    def num_codes(self) -> int:
        return math.prod(self.fsq_levels) if self.quantizer == "fsq" else self.codebook_size


def fit_to_budget(height: int, width: int, max_pixels: int, multiple: int) -> tuple[int, int]:
    """The size an image is resized to: aspect ratio kept, sides multiples of `multiple`,
    area at most `max_pixels` (each side at least one cell)."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    scale = min(1.0, math.sqrt(max_pixels / (height * width)))
    h = max(multiple, int(height * scale) // multiple * multiple)
    w = max(multiple, int(width * scale) // multiple * multiple)
    while h * w > max_pixels and (h > multiple or w > multiple):  # a very thin image: shrink the long side
        if h >= w:
            h -= multiple
        else:
            w -= multiple
    return h, w
