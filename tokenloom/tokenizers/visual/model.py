"""The dual-path visual tokenizer: CNN detail path + ViT semantic path, fused, quantized.

    image ─┬─► CNN path (strided convs + residual blocks, /factor) ──► detail tokens (queries)
           │                                                               │ cross-attention
           └─► ViT path (factor x factor patches, 2-D sin-cos positions) ─► semantic tokens (keys, values)
                                                                           ▼
                          fused tokens ─► quantizer (vector-quantize-pytorch) ─► codes, h x w raster
                          codes ─► convolutional decoder (mirror of the CNN path) ─► image

Both paths produce one token per factor x factor pixels, so the fusion is a per-position
query into the whole ViT sequence: each code sees the local detail of its own cell and, by
attention, the global content of the image. Positions are computed for the actual grid, so
any image whose sides are multiples of the factor encodes, whatever its aspect ratio.

`arch="cnn"` is the single-path ablation: the CNN path alone with extra residual blocks at
the bottleneck instead of the ViT and fusion, sized to the same parameter count
(`matched_baseline`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.tokenizers.visual.config import VisualTokenizerConfig, fit_to_budget  # noqa: F401


# -- building blocks ----------------------------------------------------------------------
def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            _norm(channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1),
            _norm(channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _widths(cfg: VisualTokenizerConfig) -> list[int]:
    """Channel width at each resolution level, from the stem (/2) down to /factor."""
    levels = int(math.log2(cfg.factor))
    return [min(cfg.channels * 2**i, cfg.latent_channels) for i in range(levels)]


class CNNPath(nn.Module):
    """Strided convolutions with residual blocks: /2 per level, local detail and texture."""

    def __init__(self, cfg: VisualTokenizerConfig, extra_blocks: int = 0):
        super().__init__()
        widths = _widths(cfg)
        layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 4, stride=2, padding=1)]
        for i, width in enumerate(widths):
            layers.append(ResBlock(width))
            out = widths[i + 1] if i + 1 < len(widths) else cfg.latent_channels
            if i + 1 < len(widths):
                layers.append(nn.Conv2d(width, out, 4, stride=2, padding=1))
            elif out != width:
                layers.append(nn.Conv2d(width, out, 1))
        layers += [ResBlock(cfg.latent_channels) for _ in range(cfg.bottleneck_blocks + extra_blocks)]
        layers += [_norm(cfg.latent_channels), nn.SiLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def sincos_2d(h: int, w: int, dim: int, device=None) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings for an h x w grid, [h*w, dim] in raster order."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need dim divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter))
    ys, xs = torch.meshgrid(torch.arange(h, device=device, dtype=torch.float32),
                            torch.arange(w, device=device, dtype=torch.float32), indexing="ij")
    y, x = ys.reshape(-1, 1) * omega, xs.reshape(-1, 1) * omega
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1)


class ViTPath(nn.Module):
    """Patch embedding + pre-norm transformer: global semantics, one token per cell."""

    def __init__(self, cfg: VisualTokenizerConfig):
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.vit_dim, cfg.factor, stride=cfg.factor)
        layer = nn.TransformerEncoderLayer(cfg.vit_dim, cfg.vit_heads, 4 * cfg.vit_dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.vit_depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.vit_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x)  # [B, D, h, w]
        b, d, h, w = p.shape
        tokens = p.flatten(2).transpose(1, 2) + sincos_2d(h, w, d, p.device).to(p.dtype)
        return self.norm(self.blocks(tokens))  # [B, h*w, D]


class CrossAttentionFusion(nn.Module):
    """CNN tokens (queries) attend to ViT tokens (keys/values); residual + MLP."""

    def __init__(self, cfg: VisualTokenizerConfig):
        super().__init__()
        c, d = cfg.latent_channels, cfg.vit_dim
        self.q_in = nn.Linear(c, d)
        self.norm_q, self.norm_kv = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, cfg.fusion_heads, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.out = nn.Linear(d, c)

    def forward(self, detail: torch.Tensor, semantic: torch.Tensor) -> torch.Tensor:
        b, c, h, w = detail.shape
        q = self.q_in(detail.flatten(2).transpose(1, 2))
        kv = self.norm_kv(semantic)
        fused = q + self.attn(self.norm_q(q), kv, kv, need_weights=False)[0]
        fused = fused + self.mlp(fused)
        out = detail + self.out(fused).transpose(1, 2).reshape(b, c, h, w)
        return out


class Decoder(nn.Module):
    """Mirror of the CNN path: residual blocks and nearest-upsample convolutions back to the
    stem's resolution, then a sub-pixel convolution (PixelShuffle) to full resolution, so no
    convolution runs at full resolution (it would cost as much as the rest of the decoder)."""

    def __init__(self, cfg: VisualTokenizerConfig):
        super().__init__()
        widths = _widths(cfg)[::-1]
        layers: list[nn.Module] = [nn.Conv2d(cfg.latent_channels, widths[0], 3, padding=1)]
        layers += [ResBlock(widths[0]) for _ in range(cfg.bottleneck_blocks)]
        for i, width in enumerate(widths):
            layers.append(ResBlock(width))
            if i + 1 < len(widths):
                layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(width, widths[i + 1], 3, padding=1)]
        layers += [_norm(widths[-1]), nn.SiLU(), nn.Conv2d(widths[-1], 3 * 4, 3, padding=1), nn.PixelShuffle(2)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def _make_quantizer(cfg: VisualTokenizerConfig) -> nn.Module:
    from vector_quantize_pytorch import FSQ, LFQ, SimVQ, VectorQuantize

    if cfg.quantizer == "fsq":
        return FSQ(levels=list(cfg.fsq_levels), dim=cfg.latent_channels)
    if cfg.quantizer == "lfq":
        return LFQ(dim=cfg.latent_channels, codebook_size=cfg.codebook_size, entropy_loss_weight=0.1)
    if cfg.quantizer == "simvq":
        return SimVQ(dim=cfg.latent_channels, codebook_size=cfg.codebook_size, rotation_trick=True,
                     frozen_codebook_dim=cfg.simvq_code_dim or None)
    return VectorQuantize(dim=cfg.latent_channels, codebook_size=cfg.codebook_size, codebook_dim=cfg.vq_code_dim,
                          decay=cfg.vq_decay, kmeans_init=True, threshold_ema_dead_code=cfg.vq_dead_code,
                          use_cosine_sim=cfg.vq_cosine, commitment_weight=0.25,
                          codebook_diversity_loss_weight=cfg.vq_diversity,
                          codebook_diversity_temperature=cfg.vq_diversity_temperature)


# -- the tokenizer ------------------------------------------------------------------------
class VisualTokenizer(nn.Module):
    """encode: [B, 3, H, W] in [0, 1] -> codes [B, H/f, W/f]; decode: codes -> images."""

    def __init__(self, cfg: VisualTokenizerConfig, extra_cnn_blocks: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.extra_cnn_blocks = extra_cnn_blocks
        self.cnn = CNNPath(cfg, extra_cnn_blocks)
        self.vit = ViTPath(cfg) if cfg.arch == "dual" else None
        self.fusion = CrossAttentionFusion(cfg) if cfg.arch == "dual" else None
        self.quantizer = _make_quantizer(cfg)
        self.decoder = Decoder(cfg)

    @property
    def num_codes(self) -> int:
        return self.cfg.num_codes

    @property
    def codebook_ready(self) -> bool:
        """VQ codebooks are initialized by k-means on the first training batch; until then
        encoding would initialize them from whatever it is given (non-deterministic use)."""
        codebook = getattr(self.quantizer, "_codebook", None)
        return codebook is None or bool(getattr(codebook, "initted", True))

    @torch.no_grad()
    def init_codebook(self, images: torch.Tensor) -> None:
        """Initialize a VQ codebook from these images (k-means), as the first training step would."""
        was_training = self.training
        self.train()
        self.quantize(self.features(images))
        self.train(was_training)

    def _check(self, images: torch.Tensor) -> None:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [batch, 3, H, W], got {tuple(images.shape)}")
        f = self.cfg.factor
        if images.shape[2] % f or images.shape[3] % f:
            raise ValueError(f"image sides must be multiples of {f}, got {images.shape[2]}x{images.shape[3]} "
                             "(resize with fit_to_budget first)")

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Pre-quantization latents [B, C, h, w] (images in [0, 1])."""
        self._check(images)
        x = images * 2 - 1
        detail = self.cnn(x)
        if self.vit is not None:
            detail = self.fusion(detail, self.vit(x))
        return detail

    def quantize(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quantized [B, C, h, w], codes [B, h, w] int64, auxiliary loss)."""
        b, c, h, w = latents.shape
        seq = latents.flatten(2).transpose(1, 2).float()
        out = self.quantizer(seq)
        if self.cfg.quantizer == "fsq":
            quantized, codes = out
            aux = seq.new_zeros(())
        else:  # vq, simvq: commitment loss; lfq: entropy + commitment loss
            quantized, codes, aux = out
        quantized = quantized.transpose(1, 2).reshape(b, c, h, w)
        return quantized, codes.reshape(b, h, w).long(), aux.sum()

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction in [0, 1] (unclamped), codes, auxiliary quantizer loss)."""
        quantized, codes, aux = self.quantize(self.features(images))
        return (self.decoder(quantized) + 1) / 2, codes, aux

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        if not self.codebook_ready:
            raise ValueError("this tokenizer's VQ codebook is not initialized: train it (or call init_codebook) first")
        return self.quantize(self.features(images))[1]

    def codes_to_latents(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.ndim != 3:
            raise ValueError(f"codes must be [batch, h, w], got {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_codes):
            raise ValueError(f"codes must lie in [0, {self.num_codes}), got {int(codes.min())}..{int(codes.max())}")
        if not self.codebook_ready:
            raise ValueError("this tokenizer's VQ codebook is not initialized: train it (or call init_codebook) first")
        b, h, w = codes.shape
        flat = codes.reshape(b, h * w)
        if self.cfg.quantizer in ("fsq", "lfq", "simvq"):
            seq = self.quantizer.indices_to_codes(flat)
        else:
            seq = self.quantizer.get_output_from_indices(flat)
        return seq.transpose(1, 2).reshape(b, -1, h, w)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, h, w] -> images [B, 3, h*f, w*f] in [0, 1]."""
        return ((self.decoder(self.codes_to_latents(codes)) + 1) / 2).clamp(0, 1)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def matched_baseline(cfg: VisualTokenizerConfig) -> tuple[VisualTokenizerConfig, int]:
    """The single-path ablation config and the extra bottleneck blocks that give it the
    dual-path model's parameter count (closest match)."""
    target = parameter_count(VisualTokenizer(replace(cfg, arch="dual")))
    base = replace(cfg, arch="cnn")
    best, best_gap = 0, None
    for extra in range(0, 16):
        gap = abs(parameter_count(VisualTokenizer(base, extra)) - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = extra, gap
    return base, best


def resize_images(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of [B, 3, H, W] float images."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    return F.interpolate(images, size=size, mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)
