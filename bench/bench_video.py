"""Video ingestion throughput: seconds of video per second through the ingestion job's video pool
(frames) and the audio pool's sound stage,
against decoding the same files with PyAV alone (every frame and the whole sound track, one
process): the floor any video ingestion pays before it tokenizes anything.

Clips: synthetic 320x240 at 25 fps with a spoken sound track (samples/video.py), H.264 + AAC in
MP4. The tokenizers have the default configurations (untrained weights cost the same to run).
The job runs the video pool and the sound stage on the audio pool as 1 or 2 actors each
(`--actors`), Ray started before timing. One clip is
also timed stage by stage in this process (sample frames, encode frames, decode sound, encode
sound), and the temporal stride (`ingest.video.min_change`) is measured on moving and still clips.

    .venv/bin/python bench/bench_video.py [--clips 12] [--seconds 8] [--actors 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenloom.catalog import CatalogConfig, TokenCatalog
from tokenloom.datasets.video import VideoConfig, read_sound, sample_frames
from tokenloom.platform.config import IngestConfig
from tokenloom.platform.ingest import ensure_ray, run_ingest
from tokenloom.samples.audio import speech_clips
from tokenloom.samples.text import write_sample_corpus
from tokenloom.samples.video import shapes_frames, write_clip
from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, encode_long
from tokenloom.tokenizers.audio import publish_bundle as publish_audio
from tokenloom.tokenizers.text import TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual
from tokenloom.tokenizers.vocab import manifest_from_bundles

SIZE, FPS = (320, 240), 25


def make_clips(folder: Path, n: int, seconds: float) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    speech = speech_clips("train", n)
    paths = []
    for i in range(n):
        wav, text = speech[i]
        sound = np.resize(wav, int(seconds * 16_000)).astype(np.float32)  # the sentence, repeated
        path = write_clip(folder / f"clip-{i:02d}.mp4", shapes_frames(seconds, seed=i, size=SIZE, fps=FPS), sound, fps=FPS)
        (folder / f"clip-{i:02d}.txt").write_text(text + "\n")
        paths.append(path)
    return paths


def peer(paths: list[Path]) -> float:
    """Seconds to decode every frame (to RGB) and the whole sound track of each file, PyAV alone."""
    import av

    t0 = time.perf_counter()
    for path in paths:
        with av.open(str(path)) as c:
            for frame in c.decode(c.streams.video[0]):
                frame.to_ndarray(format="rgb24")
        with av.open(str(path)) as c:
            for frame in c.decode(c.streams.audio[0]):
                frame.to_ndarray()
    return time.perf_counter() - t0


def stages(path: Path, visual: VisualTokenizer, audio: AudioTokenizer, cfg: VideoConfig) -> dict[str, float]:
    from tokenloom.tokenizers.visual import fit_to_budget, to_tensor
    from tokenloom.tokenizers.visual.model import resize_images

    out = {}
    t0 = time.perf_counter()
    frames = sample_frames(path, cfg)
    out["sample frames"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    size = fit_to_budget(frames.pixels.shape[1], frames.pixels.shape[2], cfg.max_frame_pixels, visual.cfg.factor)
    with torch.inference_mode():
        visual.encode(resize_images(torch.stack([to_tensor(p) for p in frames.pixels]), size))
    out["encode frames"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    blocks, _ = read_sound(path)
    blocks = list(blocks)
    out["decode sound"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        encode_long(audio, iter(blocks))
    out["encode sound"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clips", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--actors", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tl-bench-video-"))
    try:
        t0 = time.perf_counter()
        paths = make_clips(work / "clips", args.clips, args.seconds)
        print(f"{args.clips} clips x {args.seconds:g} s ({SIZE[0]}x{SIZE[1]} at {FPS} fps, H.264 + AAC): "
              f"{sum(p.stat().st_size for p in paths) / 1e6:.1f} MB, written in {time.perf_counter() - t0:.0f} s")
        text_corpus = write_sample_corpus(work / "text", max_bytes=200_000, with_bad_inputs=False)
        texts = (p.read_text() for p in sorted(text_corpus.rglob("*.txt")))
        text = train_text_tokenizer(texts, work / "bundles", TextTokenizerConfig(vocab_size=1024))
        visual = VisualTokenizer(VisualTokenizerConfig())
        visual.init_codebook(torch.rand(8, 3, 64, 64))
        audio = AudioTokenizer(AudioTokenizerConfig())
        audio.init_codebook(torch.randn(4, 1, 16_000) * 0.1)
        vb, ab = publish_visual(visual.eval(), work / "bundles"), publish_audio(audio.eval(), work / "bundles")
        bundles = {"text": text, "visual": vb, "audio": ab}
        vocab = manifest_from_bundles(bundles)
        video_cfg = VideoConfig()

        peer_s = peer(paths)
        seconds = args.clips * args.seconds
        per_stage = stages(paths[0], visual, audio, video_cfg)

        cfg = IngestConfig()
        cfg.ray.progress_bars = False
        for name in ("video", "audio"):  # frames on the video pool, the sound on the audio pool
            pool = cfg.pools[name]
            pool.min_actors = pool.max_actors = args.actors
            pool.task_below_bytes = 0  # an actor pool, as a large job runs
            pool.batch_size = 1
        ensure_ray(cfg)
        catalog = TokenCatalog(CatalogConfig(), work / "home")
        t0 = time.perf_counter()
        result = run_ingest([work / "clips"], "videos", catalog, vocab, {k: str(b.path) for k, b in bundles.items()},
                            cfg)
        job_s = time.perf_counter() - t0
        figures = result.pools["video"]
        sound = result.pools.get("video_sound")  # None before the sound moved to the audio pool

        still = write_clip(work / "still.mp4", np.repeat(shapes_frames(1 / FPS, size=SIZE, fps=FPS), int(args.seconds * FPS),
                                                         axis=0), None, fps=FPS)
        stride = {}
        for threshold in (0.001, 0.003, 0.01):
            strided = VideoConfig(min_change=threshold)
            moving = [sample_frames(p, strided) for p in paths[:4]]
            kept_still = sample_frames(still, strided)
            stride[threshold] = {"moving": [sum(len(f.times) for f in moving), sum(f.sampled for f in moving)],
                                 "still": [len(kept_still.times), kept_still.sampled]}

        print(f"peer: PyAV decode only (every frame to RGB + the sound track, 1 process): "
              f"{seconds / peer_s:.1f} s of video/s")
        print(f"job: {result.samples} samples, {result.tokens:,} tokens, {result.quarantined} quarantined, "
              f"{job_s:.1f} s wall: {seconds / job_s:.2f} s of video/s; video pool ({args.actors} actors): "
              f"{figures['seconds']:.1f} s, {seconds / figures['seconds']:.2f} s of video/s, busy "
              f"{figures['busy_fraction']}")
        if sound:
            print(f"sound stage on the audio pool ({args.actors} actors): {sound['seconds']:.1f} s, "
                  f"{seconds / sound['seconds']:.2f} s of video/s, busy {sound['busy_fraction']}")
        print(f"ratio job / peer: {peer_s / job_s:.3f}")
        total = sum(per_stage.values())
        print(f"one clip of {args.seconds:g} s in this process (1 thread): " + ", ".join(
            f"{k} {v:.2f} s ({v / total:.0%})" for k, v in per_stage.items()))
        for threshold, kept in stride.items():
            print(f"temporal stride min_change={threshold:g}: moving clips keep {kept['moving'][0]}/{kept['moving'][1]} "
                  f"sampled frames; a still clip keeps {kept['still'][0]}/{kept['still'][1]}")
        doc = {"clips": args.clips, "seconds": args.seconds, "actors": args.actors, "peer_video_s_per_s": seconds / peer_s,
               "job_video_s_per_s": seconds / job_s, "pool_video_s_per_s": seconds / figures["seconds"],
               "ratio": peer_s / job_s, "stages": per_stage, "pool": figures, "sound_pool": sound,
               "stride": stride}
        print(json.dumps(doc, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
