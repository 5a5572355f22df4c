"""Configuration of the RVQ audio tokenizer (no torch import: the run config reads it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass

# encoder strides per frame rate at 16 kHz: their product is the hop (samples per frame)
STRIDES = {50.0: (4, 4, 4, 5), 25.0: (4, 4, 5, 8), 12.5: (4, 5, 8, 8)}


@dataclass
class AudioTokenizerConfig:
    """Architecture, quantizer and training recipe of an audio tokenizer bundle."""

    sample_rate: int = 16_000  # every input is resampled to this and downmixed to mono
    # "conv": SEANet-style strided convolutions on the waveform (EnCodec/DAC); "stft": the codec works
    # on frames of a short-time Fourier transform (hop = one frame, window `stft_overlap` hops) with
    # ConvNeXt blocks at the frame rate and an inverse STFT out (FunCodec's frequency-domain codec,
    # Vocos' decoder): no full-rate convolutions (bench/RESULTS.md)
    arch: str = "conv"
    stft_overlap: int = 4  # stft: window and FFT size in hops (4: 1,280 samples, 641 bins at 50 fps)
    stft_compress: float = 0.3  # stft: magnitudes enter and leave as |X|^c (phase kept): power-law compression
    stft_blocks: int = 4  # stft: ConvNeXt blocks in the encoder and in the decoder
    frame_rate: float = 50.0  # frames per second: 50, 25 or 12.5
    channels: int = 16  # encoder width after the first convolution; doubles per stride
    max_channels: int = 256
    latent_dim: int = 128
    levels: int = 8  # RVQ levels L: codes per frame
    codebook_size: int = 1024
    code_dim: int = 8  # low-dimensional factorized codebook lookup per level
    quantizer_dropout: bool = True  # train with a random number of levels so any first-k decodes
    dead_code: int = 2  # codes whose EMA cluster size falls below this are re-seeded
    # training
    segment_seconds: float = 1.0
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    l1_weight: float = 1.0  # time-domain L1 (weights the waveform match SI-SDR measures)
    mel_weight: float = 1.0  # multi-scale log-mel distance
    # L1 between the power-law compressed complex spectra (the `stft_*` transform) of the decoded and
    # the original audio: real and imaginary parts, so phase is matched bin by bin (speech enhancement's
    # compressed spectral loss)
    spec_weight: float = 0.0
    sisdr_weight: float = 0.3  # negative SI-SDR (dB / 10) of segments with sound: teaches phase, which L1 + mel do not (bench/RESULTS.md)
    # EnCodec's loss balancer: the weights above (and the two below) become each loss's share of
    # the gradient at the decoded waveform, whatever the loss's scale (tokenizers/audio/adversarial.py)
    balancer: bool = False
    # moving average of each gradient norm (EnCodec: 0.999); 0 normalizes by this step's norm: the
    # SI-SDR gradient's norm swings 4-130 from step to step, and an average dominated by its peaks
    # left it a few percent of the gradient (bench/RESULTS.md)
    balancer_decay: float = 0.0
    # multi-scale STFT discriminator (EnCodec/DAC); off when both weights are 0
    adversarial_weight: float = 0.0  # hinge loss of the decoder against the discriminator
    feature_weight: float = 0.0  # feature matching on the discriminator's maps
    disc_channels: int = 16
    disc_scales: tuple[int, ...] = (1024, 512, 256)  # STFT sizes, hop a quarter of each
    disc_lr: float = 3e-4
    disc_seconds: float = 0.25  # the discriminator sees one random window this long of each segment (its cost on a CPU)
    steps: int = 1_000_000  # upper bound; max_minutes usually ends training first
    max_minutes: float = 10.0
    eval_every_s: float = 120.0
    checkpoint_every_s: float = 60.0
    eval_seconds: float = 4.0  # held-out clips are cut to at most this long
    seed: int = 0
    threads: int = 0
    # "auto": bf16 autocast on CUDA, and on a CPU where a probe step at the run's start is >= 1.2x
    # faster in bf16, else fp32 (tokenizers/loop.py choose_precision); "bf16" / "fp32" force it.
    # fp32 by default here: on an AMX Xeon bf16 made 16% more steps in 15 minutes, +1.1 dB SI-SDR on
    # speech but -1.5 dB on music (bench/RESULTS.md, one seed): not a clear gain
    precision: str = "fp32"
    bf16_autocast: bool = False  # older spelling of precision = "bf16" (true forces bf16)
    # ingestion
    chunk_seconds: float = 30.0  # long files are read and resampled this much at a time
    # the encoder runs over windows this long, with its receptive field of audio on each side (the
    # latents equal one pass's to float rounding): each activation stays small (8 s x 16 channels
    # = 8 MB), 1.7x the speed of one pass over a 49 s clip on one core (bench/bench_audio_encode.py,
    # bench/RESULTS.md); 0 encodes in one pass
    encode_window_seconds: float = 8.0

    def validate(self) -> None:
        if self.arch not in ("conv", "stft"):
            raise ValueError(f"audio_tokenizer.arch must be conv or stft, got {self.arch!r}")
        if self.stft_overlap < 1 or not 0 < self.stft_compress <= 1 or self.stft_blocks < 0:
            raise ValueError("audio_tokenizer.stft_overlap must be >= 1, stft_compress in (0, 1], stft_blocks >= 0")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"audio_tokenizer.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.frame_rate not in STRIDES:
            raise ValueError(f"audio_tokenizer.frame_rate must be one of {sorted(STRIDES)}, got {self.frame_rate}")
        if self.sample_rate != 16_000:
            raise ValueError(f"audio_tokenizer.sample_rate must be 16000 (the strides assume it), got {self.sample_rate}")
        if not 1 <= self.levels <= 32 or self.codebook_size < 2:
            raise ValueError("audio_tokenizer.levels must be 1..32 and codebook_size >= 2")
        if self.segment_seconds * self.frame_rate < 2 or self.chunk_seconds * self.frame_rate < 1:
            raise ValueError("audio_tokenizer.segment_seconds and chunk_seconds must hold whole frames")
        if self.encode_window_seconds < 0 or 0 < self.encode_window_seconds * self.frame_rate < 1:
            raise ValueError("audio_tokenizer.encode_window_seconds must be 0 (one pass) or hold at least one frame, "
                             f"got {self.encode_window_seconds}")
        if min(self.adversarial_weight, self.feature_weight, self.l1_weight, self.mel_weight, self.sisdr_weight,
               self.spec_weight) < 0:
            raise ValueError("audio_tokenizer loss weights must be non-negative")
        if self.balancer and not (self.l1_weight + self.mel_weight + self.sisdr_weight + self.spec_weight + self.adversarial_weight
                                  + self.feature_weight) > 0:
            raise ValueError("audio_tokenizer.balancer needs at least one positive loss weight")
        if not 0 <= self.balancer_decay < 1:
            raise ValueError(f"audio_tokenizer.balancer_decay must be in [0, 1), got {self.balancer_decay}")
        if any(n < 16 or n & (n - 1) for n in self.disc_scales) or not self.disc_scales:
            raise ValueError(f"audio_tokenizer.disc_scales must be powers of two >= 16, got {self.disc_scales}")
        if self.adversarial and not 0 < self.disc_seconds <= self.segment_seconds:
            raise ValueError("audio_tokenizer.disc_seconds must be positive and at most segment_seconds")
        for name in ("channels", "max_channels", "disc_channels"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"audio_tokenizer.{name} must be positive, got {value}")

    @property
    def adversarial(self) -> bool:
        return bool(self.adversarial_weight or self.feature_weight)

    @property
    def strides(self) -> tuple[int, ...]:
        return STRIDES[self.frame_rate]

    @property
    def hop(self) -> int:
        """Samples per frame."""
        out = 1
        for s in self.strides:
            out *= s
        return out

    @property
    def encode_window_frames(self) -> int:
        """Frames the encoder computes per window (0: the whole signal in one pass)."""
        return round(self.encode_window_seconds * self.frame_rate)

    def bitrate(self, levels: int | None = None) -> float:
        """Bits per second with the first `levels` levels (all by default)."""
        import math

        return self.frame_rate * (levels or self.levels) * math.log2(self.codebook_size)
