"""What the neural audio codecs add to reconstruction losses (EnCodec, DAC): a multi-scale
STFT discriminator with a hinge loss and feature matching, and EnCodec's loss balancer.

Discriminator (EnCodec's MS-STFT-D, narrower for a CPU budget): per scale, the complex STFT
(real and imaginary parts as two channels, [B, 2, frames, bins]) goes through 2-D convolutions
with kernels (3, 9) over (time, frequency), stride 2 along frequency and dilations 1, 2, 4
along time, LeakyReLU 0.2, to a map of logits. Every intermediate map is a feature for the
feature-matching loss (L1 between the maps of the real and the decoded audio, divided by the
mean magnitude of the real map).

Balancer (EnCodec, Défossez et al. 2022, section 3.4): each loss l_i that depends on the
decoded waveform y contributes its gradient g_i = dl_i/dy rescaled to a share of a fixed norm,
w_i / sum(w) * g_i / <||g_i||>, where <||g_i||> is a moving average of its per-item norm
(EnCodec: decay 0.999; here 0 by default, this step's norm: the SI-SDR gradient's norm swings
by 30x between steps, and an average of its peaks starved it, bench/RESULTS.md). The weights then say how much of the gradient each loss gets, whatever its scale
(the SI-SDR term in dB and a log-mel distance differ by orders of magnitude). The balanced
gradient reaches the model through a surrogate loss <y, g.detach()>, so the training loop's one
`backward()` stays as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class STFTDiscriminator(nn.Module):
    """One scale of the MS-STFT discriminator: logits and feature maps of a waveform [B, 1, T]."""

    def __init__(self, n_fft: int, channels: int = 16, dilations: tuple[int, ...] = (1, 2, 4)):
        super().__init__()
        self.n_fft, self.hop = n_fft, n_fft // 4
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        convs = [nn.Conv2d(2, channels, (3, 9), padding=(1, 4))]
        for d in dilations:
            convs.append(nn.Conv2d(channels, channels, (3, 9), stride=(1, 2), dilation=(d, 1), padding=(d, 4)))
        convs.append(nn.Conv2d(channels, channels, (3, 3), padding=(1, 1)))
        self.convs = nn.ModuleList(convs)
        self.post = nn.Conv2d(channels, 1, (3, 3), padding=(1, 1))

    def forward(self, wav: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        spec = torch.stft(wav[:, 0].float(), self.n_fft, self.hop, window=self.window, normalized=True,
                          return_complex=True)  # [B, bins, frames]
        x = torch.stack([spec.real, spec.imag], dim=1).transpose(2, 3)  # [B, 2, frames, bins]
        features = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.2)
            features.append(x)
        return self.post(x), features


class MultiScaleSTFTDiscriminator(nn.Module):
    def __init__(self, scales: tuple[int, ...] = (1024, 512, 256), channels: int = 16):
        super().__init__()
        self.discriminators = nn.ModuleList(STFTDiscriminator(n, channels) for n in scales)

    def forward(self, wav: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        return [d(wav) for d in self.discriminators]


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """Hinge loss of the discriminator: real logits pushed above 1, decoded ones below -1."""
    total = sum(F.relu(1 - r).mean() + F.relu(1 + f).mean() for (r, _), (f, _) in zip(real, fake, strict=True))
    return total / len(real)


def generator_losses(real: list, fake: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(adversarial hinge loss of the decoder, feature matching) over the scales."""
    adversarial = sum(F.relu(1 - f).mean() for f, _ in fake) / len(fake)
    matching, count = fake[0][0].new_zeros(()), 0
    for (_, real_maps), (_, fake_maps) in zip(real, fake, strict=True):
        for r, f in zip(real_maps, fake_maps, strict=True):
            r = r.detach()
            matching = matching + F.l1_loss(f, r) / (r.abs().mean() + 1e-8)
            count += 1
    return adversarial, matching / count


class Balancer:
    """EnCodec's loss balancer over losses of one output tensor (see the module docstring)."""

    def __init__(self, weights: dict[str, float], decay: float = 0.999, total_norm: float = 1.0):
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"balancer weights must be non-negative with a positive sum, got {weights}")
        self.weights = dict(weights)
        self.decay, self.total_norm = decay, total_norm
        self.averages: dict[str, float] = {}  # name -> bias-corrected EMA of the gradient norm
        self.counts: dict[str, float] = {}

    def surrogate(self, losses: dict[str, torch.Tensor], output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A scalar whose gradient with respect to everything before `output` is the balanced
        combination of the losses' gradients; and the norms seen (for logging)."""
        if set(losses) - set(self.weights):
            raise ValueError(f"no balancer weight for {sorted(set(losses) - set(self.weights))}")
        total_weight = sum(self.weights[name] for name in losses)
        combined = torch.zeros_like(output)
        norms = {}
        for name, loss in losses.items():
            (grad,) = torch.autograd.grad(loss, [output], retain_graph=True)
            norm = float(grad.flatten(1).norm(dim=1).mean()) if grad.ndim > 1 else float(grad.norm())
            # bias-corrected moving average (Adam's correction), so the first steps are not biased to 0
            self.counts[name] = self.decay * self.counts.get(name, 0.0) + 1.0
            self.averages[name] = self.decay * self.averages.get(name, 0.0) + norm
            average = self.averages[name] / self.counts[name]
            norms[f"gradnorm_{name}"] = norm
            combined += (self.total_norm * self.weights[name] / total_weight / (average + 1e-12)) * grad
        return (output * combined.detach()).sum(), norms

    def state_dict(self) -> dict:
        return {"averages": dict(self.averages), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.averages = {k: float(v) for k, v in state["averages"].items()}
        self.counts = {k: float(v) for k, v in state["counts"].items()}
