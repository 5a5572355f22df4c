"""Reconstruction metrics of the media tokenizers: PSNR, SSIM and SI-SDR.

Why not torchmetrics at run time: importing it costs 21 s per process on the AVX2 EPYC these
figures were measured on (it imports torchvision's models and torch._dynamo), and every
`tokenizer eval`, every audio training (SI-SDR is in its loss) and every demo paid it. PSNR and
SI-SDR are a few lines of standard formulas; SSIM comes from scikit-image (Wang et al.'s
Gaussian-weighted form, 11 x 11 window, sigma 1.5, as torchmetrics computes it by default).
tests/test_metrics.py holds all three to torchmetrics, the peer, on random inputs.
"""

from __future__ import annotations

import numpy as np
import torch


def psnr(recon: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image PSNR (dB) of [B, C, H, W] images."""
    mse = (recon.float() - target.float()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse.clamp_min(1e-12))


def ssim(recon: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image SSIM of [B, C, H, W] images (scikit-image, Gaussian weights)."""
    from skimage.metrics import structural_similarity

    out = [structural_similarity(r, t, data_range=data_range, channel_axis=0, gaussian_weights=True, sigma=1.5,
                                 use_sample_covariance=False)
           for r, t in zip(recon.float().cpu().numpy(), target.float().cpu().numpy(), strict=True)]
    return torch.tensor(np.asarray(out, dtype=np.float64), dtype=torch.float32)


def si_sdr(estimate: torch.Tensor, target: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Scale-invariant SDR (dB) over the last axis, zero-mean (Le Roux et al., 2019); differentiable."""
    estimate = estimate - estimate.mean(-1, keepdim=True)
    target = target - target.mean(-1, keepdim=True)
    scale = ((estimate * target).sum(-1, keepdim=True) + eps) / (target.pow(2).sum(-1, keepdim=True) + eps)
    projection = scale * target
    noise = estimate - projection
    return 10 * torch.log10((projection.pow(2).sum(-1) + eps) / (noise.pow(2).sum(-1) + eps))
