"""Our reconstruction metrics equal torchmetrics' (the peer) on random inputs, and rank quality."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from tokenloom.tokenizers.metrics import psnr, si_sdr, ssim


@pytest.mark.parametrize("noise", [0.02, 0.1, 0.3])
def test_image_metrics_equal_torchmetrics(noise):
    g = torch.Generator().manual_seed(int(noise * 100))
    x = torch.rand(3, 3, 48, 64, generator=g)
    y = (x + noise * torch.randn(x.shape, generator=g)).clamp(0, 1)
    torch.testing.assert_close(psnr(y, x), peak_signal_noise_ratio(y, x, data_range=1.0, reduction="none",
                                                                   dim=(1, 2, 3)), rtol=1e-5, atol=1e-4)
    # scikit-image and torchmetrics treat the 5-pixel border of the 11 x 11 window differently
    torch.testing.assert_close(ssim(y, x), structural_similarity_index_measure(y, x, data_range=1.0, reduction="none"),
                               rtol=0, atol=3e-3)
    assert float(ssim(x, x).min()) == pytest.approx(1.0) and bool((ssim(y, x) < 1).all())


def test_si_sdr_equals_torchmetrics_and_is_scale_invariant():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 8000, generator=g)
    estimate = target + torch.linspace(0.05, 2.0, 4)[:, None] * torch.randn(4, 8000, generator=g)
    ours = si_sdr(estimate, target)
    torch.testing.assert_close(ours, scale_invariant_signal_distortion_ratio(estimate, target, zero_mean=True),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(si_sdr(3.0 * estimate + 0.5, target), ours, rtol=1e-4, atol=1e-4)
    assert bool((ours[:-1] > ours[1:]).all()), "more noise, lower SI-SDR"
    assert float(si_sdr(target, target).min()) > 60
