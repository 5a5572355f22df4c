"""The one place that lays a sample out as unified tokens + segments, and reads it back.

Why one place: the layout is a contract (ARCHITECTURE.md, "Token shard") that the pool
workers write, sample decoding and generation read, and tests and benchmarks fabricate. Written
by hand in each of them with magic ids, the copies drift; here a sample is a list of *parts*
and the layout follows from one rule:

    <bos> part part ... <eos>
    text part   its BPE ids
    image part  <boi> h*w visual codes (raster order) <eoi>
    audio part  <boa> frames x L codes (frame-major: all levels of frame 0 first) <eoa>
    video part  <bov> [frame 0's h*w codes] [the audio frames from frame 0 to frame 1] ... <eov>

Specials and text are `text` segments (causal); adjacent text merges into one segment, so an
image segment is exactly its h*w codes (grid [h, w], bidirectional) and an audio segment
exactly its frames*L codes (grid [frames, L], window). A captioned image is
`[ImagePart, TextPart]`: `<bos><boi> codes <eoi> caption <eos>`. A video's frames are image
segments and its sound audio segments, back to back between `<bov>` and `<eov>`, each with its
time in milliseconds as a third grid entry ([h, w, ms], [frames, L, ms]): the "timed" segments
the stream lays out on one clock (`contract.TIME_TICK_MS`).

Parts hold *local* ids (a BPE id, a visual code, an RVQ code per level); the vocabulary
manifest's ranges turn them into unified ids and back. `disassemble(assemble(parts)) == parts`
for every normalized list of parts (no empty text part, no two text parts in a row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenloom.contract import DEFAULT_ATTENTION, MEDIA_DELIMITERS, VIDEO_DELIMITERS
from tokenloom.tokenizers.vocab import VocabManifest


@dataclass(frozen=True, eq=False)
class TextPart:
    ids: np.ndarray  # [n] local BPE ids

    def __eq__(self, other) -> bool:
        return isinstance(other, TextPart) and np.array_equal(self.ids, other.ids)


@dataclass(frozen=True, eq=False)
class ImagePart:
    codes: np.ndarray  # [h, w] local visual codes

    def __eq__(self, other) -> bool:
        return isinstance(other, ImagePart) and np.array_equal(self.codes, other.codes)


@dataclass(frozen=True, eq=False)
class AudioPart:
    codes: np.ndarray  # [frames, L] local RVQ codes, one column per level

    def __eq__(self, other) -> bool:
        return isinstance(other, AudioPart) and np.array_equal(self.codes, other.codes)


@dataclass(frozen=True, eq=False)
class VideoPart:
    """Frames and, optionally, their sound track: frame k at `times[k]` ms, followed by `audio[k]`,
    the audio frames from `audio_times[k]` ms up to the next interval (possibly none)."""

    frames: np.ndarray  # [K, h, w] local visual codes
    times: np.ndarray  # [K] int milliseconds from the video's start, increasing
    audio: tuple[np.ndarray, ...] = ()  # () without sound, else K arrays [n_k, L] of local RVQ codes
    audio_times: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [K] ms, with audio

    def __post_init__(self) -> None:
        frames, times = np.asarray(self.frames), np.asarray(self.times, dtype=np.int64)
        if frames.ndim != 3 or len(frames) == 0 or len(times) != len(frames):
            raise ValueError(f"a video part needs frames [K, h, w] and K times, got {frames.shape} and {times.shape}")
        if (np.diff(times) <= 0).any() or times[0] < 0:
            raise ValueError("video frame times must be >= 0 and increasing")
        if self.audio and (len(self.audio) != len(frames) or len(self.audio_times) != len(frames)):
            raise ValueError(f"a video part with sound needs K={len(frames)} audio intervals and their times")
        audio_times = np.asarray(self.audio_times, dtype=np.int64)
        if self.audio and not any(len(a) for a in self.audio):
            # a sound track without a single audio frame leaves no token: it is the same sample as
            # no sound track, and takes that one form (what `disassemble` gives back)
            object.__setattr__(self, "audio", ())
            audio_times = np.zeros(0, dtype=np.int64)
        if self.audio:  # an interval without audio frames has no time of its own: its frame's
            audio_times = np.where([len(a) > 0 for a in self.audio], audio_times, times)
        object.__setattr__(self, "times", times)
        object.__setattr__(self, "audio_times", audio_times)

    @property
    def audio_frames(self) -> int:
        return sum(len(a) for a in self.audio)

    def __eq__(self, other) -> bool:
        return (isinstance(other, VideoPart) and np.array_equal(self.frames, other.frames)
                and np.array_equal(self.times, other.times) and len(self.audio) == len(other.audio)
                and all(np.array_equal(a, b) for a, b in zip(self.audio, other.audio, strict=True))
                and (not self.audio or np.array_equal(self.audio_times, other.audio_times)))


Part = TextPart | ImagePart | AudioPart | VideoPart
MEDIA_PARTS: dict[type, str] = {ImagePart: "image", AudioPart: "audio"}


def segment(modality: str, start: int, length: int, grid: Sequence[int] = ()) -> dict:
    """One span of the shard contract's `segments` column."""
    return {"modality": modality, "start": int(start), "length": int(length), "grid": [int(g) for g in grid],
            "attention": DEFAULT_ATTENTION[modality]}


