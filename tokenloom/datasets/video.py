"""Video files: check, sample frames and read the sound track (PyAV / FFmpeg), and write them back.

A video sample is frames at a fixed rate (default 2 per second) plus its sound track at 16 kHz
mono, never the whole decoded stream: `sample_frames` keeps the first decoded frame at or after
each sampling time, scaled down to a bounded size as FFmpeg converts it, so memory is the kept
frames only. Everything that can be bounded is bounded before any frame is decoded (`probe`:
the container opens, a video stream exists, the declared frame size and duration are sane);
what only decoding reveals (no frame at all, corrupt data) becomes a `VideoProblem` with a reason
fit for a quarantine record. A broken sound track does not lose the video: `read_sound` returns
no audio and a note saying why.

`write_video` is the other direction (a decoded sample back to an MP4 with H.264 and AAC), with
each frame at its own time, so a sample whose near-identical frames were dropped plays back with
the right timing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from tokenloom.contract import TIME_TICK_MS

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov")


class VideoProblem(Exception):
    """A reason to quarantine a video file."""


@dataclass
class VideoConfig:
    """`[ingest.video]`: how video files become samples."""

    fps: float = 2.0  # frames sampled per second of video
    max_frame_pixels: int = 64 * 48  # the visual tokenizer's pixel budget per frame (aspect kept)
    max_seconds: float = 600.0  # longer videos are quarantined (checked before decoding when declared)
    max_source_pixels: int = 8192 * 8192  # a declared frame size above this is quarantined unread
    min_side: int = 8  # smaller frames are quarantined
    # temporal stride: a sampled frame whose mean absolute pixel difference from the last kept one
    # (in [0, 1]) is below this is dropped as near-identical; 0 keeps every sampled frame
    min_change: float = 0.0

    def validate(self) -> None:
        if not 0 < self.fps <= 1000 / TIME_TICK_MS:
            raise ValueError(f"ingest.video.fps must be in (0, {1000 / TIME_TICK_MS:g}] (one frame per tick of the "
                             f"positions' clock), got {self.fps}")
        if self.max_seconds <= 0 or self.max_frame_pixels < 64 or self.max_source_pixels < self.max_frame_pixels:
            raise ValueError("ingest.video: need max_seconds > 0, max_frame_pixels >= 64 and "
                             "max_source_pixels >= max_frame_pixels")
        if not 0.0 <= self.min_change < 1.0:
            raise ValueError(f"ingest.video.min_change must be in [0, 1), got {self.min_change}")


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    seconds: float | None  # declared duration, None when the container does not say
    has_sound: bool


@dataclass(frozen=True)
class Frames:
    times: np.ndarray  # [K] int milliseconds of each kept frame
    pixels: np.ndarray  # [K, H, W, 3] uint8 RGB, one size for the whole video
    sampled: int  # frames taken at the sampling rate, before near-identical ones were dropped


def _open(path: str | Path):
    import av

    try:
        return av.open(str(path))
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise VideoProblem(f"unreadable container: {_message(exc)}") from None


def probe(path: str | Path, cfg: VideoConfig) -> VideoInfo:
    """Header facts of a video file, or VideoProblem; decodes nothing."""
    if Path(path).stat().st_size == 0:
        raise VideoProblem("empty file")
    with _open(path) as container:
        if not container.streams.video:
            raise VideoProblem("no video stream")
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if width * height > cfg.max_source_pixels or min(width, height) < cfg.min_side:
            raise VideoProblem(f"absurd frame size: {width}x{height} pixels (need {cfg.min_side} to "
                               f"{cfg.max_source_pixels} pixels per frame)")
        seconds = None
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000
        if seconds is not None and seconds > cfg.max_seconds:
            raise VideoProblem(f"absurd duration: {seconds:.1f} s (the limit is {cfg.max_seconds:g} s)")
        return VideoInfo(width, height, seconds, bool(container.streams.audio))


def frame_size(width: int, height: int, budget: int) -> tuple[int, int]:
    """The (width, height) a frame is converted to: aspect kept, at most 4x the tokenizer's pixel
    budget (it resizes into the budget itself), even sides for the video codecs."""
    scale = min(1.0, math.sqrt(4 * budget / (width * height)))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def sample_frames(path: str | Path, cfg: VideoConfig, info: VideoInfo | None = None) -> Frames:
    """The frames at `cfg.fps` (the first decoded frame at or after each sampling time), converted
    to RGB at `frame_size`; near-identical ones dropped when `cfg.min_change` > 0."""
    import av

    info = info or probe(path, cfg)
    width, height = frame_size(info.width, info.height, cfg.max_frame_pixels)
    times: list[int] = []
    kept: list[np.ndarray] = []
    sampled, next_time = 0, 0.0
    with _open(path) as container:
        stream = container.streams.video[0]
        try:
            for frame in container.decode(stream):
                if frame.pts is None or frame.time is None:
                    continue
                t = float(frame.time)
                if t > cfg.max_seconds:
                    raise VideoProblem(f"absurd duration: frames past the limit of {cfg.max_seconds:g} s")
                if t + 1e-6 < next_time or t < 0:
                    continue
                next_time = (math.floor(t * cfg.fps + 1e-6) + 1) / cfg.fps
                sampled += 1
                pixels = frame.to_ndarray(format="rgb24", width=width, height=height)
                if kept and cfg.min_change > 0 and _change(kept[-1], pixels) < cfg.min_change:
                    continue
                ms = round(t * 1000)
                if times and ms // TIME_TICK_MS <= times[-1] // TIME_TICK_MS:
                    continue  # one frame per tick of the positions' clock
                times.append(ms)
                kept.append(pixels)
        except av.error.FFmpegError as exc:
            raise VideoProblem(f"corrupt video data after {len(kept)} frame(s): {_message(exc)}") from None
    if not kept:
        raise VideoProblem("zero frames decoded")
    return Frames(np.array(times, dtype=np.int64), np.stack(kept), sampled)


def _change(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean()) / 255.0


def read_sound(path: str | Path, block_seconds: float = 30.0, rate: int = 16_000
               ) -> tuple[Iterator[np.ndarray] | None, str | None]:
    """The sound track as mono float32 blocks at `rate` (torchaudio resampling, as for audio files),
    or (None, None) without one. A track that cannot be decoded gives (None, note): the video is
    kept without sound. Checked whole before the blocks are handed out, so a failure part-way
    through never leaves half a track."""
    import av

    from tokenloom.datasets.audio import to_mono

    with _open(path) as container:
        if not container.streams.audio:
            return None, None
        stream = container.streams.audio[0]
        native = int(stream.codec_context.sample_rate or 0)
        if native <= 0:
            return None, "broken audio track: no sample rate; audio dropped"
        chunks: list[np.ndarray] = []
        try:
            for frame in container.decode(stream):
                samples = frame.to_ndarray()
                if samples.dtype.kind == "i":
                    samples = samples.astype(np.float32) / float(np.iinfo(samples.dtype).max)
                samples = samples.astype(np.float32, copy=False)
                if frame.format.is_planar or samples.shape[0] == len(frame.layout.channels) > 1:
                    samples = samples.reshape(len(frame.layout.channels), -1).T  # [T, channels]
                else:
                    samples = samples.reshape(-1, len(frame.layout.channels))
                chunks.append(samples.mean(axis=1))
        except av.error.FFmpegError as exc:
            return None, f"broken audio track: {_message(exc)}; audio dropped"
    if not chunks:
        return None, "broken audio track: no audio decoded; audio dropped"
    wav = np.concatenate(chunks)
    if not np.isfinite(wav).all():
        return None, "broken audio track: non-finite samples; audio dropped"
    np.clip(wav, -1.0, 1.0, out=wav)
    unit = native // math.gcd(native, rate)
    size = max(unit, round(block_seconds * native / unit) * unit)
    return (to_mono(wav[i:i + size], native, rate) for i in range(0, len(wav), size)), None


def interval_starts(times_ms: np.ndarray, audio_frames: int, frame_rate: float) -> np.ndarray:
    """Where each frame's sound interval starts among `audio_frames` frames at `frame_rate` Hz:
    interval k covers audio frames [starts[k], starts[k + 1]) (the last one to the end); the first
    always starts at 0, so no sound before the first frame is lost."""
    starts = np.minimum(np.round(np.asarray(times_ms) / 1000 * frame_rate).astype(np.int64), audio_frames)
    starts[0] = 0
    return np.maximum.accumulate(starts)


def write_video(path: str | Path, frames: np.ndarray, times_ms: np.ndarray, sound: np.ndarray | None = None,
                rate: int = 16_000, last_frame_ms: int | None = None) -> Path:
    """Frames [K, H, W, 3] uint8, each shown from its time, as H.264 in an MP4, with `sound`
    (mono float32 at `rate`) as AAC. The last frame lasts `last_frame_ms` (default: the median
    frame interval, or 500 ms for one frame)."""
    import av

    frames = np.asarray(frames)
    times = np.asarray(times_ms, dtype=np.int64)
    if frames.ndim != 4 or frames.shape[3] != 3 or len(frames) != len(times) or len(frames) == 0:
        raise ValueError(f"write_video needs frames [K, H, W, 3] and K times, got {frames.shape} and {times.shape}")
    if last_frame_ms is None:
        last_frame_ms = int(np.median(np.diff(times))) if len(times) > 1 else 500
    h, w = frames.shape[1] // 2 * 2, frames.shape[2] // 2 * 2
    path = Path(path)
    with av.open(str(path), mode="w", format="mp4") as out:
        video = out.add_stream("libx264", rate=1000)
        video.width, video.height, video.pix_fmt = w, h, "yuv420p"
        video.codec_context.time_base = Fraction(1, 1000)
        video.options = {"crf": "18", "preset": "veryfast"}
        audio = None
        if sound is not None and len(sound):
            audio = out.add_stream("aac", rate=rate)
            audio.layout = "mono"
        ends = np.r_[times[1:], times[-1] + last_frame_ms]
        for k, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels[:h, :w]), format="rgb24")
            frame.pts, frame.time_base = int(times[k]), Fraction(1, 1000)
            frame.duration = int(ends[k] - times[k])  # each frame shows until the next one's time
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        if audio is not None:
            pcm = np.asarray(sound, dtype=np.float32).reshape(1, -1)
            step = 1024
            for i in range(0, pcm.shape[1], step):
                block = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, i:i + step]), format="fltp",
                                                   layout="mono")
                block.sample_rate, block.pts = rate, i
                out.mux(audio.encode(block))
            out.mux(audio.encode(None))
    return path


def _message(exc: BaseException) -> str:
    text = str(getattr(exc, "strerror", None) or exc).strip()  # FFmpeg's own words, without errno and path
    return text.splitlines()[0] if text else type(exc).__name__
