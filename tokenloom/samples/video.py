"""Sample videos: short synthetic clips with a spoken sound track, made offline, plus broken ones.

Two kinds of picture, both moving so that frames differ: coloured shapes gliding over a gradient,
and a window panning across one of the sample photos; the sound track is speech from the sample
synthesizer (eSpeak NG), its transcript the caption. Written with PyAV in the containers the
ingestion job routes (.mp4 with H.264 + AAC, .webm with VP9 + Opus, .mkv with FLAC, .mov without
sound), with caption sidecars and a pairs file. `write_bad_videos` makes the files a job must
quarantine (and one whose sound track is broken, kept without its audio).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np

CLIP_SIZE = (96, 64)  # width, height of the synthetic clips
CLIP_FPS = 10


def shapes_frames(seconds: float, seed: int = 0, size: tuple[int, int] = CLIP_SIZE, fps: int = CLIP_FPS) -> np.ndarray:
    """[T, H, W, 3] uint8: two coloured shapes gliding over a gradient."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // w, yy * 255 // h, np.full_like(xx, 96 + 40 * (seed % 3))], axis=-1).astype(np.uint8)
    colours = rng.integers(40, 255, (2, 3))
    start, velocity = rng.uniform(0, 1, (2, 2)), rng.uniform(-0.4, 0.4, (2, 2))
    frames = []
    for k in range(int(seconds * fps)):
        img = base.copy()
        for s in range(2):
            cx, cy = ((start[s] + velocity[s] * k / fps) % 1.0) * (w, h)
            if s == 0:  # a square
                mask = (np.abs(xx - cx) < 10) & (np.abs(yy - cy) < 10)
            else:  # a disc
                mask = (xx - cx) ** 2 + (yy - cy) ** 2 < 12 ** 2
            img[mask] = colours[s]
        frames.append(img)
    return np.stack(frames)


def pan_frames(photo: np.ndarray, seconds: float, size: tuple[int, int] = CLIP_SIZE, fps: int = CLIP_FPS) -> np.ndarray:
    """[T, H, W, 3] uint8: a window of `size` panning left to right across `photo` (scaled to 2x its height)."""
    from PIL import Image

    w, h = size
    scale = 2 * h / photo.shape[0]
    big = np.asarray(Image.fromarray(photo).resize((max(w + 1, int(photo.shape[1] * scale)), 2 * h)))
    n = int(seconds * fps)
    xs = np.linspace(0, big.shape[1] - w, n).astype(int)
    ys = np.linspace(0, h, n).astype(int)
    return np.stack([big[y:y + h, x:x + w] for x, y in zip(xs, ys, strict=True)])


def write_clip(path: Path, frames: np.ndarray, sound: np.ndarray | None, fps: int = CLIP_FPS,
               rate: int = 16_000) -> Path:
    """Frames at `fps` and mono float32 `sound` at `rate` into `path`; codecs by its suffix."""
    import av

    codecs = {".mp4": ("libx264", "aac", "yuv420p"), ".mov": ("libx264", "aac", "yuv420p"),
              ".webm": ("libvpx-vp9", "libopus", "yuv420p"), ".mkv": ("mpeg4", "flac", "yuv420p")}
    vcodec, acodec, pix = codecs[path.suffix.lower()]
    if acodec == "libopus":
        rate_out = 48_000  # Opus encodes at 48 kHz only
        sound = None if sound is None else np.interp(np.arange(int(len(sound) * 3)) / 3, np.arange(len(sound)),
                                                     sound).astype(np.float32)
    else:
        rate_out = rate
    with av.open(str(path), mode="w") as out:
        video = out.add_stream(vcodec, rate=fps)
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], pix
        if vcodec == "libx264":
            video.options = {"crf": "20", "preset": "veryfast"}
        else:
            video.bit_rate = 2_000_000
        audio = None
        if sound is not None:
            audio = out.add_stream(acodec, rate=rate_out)
            audio.layout = "mono"
        for k, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame.pts, frame.time_base = k, Fraction(1, fps)
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        if audio is not None:
            fmt = "s16" if acodec == "flac" else "fltp"
            pcm = np.asarray(sound, dtype=np.float32).reshape(1, -1)
            if fmt == "s16":
                pcm = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
            step = 960 if acodec == "libopus" else 1024
            for i in range(0, pcm.shape[1], step):
                block = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, i:i + step]), format=fmt, layout="mono")
                block.sample_rate, block.pts = rate_out, i
                out.mux(audio.encode(block))
            out.mux(audio.encode(None))
    return path