class SampleLayout:
    """Assembles and disassembles samples for one vocabulary manifest (offsets computed once)."""

    def __init__(self, vocab: VocabManifest):
        self.vocab = vocab
        self.bos, self.eos = vocab.bos_id, vocab.eos_id
        self.open = {m: vocab.specials[a] for m, (a, _) in MEDIA_DELIMITERS.items()}
        self.close = {m: vocab.specials[b] for m, (_, b) in MEDIA_DELIMITERS.items()}
        self.level_offsets = np.array([r.start for r in vocab.audio], dtype=np.int64)
        self.level_sizes = np.array([r.size for r in vocab.audio], dtype=np.int64)
        self.bov, self.eov = (vocab.specials.get(name) for name in VIDEO_DELIMITERS)

    # -- parts -> tokens ------------------------------------------------------------------
    def assemble(self, parts: Sequence[Part]) -> tuple[np.ndarray, list[dict]]:
        """Parts -> (int32 unified tokens, segments). Raises ValueError on ids outside their range."""
        pieces: list[np.ndarray] = [np.array([self.bos], dtype=np.int64)]
        segments: list[dict] = []
        text_start, cursor = 0, 1  # the open text segment starts at text_start

        def close_text(end: int) -> None:
            if end > text_start:
                segments.append(segment("text", text_start, end - text_start))

        for part in parts:
            if isinstance(part, TextPart):
                pieces.append(self._text_ids(part.ids))
                cursor += len(part.ids)
                continue
            if isinstance(part, VideoPart):
                if self.bov is None:
                    raise ValueError("this vocabulary manifest has no <bov>/<eov> specials: extend it for video")
                pieces.append(np.array([self.bov]))
                close_text(cursor + 1)
                cursor += 1
                for kind, codes, grid, ms in self._video_segments(part):
                    pieces.append(codes)
                    segments.append(segment(kind, cursor, len(codes), (*grid, ms)))
                    cursor += len(codes)
                pieces.append(np.array([self.eov]))
                text_start, cursor = cursor, cursor + 1
                continue
            modality = MEDIA_PARTS.get(type(part))
            if modality is None:
                raise TypeError("a sample part must be TextPart, ImagePart, AudioPart or VideoPart, got "
                                f"{type(part).__name__}")
            codes, grid = self._media_ids(modality, part.codes)
            pieces += [np.array([self.open[modality]]), codes, np.array([self.close[modality]])]
            close_text(cursor + 1)  # the open delimiter ends the text before the media
            segments.append(segment(modality, cursor + 1, len(codes), grid))
            cursor += len(codes) + 2
            text_start = cursor - 1  # the close delimiter starts the next text segment
        pieces.append(np.array([self.eos]))
        close_text(cursor + 1)
        return np.concatenate(pieces).astype(np.int32), segments

    def _video_segments(self, part: VideoPart):
        """(modality, unified ids, grid, ms) of a video's timed segments, in order."""
        for k, frame in enumerate(part.frames):
            codes, grid = self._media_ids("image", frame)
            yield "image", codes, grid, int(part.times[k])
            if part.audio and len(part.audio[k]):
                codes, grid = self._media_ids("audio", part.audio[k])
                yield "audio", codes, grid, int(part.audio_times[k])

    def _text_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab.text.size):
            raise ValueError(f"text ids must be in [0, {self.vocab.text.size}), got [{ids.min()}, {ids.max()}]")
        return ids + self.vocab.text.start

    def _media_ids(self, modality: str, codes: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        codes = np.asarray(codes, dtype=np.int64)
        if codes.ndim != 2 or codes.size == 0:
            raise ValueError(f"{modality} codes must be a non-empty 2-D grid, got shape {codes.shape}")
        if modality == "image":
            size = self.vocab.visual.size
            if codes.min() < 0 or codes.max() >= size:
                raise ValueError(f"visual codes must be in [0, {size}), got [{codes.min()}, {codes.max()}]")
            return codes.reshape(-1) + self.vocab.visual.start, codes.shape
        levels = codes.shape[1]
        if levels > len(self.level_offsets):
            raise ValueError(f"audio codes have {levels} levels; the manifest has {len(self.level_offsets)}")
        if codes.min() < 0 or (codes >= self.level_sizes[None, :levels]).any():
            raise ValueError(f"audio codes outside their level's codebook {self.level_sizes[:levels].tolist()}")
        return (codes + self.level_offsets[None, :levels]).reshape(-1), codes.shape

    # -- tokens -> parts ------------------------------------------------------------------
    def disassemble(self, tokens: Sequence[int] | np.ndarray, segments: Sequence[dict]) -> list[Part]:
        """(tokens, segments) of a shard row -> its parts; ValueError names what breaks the layout."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) < 2 or tokens[0] != self.bos or tokens[-1] != self.eos:
            raise ValueError("malformed sample: it must start with <bos> and end with <eos>")
        parts: list[Part] = []
        expect_close: str | None = None  # the media whose close delimiter must come next
        video: dict | None = None  # the video being read: its frames, times, audio intervals
        for k, seg in enumerate(segments):
            start, length, modality = int(seg["start"]), int(seg["length"]), seg["modality"]
            ids = tokens[start:start + length]
            if len(seg["grid"] or ()) >= 3:  # a timed segment: part of a video
                if video is None:
                    if expect_close is not None or start == 0 or tokens[start - 1] != self.bov:
                        raise ValueError(f"malformed sample: video segment {k} is not opened by <bov>")
                    video, expect_close = {"frames": [], "times": [], "audio": [], "audio_times": []}, "video"
                elif int(segments[k - 1]["start"]) + int(segments[k - 1]["length"]) != start:
                    raise ValueError(f"malformed sample: video segment {k} does not follow the one before it")
                self._video_segment(video, modality, ids, seg["grid"], k)
                continue
            if video is not None:
                parts.append(self._video_part(video))
                video = None
            if modality in self.open:
                if expect_close is not None or start == 0 or tokens[start - 1] != self.open[modality]:
                    raise ValueError(f"malformed sample: {modality} segment {k} is not opened by its delimiter")
                parts.append(self._media_part(modality, ids, seg["grid"]))
                expect_close = modality
                continue
            lo = 1 if k == 0 else 0
            hi = length - 1 if k == len(segments) - 1 else length
            if expect_close is not None:
                close = self.eov if expect_close == "video" else self.close[expect_close]
                if ids[0] != close:
                    raise ValueError(f"malformed sample: the {expect_close} segment before segment {k} is not closed")
                lo, expect_close = 1, None
            if k + 1 < len(segments) and (segments[k + 1]["modality"] in self.open
                                          or len(segments[k + 1]["grid"] or ()) >= 3):
                hi -= 1  # the next media's (or video's) open delimiter
            text = ids[lo:hi]
            if len(text):
                if not ((text >= self.vocab.text.start) & (text < self.vocab.text.stop)).all():
                    raise ValueError(f"malformed sample: text segment {k} holds ids outside the text range")
                if parts and isinstance(parts[-1], TextPart):
                    parts[-1] = TextPart(np.concatenate([parts[-1].ids, text - self.vocab.text.start]))
                else:
                    parts.append(TextPart(text - self.vocab.text.start))
        if expect_close is not None:
            raise ValueError(f"malformed sample: it ends inside a {expect_close} segment")
        return parts

    def _video_segment(self, video: dict, modality: str, ids: np.ndarray, grid: Sequence[int], k: int) -> None:
        part = self._media_part(modality, ids, grid[:2])
        if modality == "image":
            video["frames"].append(part.codes)
            video["times"].append(int(grid[2]))
            video["audio"].append(None)
            video["audio_times"].append(None)
        elif not video["frames"] or video["audio"][-1] is not None:
            raise ValueError(f"malformed sample: video audio segment {k} does not follow a frame")
        else:
            video["audio"][-1], video["audio_times"][-1] = part.codes, int(grid[2])

    @staticmethod
    def _video_part(video: dict) -> VideoPart:
        frames = video["frames"]
        if not frames or len({f.shape for f in frames}) != 1:
            raise ValueError("malformed sample: a video needs frames of one grid size")
        if all(a is None for a in video["audio"]):
            return VideoPart(np.stack(frames), np.array(video["times"]))
        levels = next(a.shape[1] for a in video["audio"] if a is not None)
        audio = tuple(a if a is not None else np.zeros((0, levels), dtype=np.int64) for a in video["audio"])
        times = [t if t is not None else video["times"][i] for i, t in enumerate(video["audio_times"])]
        return VideoPart(np.stack(frames), np.array(video["times"]), audio, np.array(times))

    def _media_part(self, modality: str, ids: np.ndarray, grid: Sequence[int]) -> Part:
        rows, cols = (int(g) for g in grid)
        if rows * cols != len(ids):
            raise ValueError(f"malformed sample: {modality} grid {list(grid)} does not match its {len(ids)} ids")
        if modality == "image":
            return ImagePart((ids - self.vocab.visual.start).reshape(rows, cols))
        return AudioPart(ids.reshape(rows, cols) - self.level_offsets[None, :cols])


def normalize(parts: Sequence[Part]) -> list[Part]:
    """Drop empty text parts and merge adjacent ones: the form `disassemble` returns."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, TextPart):
            if len(part.ids) == 0:
                continue
            if out and isinstance(out[-1], TextPart):
                out[-1] = TextPart(np.concatenate([out[-1].ids, part.ids]))
                continue
        out.append(part)
    return out
