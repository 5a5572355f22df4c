"""Audio files: open, check and read in bounded blocks (soundfile / libsndfile).

Audio is never loaded whole: `read_blocks` yields fixed-length blocks so an hours-long file
costs the memory of one block. Problems become `AudioProblem(reason)` with a reason fit for a
quarantine record: unreadable or truncated files, zero-length audio, sample rates out of
range, NaN or infinite samples. Float samples beyond +-1 are clamped (clipping is kept: it is
valid audio); channels are downmixed and rates resampled by the tokenizer, not here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
MIN_RATE, MAX_RATE = 8_000, 192_000


class AudioProblem(Exception):
    """A reason to quarantine an audio file."""


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    channels: int
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def probe(path: str | Path) -> AudioInfo:
    """Header facts of an audio file, or AudioProblem."""
    import soundfile as sf

    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise AudioProblem("empty file")
        info = sf.info(str(path))
    except AudioProblem:
        raise
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise AudioProblem(f"unreadable audio: {_message(exc)}") from None
    if info.frames <= 0:
        raise AudioProblem("zero-length audio")
    if not MIN_RATE <= info.samplerate <= MAX_RATE:
        raise AudioProblem(f"sample rate {info.samplerate} Hz outside {MIN_RATE}..{MAX_RATE} Hz")
    if info.channels < 1:
        raise AudioProblem("no audio channels")
    return AudioInfo(int(info.samplerate), int(info.channels), int(info.frames))


def read_blocks(path: str | Path, seconds: float, target_rate: int = 16_000) -> Iterator[np.ndarray]:
    """float32 blocks [T, channels] of about `seconds` each, checked for NaN/inf. Block lengths
    are whole multiples of `rate / gcd(rate, target_rate)` samples, so that resampling block by
    block to `target_rate` gives whole samples per block and no drift."""
    import math

    import soundfile as sf

    info = probe(path)
    unit = info.sample_rate // math.gcd(info.sample_rate, target_rate)
    size = max(unit, round(seconds * info.sample_rate / unit) * unit)
    read = 0
    try:
        with sf.SoundFile(str(path)) as f:
            while True:
                block = f.read(size, dtype="float32", always_2d=True)
                if not len(block):
                    break
                bad = ~np.isfinite(block)
                if bad.any():
                    at = (read + int(np.argwhere(bad)[0][0])) / info.sample_rate
                    raise AudioProblem(f"non-finite samples (NaN or infinity): first at {at:.3f} s")
                np.clip(block, -1.0, 1.0, out=block)
                read += len(block)
                yield block
    except (sf.LibsndfileError, RuntimeError) as exc:
        raise AudioProblem(f"unreadable audio: {_message(exc)}") from None
    if read == 0:
        raise AudioProblem("zero-length audio")


def to_mono(samples: np.ndarray, sample_rate: int, target: int = 16_000) -> np.ndarray:
    """[T] or [T, channels] float audio -> mono float32 [T'] at `target` Hz (torchaudio resampling)."""
    import torch
    import torchaudio.functional as AF

    wav = torch.as_tensor(np.asarray(samples, dtype=np.float32))
    if wav.ndim == 2:
        wav = wav.mean(dim=1)
    if wav.ndim != 1:
        raise ValueError(f"audio must be [samples] or [samples, channels], got {tuple(wav.shape)}")
    if sample_rate != target:
        wav = AF.resample(wav, sample_rate, target)
    return wav.numpy()


def read_mono(path: str | Path, seconds: float, target_rate: int = 16_000) -> Iterator[np.ndarray]:
    """`read_blocks` downmixed and resampled: mono float32 blocks at `target_rate`, in order."""
    info = probe(path)
    for block in read_blocks(path, seconds, target_rate):
        yield to_mono(block, info.sample_rate, target_rate)


def _message(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