def write_sample_videos(out_dir: Path, with_bad_inputs: bool = True, clips: int = 4) -> Path:
    """Write captioned clips under `out_dir` (idempotent); return it. `clip-N.{mp4,webm,mkv,mov}`
    with `clip-N.txt` captions (the spoken sentence; the .mov has no sound), `videos.jsonl` pairs
    `{"video": ..., "text": ...}` for one more in `paired/`; with `with_bad_inputs`, `bad/`."""
    from tokenloom.samples.audio import speech_clips
    from tokenloom.samples.images import sample_photos

    out_dir = Path(out_dir)
    done = out_dir / ".complete.json"
    settings = {"with_bad_inputs": with_bad_inputs, "clips": clips, "layout": 1}
    if done.exists() and json.loads(done.read_text()) == settings:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    speech = speech_clips("train", clips + 1)
    photos = list(sample_photos("train").values())
    suffixes = (".mp4", ".webm", ".mkv", ".mov")
    for i in range(clips + 1):
        wav, text = speech[i]
        seconds = min(4.0, max(1.0, len(wav) / 16_000))
        wav = wav[: int(seconds * 16_000)]
        frames = shapes_frames(seconds, seed=i) if i % 2 == 0 else pan_frames(photos[i % len(photos)], seconds)
        if i == clips:  # the paired clip
            (out_dir / "paired").mkdir(exist_ok=True)
            write_clip(out_dir / "paired" / "clip-paired.mp4", frames, wav)
            (out_dir / "videos.jsonl").write_text(json.dumps({"video": "paired/clip-paired.mp4", "text": text}) + "\n")
            continue
        suffix = suffixes[i % len(suffixes)]
        write_clip(out_dir / f"clip-{i}{suffix}", frames, None if suffix == ".mov" else wav)
        caption = text if suffix != ".mov" else "Shapes and colours move across the picture without a sound."
        (out_dir / f"clip-{i}.txt").write_text(caption + "\n")
    if with_bad_inputs:
        write_bad_videos(out_dir / "bad")
    done.write_text(json.dumps(settings))
    return out_dir


def write_bad_videos(bad_dir: Path) -> dict[str, str]:
    """Files a job must quarantine, name -> start of the reason; and `broken-sound.mkv`, a good
    video whose sound track does not decode (kept, without audio)."""
    import av

    bad_dir.mkdir(parents=True, exist_ok=True)
    good = write_clip(bad_dir / ".whole.mp4", shapes_frames(1.0, seed=9), np.zeros(16_000, np.float32))
    data = good.read_bytes()
    (bad_dir / "truncated.mp4").write_bytes(data[:200])
    (bad_dir / "not-a-video.webm").write_text("this is a text file with a video extension\n")
    (bad_dir / "empty.mov").write_bytes(b"")
    # sound only: a container without a video stream
    with av.open(str(bad_dir / "sound-only.mp4"), mode="w") as out:
        audio = out.add_stream("aac", rate=16_000)
        audio.layout = "mono"
        block = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        block.sample_rate, block.pts = 16_000, 0
        out.mux(audio.encode(block))
        out.mux(audio.encode(None))
    write_clip(bad_dir / "tiny-frames.mp4", np.zeros((5, 4, 4, 3), np.uint8), None)  # 4x4 pixels
    # a video stream whose packets decode to no frame: an H.264 stream without its key frame
    with av.open(str(good)) as source, av.open(str(bad_dir / "no-frames.mp4"), mode="w") as out:
        stream = source.streams.video[0]
        copy = out.add_stream_from_template(stream)
        for packet in source.demux(stream):
            if packet.dts is not None and not packet.is_keyframe:
                packet.stream = copy
                out.mux(packet)
    good.unlink()
    # a good picture whose FLAC sound track is garbage bytes
    with av.open(str(bad_dir / "broken-sound.mkv"), mode="w") as out:
        video = out.add_stream("mpeg4", rate=CLIP_FPS)
        video.width, video.height, video.pix_fmt = CLIP_SIZE[0], CLIP_SIZE[1], "yuv420p"
        audio = out.add_stream("flac", rate=16_000)
        audio.layout = "mono"
        for k, pixels in enumerate(shapes_frames(1.0, seed=7)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = k, Fraction(1, CLIP_FPS)
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        rng = np.random.default_rng(0)
        for i in range(8):
            packet = av.Packet(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
            packet.stream, packet.pts, packet.dts, packet.time_base = audio, i * 1024, i * 1024, Fraction(1, 16_000)
            out.mux(packet)
    return {"truncated.mp4": "unreadable container", "not-a-video.webm": "unreadable container",
            "empty.mov": "empty file", "sound-only.mp4": "no video stream", "tiny-frames.mp4": "absurd frame size",
            "no-frames.mp4": "zero frames decoded"}
