"""Quality filters: which valid records a dataset does not want, and why.

A filter is a pure function of a record's *measures* (numbers computed once per record by the
`*_measures` functions below: length, alphanumeric share, pixel spread, silence, ...) and its
modality's parameters, returning a reason or None. Filters live in one registry with one
signature, so the pool workers run whatever is configured without knowing any filter, and a
record's first failing filter (registry order) names it in the job's `filtered/` side files.

Filtered records are valid input, not quarantine: a quarantined record is broken, a filtered
one is fine data that this dataset does not take. The defaults are permissive on purpose (they
drop what is plainly low quality: empty-ish text, line spam, flat images, silent or clipped
audio); a recipe tightens them. A bound of 0 switches that filter off.

Language identification is not here: no well-kept offline detector was adopted (see the
report of issue 14); it would be one more registry entry over a `language` measure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

SILENCE_WINDOW_SECONDS = 0.020  # silence is measured over 20 ms windows
CLIP_LEVEL = 0.999  # a sample at |x| >= this counts as clipped


@dataclass
class TextFilterConfig:
    min_chars: int = 8  # a word or two: no training signal
    max_chars: int = 0  # 0 = no upper bound
    min_tokens: int = 2
    max_tokens: int = 0
    min_alnum_fraction: float = 0.25  # letters and digits among non-space characters (code is ~0.6)
    max_repeated_line_fraction: float = 0.5  # share of characters in lines that repeat an earlier line


@dataclass
class ImageFilterConfig:
    min_side: int = 16  # of the decoded image, in pixels
    max_aspect_ratio: float = 8.0  # long side / short side
    min_pixel_std: float = 2.0  # std of the grey levels (0..255): below it the image is near-constant


@dataclass
class AudioFilterConfig:
    min_seconds: float = 0.25
    max_seconds: float = 0.0  # 0 = no upper bound
    silence_rms: float = 1e-3  # a 20 ms window below this RMS (-60 dBFS) is silent
    max_silence_fraction: float = 0.9
    max_clipping_fraction: float = 0.01  # share of samples at |x| >= 0.999


@dataclass
class FilterConfig:
    """`[ingest.filters]`: one parameter section per modality; `enabled=false` keeps everything."""

    enabled: bool = True
    text: TextFilterConfig = field(default_factory=TextFilterConfig)
    image: ImageFilterConfig = field(default_factory=ImageFilterConfig)
    audio: AudioFilterConfig = field(default_factory=AudioFilterConfig)

    def validate(self) -> None:
        t, i, a = self.text, self.image, self.audio
        if min(t.min_chars, t.max_chars, t.min_tokens, t.max_tokens, i.min_side) < 0:
            raise ValueError("ingest.filters: length and size bounds must be >= 0 (0 switches a bound off)")
        for key, value in (("text.min_alnum_fraction", t.min_alnum_fraction),
                           ("text.max_repeated_line_fraction", t.max_repeated_line_fraction),
                           ("audio.max_silence_fraction", a.max_silence_fraction),
                           ("audio.max_clipping_fraction", a.max_clipping_fraction)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"ingest.filters.{key} must be in [0, 1], got {value}")
        if i.max_aspect_ratio and i.max_aspect_ratio < 1.0:
            raise ValueError(f"ingest.filters.image.max_aspect_ratio must be >= 1 (or 0 = off), got {i.max_aspect_ratio}")
        if a.min_seconds < 0 or a.max_seconds < 0 or a.silence_rms < 0:
            raise ValueError("ingest.filters.audio: durations and silence_rms must be >= 0")


# -- measures: computed once per record, shared by every filter of its modality ---------------

def text_measures(text: str, num_tokens: int) -> dict[str, float]:
    """Length in characters and tokens, alphanumeric share, repeated-line share of `text`."""
    visible = len("".join(text.split()))  # C-level passes: no per-character bytecode
    alnum = sum(map(str.isalnum, text))
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    seen: Counter = Counter()
    repeated = 0
    for line in lines:
        if seen[line]:
            repeated += len(line)
        seen[line] += 1
    total = sum(len(line) for line in lines)
    return {"chars": float(len(text)), "tokens": float(num_tokens),
            "alnum_fraction": alnum / visible if visible else 0.0,
            "repeated_line_fraction": repeated / total if total else 0.0}


def image_measures(pixels: np.ndarray) -> dict[str, float]:
    """Size, aspect ratio and grey-level spread of an (H, W, 3) uint8 image."""
    h, w = int(pixels.shape[0]), int(pixels.shape[1])
    grey = pixels.astype(np.float32).mean(axis=-1) if pixels.ndim == 3 else pixels.astype(np.float32)
    return {"height": float(h), "width": float(w), "aspect_ratio": max(h, w) / max(1, min(h, w)),
            "pixel_std": float(grey.std())}


class AudioMeter:
    """Streaming audio measures: `tap` passes mono float32 blocks through unchanged while it
    counts duration, silent 20 ms windows and clipped samples, so a long file is measured in
    the same single pass that encodes it."""

    def __init__(self, sample_rate: int, silence_rms: float):
        self.rate = sample_rate
        self.window = max(1, round(sample_rate * SILENCE_WINDOW_SECONDS))
        self.silence_rms = silence_rms
        self.samples = 0
        self.clipped = 0
        self.windows = 0
        self.silent = 0
        self._pending = np.zeros(0, dtype=np.float32)

    def tap(self, blocks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for block in blocks:
            self.update(block)
            yield block

    def update(self, block: np.ndarray) -> None:
        block = np.asarray(block, dtype=np.float32)
        self.samples += block.size
        self.clipped += int(np.count_nonzero(np.abs(block) >= CLIP_LEVEL))
        data = np.concatenate([self._pending, block])
        whole = data.size // self.window * self.window
        self._count(data[:whole])
        self._pending = data[whole:]

    def _count(self, data: np.ndarray) -> None:
        if data.size:
            rms = np.sqrt(np.mean(np.square(data.reshape(-1, self.window), dtype=np.float64), axis=1))
            self.windows += rms.size
            self.silent += int(np.count_nonzero(rms < self.silence_rms))

    def measures(self) -> dict[str, float]:
        self._count(np.pad(self._pending, (0, self.window - self._pending.size)) if self._pending.size else self._pending)
        self._pending = np.zeros(0, dtype=np.float32)
        return {"seconds": self.samples / self.rate,
                "silence_fraction": self.silent / self.windows if self.windows else 1.0,
                "clipping_fraction": self.clipped / self.samples if self.samples else 0.0}


def audio_measures(samples: np.ndarray, sample_rate: int, silence_rms: float) -> dict[str, float]:
    """The measures of one whole mono recording (the streaming `AudioMeter` in one call)."""
    meter = AudioMeter(sample_rate, silence_rms)
    meter.update(samples)
    return meter.measures()


# -- the registry: name -> (modality, check(measures, params) -> reason or None) ---------------

Check = Callable[[Mapping[str, float], object], "str | None"]


def _min_chars(m, p: TextFilterConfig):
    return f"{m['chars']:.0f} characters < min_chars {p.min_chars}" if p.min_chars and m["chars"] < p.min_chars else None


def _max_chars(m, p: TextFilterConfig):
    return f"{m['chars']:.0f} characters > max_chars {p.max_chars}" if p.max_chars and m["chars"] > p.max_chars else None


def _min_tokens(m, p: TextFilterConfig):
    return (f"{m['tokens']:.0f} tokens < min_tokens {p.min_tokens}"
            if p.min_tokens and m["tokens"] < p.min_tokens else None)


def _max_tokens(m, p: TextFilterConfig):
    return (f"{m['tokens']:.0f} tokens > max_tokens {p.max_tokens}"
            if p.max_tokens and m["tokens"] > p.max_tokens else None)


def _alnum(m, p: TextFilterConfig):
    return (f"alphanumeric fraction {m['alnum_fraction']:.3f} < {p.min_alnum_fraction}"
            if m["alnum_fraction"] < p.min_alnum_fraction else None)


def _repeated_lines(m, p: TextFilterConfig):
    return (f"repeated-line fraction {m['repeated_line_fraction']:.3f} > {p.max_repeated_line_fraction}"
            if m["repeated_line_fraction"] > p.max_repeated_line_fraction else None)


def _min_side(m, p: ImageFilterConfig):
    side = min(m["height"], m["width"])
    return f"smallest side {side:.0f} px < min_side {p.min_side}" if p.min_side and side < p.min_side else None


def _aspect(m, p: ImageFilterConfig):
    return (f"aspect ratio {m['aspect_ratio']:.2f} > max_aspect_ratio {p.max_aspect_ratio}"
            if p.max_aspect_ratio and m["aspect_ratio"] > p.max_aspect_ratio else None)


def _constant(m, p: ImageFilterConfig):
    return (f"near-constant image: pixel std {m['pixel_std']:.2f} < min_pixel_std {p.min_pixel_std}"
            if m["pixel_std"] < p.min_pixel_std else None)


def _min_seconds(m, p: AudioFilterConfig):
    return (f"{m['seconds']:.3f} s < min_seconds {p.min_seconds}"
            if p.min_seconds and m["seconds"] < p.min_seconds else None)


def _max_seconds(m, p: AudioFilterConfig):
    return (f"{m['seconds']:.1f} s > max_seconds {p.max_seconds}"
            if p.max_seconds and m["seconds"] > p.max_seconds else None)


def _silence(m, p: AudioFilterConfig):
    return (f"silence fraction {m['silence_fraction']:.3f} > {p.max_silence_fraction} "
            f"(20 ms windows below RMS {p.silence_rms})" if m["silence_fraction"] > p.max_silence_fraction else None)


def _clipping(m, p: AudioFilterConfig):
    return (f"clipping fraction {m['clipping_fraction']:.4f} > {p.max_clipping_fraction} (|x| >= {CLIP_LEVEL})"
            if m["clipping_fraction"] > p.max_clipping_fraction else None)


FILTERS: dict[str, tuple[str, Check]] = {
    "text.min_chars": ("text", _min_chars),
    "text.max_chars": ("text", _max_chars),
    "text.min_tokens": ("text", _min_tokens),
    "text.max_tokens": ("text", _max_tokens),
    "text.alnum_fraction": ("text", _alnum),
    "text.repeated_lines": ("text", _repeated_lines),
    "image.min_side": ("image", _min_side),
    "image.aspect_ratio": ("image", _aspect),
    "image.near_constant": ("image", _constant),
    "audio.min_seconds": ("audio", _min_seconds),
    "audio.max_seconds": ("audio", _max_seconds),
    "audio.silence": ("audio", _silence),
    "audio.clipping": ("audio", _clipping),
}


def first_failure(modality: str, measures: Mapping[str, float], config: FilterConfig) -> tuple[str, str] | None:
    """(filter name, reason) of the first registered `modality` filter `measures` fail, or None."""
    if not config.enabled:
        return None
    params = getattr(config, modality)
    for name, (kind, check) in FILTERS.items():
        if kind == modality:
            reason = check(measures, params)
            if reason is not None:
                return name, reason
    return None


def from_dict(data: Mapping | None) -> FilterConfig:
    """A FilterConfig from its `dataclasses.asdict` form (how it travels to pool actors)."""
    if not data:
        return FilterConfig()
    return FilterConfig(bool(data.get("enabled", True)), TextFilterConfig(**data.get("text", {})),
                        ImageFilterConfig(**data.get("image", {})), AudioFilterConfig(**data.get("audio", {})))


__all__ = ["AudioFilterConfig", "AudioMeter", "FILTERS", "FilterConfig", "ImageFilterConfig", "TextFilterConfig",
           "audio_measures", "first_failure", "from_dict", "image_measures", "text_measures"]
