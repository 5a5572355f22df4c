"""The RVQ audio tokenizer: SEANet-style convolutional encoder, ResidualVQ, mirrored decoder.

    16 kHz mono ─► Conv ─► [ResUnit(dilations 1, 3) ─► strided Conv (x2 channels)] per stride
               ─► Conv ─► latents [B, D, frames] ─► ResidualVQ (L levels, quantizer dropout)
    codes [B, frames, L] ─► sum of level codewords ─► mirrored decoder (transposed convs) ─► waveform

Strides (4, 4, 4, 5) give a hop of 320 samples: 50 frames/s at 16 kHz (25 and 12.5 as options;
(2, 4, 5, 8) cost 40% more compute for the same hop and kept encoding under 50x real time).
`arch = "stft"` swaps the waveform convolutions for a frequency-domain pair (FunCodec's
frequency codec, Vocos' decoder): frames of a short-time Fourier transform (hop = one frame,
window `stft_overlap` hops), magnitudes power-law compressed (|X|^c, phase kept), ConvNeXt blocks
at the frame rate, and out the decoder's compressed spectrum, decompressed and overlap-added
(inverse STFT). Nothing runs at the sample rate but the transforms themselves.

Level 1 carries the coarse content, each further level quantizes what the levels before it
left over. Trained with quantizer dropout (a random number of levels per batch), decoding from
the first k levels works for every k, so a consumer may keep fewer levels for a lower bitrate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.tokenizers.audio.config import AudioTokenizerConfig


class ResUnit(nn.Module):
    """A dilated kernel-3 convolution and a pointwise one with a residual: the SEANet block."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.ELU(), nn.Conv1d(channels, channels, 3, dilation=dilation, padding=dilation),
            nn.ELU(), nn.Conv1d(channels, channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _widths(cfg: AudioTokenizerConfig) -> list[int]:
    return [min(cfg.channels * 2**i, cfg.max_channels) for i in range(len(cfg.strides) + 1)]


class Encoder(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        widths = _widths(cfg)
        layers: list[nn.Module] = [nn.Conv1d(1, widths[0], 7, padding=3)]
        for i, stride in enumerate(cfg.strides):
            layers += [ResUnit(widths[i], 1), ResUnit(widths[i], 3), nn.ELU(),
                       nn.Conv1d(widths[i], widths[i + 1], 2 * stride, stride=stride, padding=(stride + 1) // 2)]
        layers += [nn.ELU(), nn.Conv1d(widths[-1], cfg.latent_dim, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.net(wav)


class Decoder(nn.Module):
    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        widths = _widths(cfg)[::-1]
        layers: list[nn.Module] = [nn.Conv1d(cfg.latent_dim, widths[0], 7, padding=3)]
        for i, stride in enumerate(cfg.strides[::-1]):
            pad = (stride + 1) // 2
            layers += [nn.ELU(), nn.ConvTranspose1d(widths[i], widths[i + 1], 2 * stride, stride=stride, padding=pad,
                                                    output_padding=2 * pad - stride),
                       ResUnit(widths[i + 1], 1), ResUnit(widths[i + 1], 3)]
        layers += [nn.ELU(), nn.Conv1d(widths[-1], 1, 7, padding=3)]
        self.net = nn.Sequential(*layers)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.net(latents)


class ConvNeXtBlock(nn.Module):
    """Depthwise kernel-7 convolution, LayerNorm, pointwise 3x MLP (GELU), scaled residual (Vocos' block)."""

    def __init__(self, channels: int, scale: float):
        super().__init__()
        self.dw = nn.Conv1d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, 3 * channels), nn.GELU(), nn.Linear(3 * channels, channels))
        self.gamma = nn.Parameter(torch.full((channels,), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(self.norm(self.dw(x).transpose(1, 2))) * self.gamma
        return x + y.transpose(1, 2)


class _Stft(nn.Module):
    """Frames of `overlap` hops, one per hop, centred on their hop (zero padding): T samples -> T / hop frames."""

    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        self.hop, self.n_fft, self.c = cfg.hop, cfg.hop * cfg.stft_overlap, cfg.stft_compress
        self.pad_each = (self.n_fft - self.hop) // 2
        self.bins = self.n_fft // 2 + 1
        self.register_buffer("window", torch.hann_window(self.n_fft), persistent=False)

    def compressed(self, wav: torch.Tensor) -> torch.Tensor:
        """The compressed complex spectrum [B, bins, frames] of [B, 1, T] audio (T a whole number of hops)."""
        x = F.pad(wav[:, 0].float(), (self.pad_each, self.pad_each))
        spec = torch.stft(x, self.n_fft, self.hop, window=self.window, center=False, return_complex=True)
        return spec * (spec.abs() + 1e-7) ** (self.c - 1)  # |X|^c, phase kept

    def synthesize(self, spec: torch.Tensor) -> torch.Tensor:
        """The inverse of `compressed`: audio [B, 1, frames * hop] from a compressed spectrum
        (decompressed, inverse FFT per frame, windowed overlap-add normalized by the window's)."""
        spec = spec * (spec.abs() + 1e-7) ** (1 / self.c - 1)
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=1) * self.window[:, None]  # [B, n_fft, F]
        n, length = frames.shape[-1], (frames.shape[-1] - 1) * self.hop + self.n_fft
        fold = dict(output_size=(1, length), kernel_size=(1, self.n_fft), stride=(1, self.hop))
        out = F.fold(frames, **fold)[:, 0]  # overlap-add: [B, 1, length]
        envelope = F.fold((self.window**2)[None, :, None].expand(1, -1, n), **fold)[:, 0]
        return (out / envelope.clamp_min(1e-8))[..., self.pad_each:length - self.pad_each]


class CompressedSpectralLoss(_Stft):
    """Mean L1 of the real and imaginary parts of two signals' compressed complex spectra."""

    def forward(self, recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(self.compressed(recon) - self.compressed(target)).abs().mean()


class StftEncoder(_Stft):
    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__(cfg)
        width = cfg.max_channels
        self.inp = nn.Conv1d(2 * self.bins, width, 1)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(width, 1 / max(cfg.stft_blocks, 1)) for _ in range(cfg.stft_blocks)])
        self.norm = nn.LayerNorm(width)
        self.out = nn.Conv1d(width, cfg.latent_dim, 1)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = self.compressed(wav)
        h = self.blocks(self.inp(torch.cat([spec.real, spec.imag], dim=1).to(wav.dtype)))
        return self.out(self.norm(h.transpose(1, 2)).transpose(1, 2))


class StftDecoder(_Stft):
    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__(cfg)
        width = cfg.max_channels
        self.inp = nn.Conv1d(cfg.latent_dim, width, 7, padding=3)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(width, 1 / max(cfg.stft_blocks, 1)) for _ in range(cfg.stft_blocks)])
        self.norm = nn.LayerNorm(width)
        self.out = nn.Conv1d(width, 2 * self.bins, 1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(latents))
        re, im = self.out(self.norm(h.transpose(1, 2)).transpose(1, 2)).float().chunk(2, dim=1)
        return self.synthesize(torch.complex(re, im))


class AudioTokenizer(nn.Module):
    """encode: [B, 1, T] at 16 kHz -> codes [B, frames, L]; decode: codes (first k levels) -> [B, 1, frames*hop]."""

    def __init__(self, cfg: AudioTokenizerConfig):
        super().__init__()
        from vector_quantize_pytorch import ResidualVQ

        cfg.validate()
        self.cfg = cfg
        self.encoder = StftEncoder(cfg) if cfg.arch == "stft" else Encoder(cfg)
        self.decoder = StftDecoder(cfg) if cfg.arch == "stft" else Decoder(cfg)
        self.quantizer = ResidualVQ(dim=cfg.latent_dim, num_quantizers=cfg.levels, codebook_size=cfg.codebook_size,
                                    codebook_dim=cfg.code_dim, quantize_dropout=cfg.quantizer_dropout,
                                    kmeans_init=True, threshold_ema_dead_code=cfg.dead_code, decay=0.99,
                                    commitment_weight=0.25)

    @property
    def levels(self) -> int:
        return self.cfg.levels

    @property
    def codebook_ready(self) -> bool:
        return all(bool(layer._codebook.initted) for layer in self.quantizer.layers)

    def pad(self, wav: torch.Tensor) -> torch.Tensor:
        """Zero-pad the time axis to whole frames."""
        extra = (-wav.shape[-1]) % self.cfg.hop
        return F.pad(wav, (0, extra)) if extra else wav

    def _check(self, wav: torch.Tensor) -> None:
        if wav.ndim != 3 or wav.shape[1] != 1:
            raise ValueError(f"audio must be [batch, 1, samples] (mono), got {tuple(wav.shape)}")

    def quantize(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quantized [B, D, F], codes [B, F, L], commitment loss)."""
        quantized, codes, losses = self.quantizer(latents.transpose(1, 2).float())
        return quantized.transpose(1, 2), codes.long(), losses.sum()

    def forward(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction [B, 1, T'], codes [B, F, L], commitment loss); T' = T padded to whole frames."""
        self._check(wav)
        quantized, codes, aux = self.quantize(self.encoder(self.pad(wav)))
        return self.decoder(quantized), codes, aux

    @torch.no_grad()
    def init_codebook(self, wav: torch.Tensor) -> None:
        """Initialize the RVQ codebooks from this audio (k-means), as the first training step would."""
        was_training, dropout = self.training, self.quantizer.quantize_dropout
        self.train()
        self.quantizer.quantize_dropout = False  # every level sees data
        try:
            self.quantize(self.encoder(self.pad(wav)))
        finally:
            self.quantizer.quantize_dropout = dropout
            self.train(was_training)

    @property
    def context_frames(self) -> int:
        """Frames of input on either side of a frame that can reach its latent: the encoder's
        receptive field (every convolution's span at its input's stride), in whole frames, plus one."""
        if isinstance(self.encoder, StftEncoder):  # a frame's window reaches (overlap - 1) / 2 hops out
            return 3 * len(self.encoder.blocks) + -(-(self.cfg.stft_overlap - 1) // 2) + 1
        span, jump = 0, 1
        for layer in self.encoder.modules():
            if isinstance(layer, nn.Conv1d):
                span += layer.dilation[0] * (layer.kernel_size[0] - 1) * jump
                jump *= layer.stride[0]
        return -(-span // self.cfg.hop) + 1

    def latents(self, wav: torch.Tensor) -> torch.Tensor:
        """Encoder output [B, D, frames] of audio padded to whole frames, computed window by window
        (`encode_window_seconds`) with `context_frames` of input on each side: the same values as one
        pass (to float rounding), with activations small enough to stay in cache."""
        wav = self.pad(wav)
        frames, window, halo, hop = wav.shape[-1] // self.cfg.hop, self.cfg.encode_window_frames, \
            self.context_frames, self.cfg.hop
        if not window or frames <= window + 2 * halo:
            return self.encoder(wav)
        out = []
        for f0 in range(0, frames, window):
            f1 = min(frames, f0 + window)
            a, b = max(0, f0 - halo), min(frames, f1 + halo)
            out.append(self.encoder(wav[..., a * hop:b * hop])[..., f0 - a:f1 - a])
        return torch.cat(out, dim=-1)

    def _require_codebook(self) -> None:
        if not self.codebook_ready:
            raise ValueError("this tokenizer's RVQ codebooks are not initialized: train it (or call init_codebook) first")

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """Codes [B, frames, L] of 16 kHz mono audio (padded to whole frames)."""
        self._check(wav)
        self._require_codebook()
        return self.quantize(self.latents(wav))[1]

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, levels: int | None = None) -> torch.Tensor:
        """Waveform [B, 1, frames*hop] from the first `levels` levels of `codes` [B, frames, >=levels]."""
        self._require_codebook()
        if codes.ndim != 3:
            raise ValueError(f"codes must be [batch, frames, levels], got {tuple(codes.shape)}")
        k = levels or codes.shape[2]
        if not 1 <= k <= min(codes.shape[2], self.levels):
            raise ValueError(f"levels must be 1..{min(codes.shape[2], self.levels)}, got {k}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.cfg.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.cfg.codebook_size})")
        latents = self.quantizer.get_output_from_indices(codes[..., :k])
        return self.decoder(latents.transpose(1, 2))


class MultiScaleMel(nn.Module):
    """Mean L1 distance of log-mel spectrograms at several resolutions (torchaudio)."""

    def __init__(self, sample_rate: int = 16_000, scales: tuple[int, ...] = (256, 512, 1024, 2048), n_mels: int = 64):
        super().__init__()
        from torchaudio.transforms import MelSpectrogram

        self.mels = nn.ModuleList(
            MelSpectrogram(sample_rate, n_fft=n, hop_length=n // 4, n_mels=min(n_mels, n // 8), power=1.0,
                           center=True) for n in scales
        )

    def forward(self, recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = recon.new_zeros(())
        for mel in self.mels:
            a, b = mel(recon.float()), mel(target.float())
            total = total + F.l1_loss(torch.log(a + 1e-5), torch.log(b + 1e-5))
        return total / len(self.mels)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
