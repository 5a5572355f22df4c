"""Video as frames and their sound track: the layout, positions and masks of a video sample, and
video files through the ingestion job (PyAV decoding, quarantine, decode back to an MP4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.contract import TIME_TICK_MS
from tokenloom.datasets.layout import ROW_ID, sample_positions
from tokenloom.datasets.video import (
    VideoConfig,
    VideoProblem,
    frame_size,
    interval_starts,
    probe,
    read_sound,
    sample_frames,
    write_video,
)
from tokenloom.tokenizers.sequence import ImagePart, SampleLayout, TextPart, VideoPart
from tokenloom.tokenizers.vocab import VocabManifest

MANIFEST = VocabManifest.build(100, visual_size=50, audio_levels=2, audio_codebook=10)
LAYOUT = SampleLayout(MANIFEST)


@st.composite
def videos(draw):
    k = draw(st.integers(1, 5))
    h, w = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    # frames on distinct ticks of the clock (sample_frames keeps no two frames on one tick)
    times = (np.cumsum(rng.integers(1, 45, k)) - 1) * TIME_TICK_MS + rng.integers(0, TIME_TICK_MS, k)
    frames = rng.integers(0, 50, (k, h, w))
    if not draw(st.booleans()):
        return VideoPart(frames, times)
    audio = tuple(rng.integers(0, 10, (int(rng.integers(0, 30)), 2)) for _ in range(k))
    return VideoPart(frames, times, audio, times + rng.integers(0, 40, k))


@given(st.lists(st.one_of(videos(), st.builds(lambda n: TextPart(np.arange(n) % 100), st.integers(1, 5)),
                          st.builds(lambda n: ImagePart(np.ones((2, n), int)), st.integers(1, 3))), max_size=4))
@settings(max_examples=60, deadline=None)
def test_video_parts_round_trip(parts):
    from tokenloom.tokenizers.sequence import normalize

    parts = normalize(parts)
    tokens, segments = LAYOUT.assemble(parts)
    assert LAYOUT.disassemble(tokens, segments) == parts
    timed = [s for s in segments if len(s["grid"]) == 3]
    for video in (p for p in parts if isinstance(p, VideoPart)):
        assert sum(s["modality"] == "image" for s in timed) >= len(video.frames)


def test_a_sound_track_without_audio_frames_is_no_sound_track():
    # found by the property test above: such a track leaves no token, so it takes the silent form
    silent = VideoPart(np.full((1, 1, 1), 7), np.array([3]), (np.zeros((0, 2), int),), np.array([3]))
    assert silent.audio == () and len(silent.audio_times) == 0
    assert silent == VideoPart(np.full((1, 1, 1), 7), np.array([3]))
    assert LAYOUT.disassemble(*LAYOUT.assemble([silent])) == [silent]
    sound = VideoPart(np.zeros((2, 1, 1), int), np.array([0, 500]), (np.zeros((0, 2), int), np.ones((3, 2), int)),
                      np.array([0, 510]))
    assert len(sound.audio) == 2 and list(sound.audio_times) == [0, 510], "one interval with frames keeps the track"
    assert LAYOUT.disassemble(*LAYOUT.assemble([sound])) == [sound]


def test_a_video_is_delimited_and_its_segments_carry_their_time():
    v = VideoPart(np.zeros((2, 2, 3), int), np.array([0, 500]), (np.ones((25, 2), int), np.ones((10, 2), int)),
                  np.array([0, 500]))
    tokens, segments = LAYOUT.assemble([v, TextPart(np.array([7, 8]))])
    assert tokens[1] == MANIFEST.specials["<bov>"]
    assert [(s["modality"], s["grid"]) for s in segments] == [
        ("text", []), ("image", [2, 3, 0]), ("audio", [25, 2, 0]), ("image", [2, 3, 500]), ("audio", [10, 2, 500]),
        ("text", [])]
    assert tokens[segments[-1]["start"]] == MANIFEST.specials["<eov>"]
    from tokenloom.catalog.schema import modality_mix

    assert modality_mix(segments) == "audio+image+text+video"


def test_old_manifests_gain_the_video_specials_without_moving_an_id():
    old = VocabManifest.build(100, visual_size=50)
    pinned = VocabManifest(old.text, old.visual, old.audio, {k: v for k, v in old.specials.items()
                                                               if k not in ("<bov>", "<eov>")}, old.bundles)
    assert pinned.is_prefix_of(old) and not old.is_prefix_of(pinned)
    extended = pinned.extend({})
    assert extended.specials == old.specials and extended.ranges() == pinned.ranges()
    with pytest.raises(ValueError, match="no <bov>"):
        SampleLayout(pinned).assemble([VideoPart(np.zeros((1, 1, 1), int), np.array([0]))])


def _expected_coords(video: VideoPart, base: int) -> list[tuple[int, int, int]]:
    """The video rule written out position by position: frame k's start row and rows at
    (base + tick_k, base + r, base + c), audio frame j of interval k at base + tick + j."""
    out = []
    h, w = video.frames.shape[1:]
    for k in range(len(video.frames)):
        tick = int(video.times[k]) // TIME_TICK_MS
        out += [(base + tick, base + r, base + c) for r in range(h + 1) for c in range(w)]
        if video.audio and len(video.audio[k]):
            t0 = int(video.audio_times[k]) // TIME_TICK_MS
            out += [(base + t0 + j,) * 3 for j in range(len(video.audio[k]))]
    return out


@given(videos(), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_video_positions_follow_the_clock(video, prefix):
    tokens, segments = LAYOUT.assemble([TextPart(np.arange(prefix)), video, TextPart(np.array([3, 4]))])
    pos = sample_positions(tokens, segments, group_size=2, audio_window=64)
    base = 1 + prefix + 1  # <bos>, the prefix, <bov>
    n = len(_expected_coords(video, base))
    got = [tuple(c) for c in pos.coords[base : base + n].tolist()]
    assert got == _expected_coords(video, base)
    # t increases from frame to frame
    starts = np.flatnonzero(pos.ids[base:base + n, 0] == ROW_ID)  # w start-row positions per frame
    frame_t = pos.coords[base + starts, 0][:: video.frames.shape[2]]
    assert len(frame_t) == len(video.frames) and (np.diff(frame_t) > 0).all()
    # what follows the video starts one past its largest coordinate, then counts on
    after = pos.coords[base + n :, 0]
    assert after[0] == max(max(c) for c in got) + 1 and (np.diff(after) == 1).all()


@given(videos())
@settings(max_examples=40, deadline=None)
def test_video_masks_are_block_causal_frames_and_windowed_sound(video):
    """The FlashMask intervals the kernels build from a video sample's columns allow exactly the
    rule written out: a frame row sees itself whole and everything before it, never a later row; an
    audio frame sees what precedes its interval and the last `window` frames of it; text is causal."""
    from tokenloom.kernels import dense_allowed_mask, mask_from_columns

    tokens, segments = LAYOUT.assemble([TextPart(np.array([1, 2])), video, TextPart(np.array([5, 6, 7]))])
    window = 32  # longer than any interval: a longer one ends its row (Positions.ends_row)
    pos = sample_positions(tokens, segments, group_size=2, audio_window=window)
    assert not pos.ends_row
    columns = [torch.from_numpy(np.asarray(a, dtype=np.int64))[None] for a in (pos.segment, pos.attention, pos.window)]
    idx = mask_from_columns(columns[0], torch.zeros_like(columns[0]), columns[1], columns[2])
    P = len(pos)
    got = dense_allowed_mask(idx, causal=False, seq_q=P)[0, 0].numpy()
    expected = np.tril(np.ones((P, P), dtype=bool))
    seg = pos.segment
    for q in range(P):
        own = np.flatnonzero(seg == seg[q])
        if pos.attention[q] == 1:  # bidirectional: the whole row (an image row or its start row)
            expected[q, own] = True
        if pos.window[q]:
            expected[q, own[own <= q - window]] = False
    assert np.array_equal(got, expected)
    # rows of a frame are block-causal: no position of a frame sees a later row of it
    rows = np.flatnonzero(pos.modality == 1)
    for q in rows:
        assert not got[q, rows[(rows > q) & (seg[rows] != seg[q])]].any()


def test_a_long_sound_interval_ends_its_row():
    video = VideoPart(np.zeros((2, 1, 2), int), np.array([0, 2000]), (np.zeros((100, 2), int), np.zeros((3, 2), int)),
                      np.array([0, 2000]))
    tokens, segments = LAYOUT.assemble([video, TextPart(np.array([5]))])
    assert sample_positions(tokens, segments, group_size=2, audio_window=64).ends_row


# -- video files through the ingestion job --------------------------------------------------------


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from tokenloom.samples.video import write_sample_videos

    return write_sample_videos(tmp_path_factory.mktemp("videos") / "videos", with_bad_inputs=True, clips=4)


def test_probe_bounds_before_decoding(clips):
    cfg = VideoConfig(max_seconds=2.0)
    with pytest.raises(VideoProblem, match="absurd duration"):
        probe(clips / "clip-0.mp4", cfg)
    with pytest.raises(VideoProblem, match="absurd frame size: 96x64"):
        probe(clips / "clip-0.mp4", VideoConfig(max_source_pixels=4000, max_frame_pixels=1000))


def test_frames_are_sampled_at_the_rate_and_the_stride_drops_still_frames(tmp_path):
    from tokenloom.samples.video import shapes_frames, write_clip

    moving = shapes_frames(3.0, seed=1)
    still = np.repeat(moving[:1], len(moving), axis=0)
    a = write_clip(tmp_path / "moving.mp4", moving, None)
    b = write_clip(tmp_path / "still.mp4", still, None)
    cfg = VideoConfig(fps=2.0)
    assert sample_frames(a, cfg).times.tolist() == [0, 500, 1000, 1500, 2000, 2500]
    strided = VideoConfig(fps=2.0, min_change=0.01)
    assert len(sample_frames(a, strided).times) == 6
    kept = sample_frames(b, strided)
    assert kept.times.tolist() == [0] and kept.sampled == 6


def test_sound_intervals_follow_the_frames():
    assert interval_starts(np.array([0, 500, 1000]), 120, 50.0).tolist() == [0, 25, 50]
    assert interval_starts(np.array([30, 500, 4000]), 120, 50.0).tolist() == [0, 25, 120]


def test_the_two_video_stages_give_the_sample_of_one_pass(clips, text_bundle, tmp_path):
    """Frames on the video pool, sound on the audio pool (`VideoPoolWorker` then `VideoSoundPoolWorker`,
    called in-process on one batch): the sample is the one a single pass gives (visual codes of
    the sampled frames, `encode_long` of the decoded track split at the frame times), a file the
    first stage rejects keeps its reason through the second, and the second stage says where each
    stage ran."""
    import pyarrow as pa

    from tokenloom.platform.ingest import RECORD_SCHEMA
    from tokenloom.platform.workers import VideoPoolWorker, VideoSoundPoolWorker
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, encode_long
    from tokenloom.tokenizers.audio import publish_bundle as publish_audio
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig, fit_to_budget, to_tensor
    from tokenloom.tokenizers.visual.model import resize_images
    from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual

    torch.manual_seed(0)
    visual = VisualTokenizer(VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                   vit_heads=2, fusion_heads=2, image_size=32, max_pixels=32 * 32))
    # 1,024 vectors for 512 codes: k-means from fewer vectors samples duplicate codes, whose equal
    # distances let the batch size decide the code (the worker's batch against this test's)
    visual.init_codebook(torch.rand(64, 3, 32, 32))
    audio = AudioTokenizer(AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=2,
                                                codebook_size=32, code_dim=4, chunk_seconds=1.0))
    audio.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    store = tmp_path / "bundles"
    paths = {"text": str(text_bundle.path), "visual": str(publish_visual(visual.eval(), store).path),
             "audio": str(publish_audio(audio.eval(), store).path)}
    from tokenloom.tokenizers.text import TextTokenizer

    manifest = VocabManifest.build(TextTokenizer.load(paths["text"]).vocab_size, visual_size=visual.num_codes,
                                   audio_levels=2, audio_codebook=32)
    video = VideoConfig()
    clip, caption = clips / "clip-0.mp4", (clips / "clip-0.txt").read_text().strip()
    batch = pa.table({"sample_id": ["good", "bad"], "source": [str(clip), "empty.mov"], "record": ["", ""],
                      "modality": ["video", "video"], "payload": [caption, None], "error": [None, None],
                      "blob": [None, None], "media": [str(clip), str(clips / "bad" / "empty.mov")]},
                     schema=RECORD_SCHEMA)
    kwargs = {"vocab": manifest.to_dict(), "text_first": 0.0}
    first = VideoPoolWorker({k: paths[k] for k in ("visual", "audio")}, **kwargs, video=vars(video))(batch)
    second = VideoSoundPoolWorker({k: paths[k] for k in ("text", "audio")}, **kwargs)(first)
    rows = second.to_pylist()
    assert rows[1]["error"] == first.column("error")[1].as_py() and rows[1]["error"].startswith("empty file")
    assert rows[1]["tokens"] is None
    # where each stage ran: here, one process (inside Ray a node id, outside None), for every row
    assert [r["node"] for r in rows] == first.column("frames_node").to_pylist() == [r["sound_node"] for r in rows]
    # one pass, by hand
    frames = sample_frames(clip, video)
    size = fit_to_budget(frames.pixels.shape[1], frames.pixels.shape[2], video.max_frame_pixels, 8)
    with torch.inference_mode():  # as the workers run them
        codes = visual.encode(resize_images(torch.stack([to_tensor(p) for p in frames.pixels]), size)).numpy()
        blocks, _ = read_sound(clip, 1.0)
        sound = encode_long(audio, blocks)
    starts = interval_starts(frames.times, len(sound), 50.0)
    ends = np.r_[starts[1:], len(sound)]
    expected = VideoPart(codes, frames.times, tuple(sound[a:b] for a, b in zip(starts, ends, strict=True)),
                         np.round(starts * 1000 / 50.0).astype(np.int64))
    got, text = SampleLayout(manifest).disassemble(rows[0]["tokens"], rows[0]["segments"])
    assert got == expected and len(sound) > 0
    assert text.ids.tolist() == TextTokenizer.load(paths["text"]).encode(caption)
    assert rows[0]["content_hash"] == first.column("video_hash")[0].as_py()


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, text_bundle, clips):
    from tokenloom.jobs.config import RunConfig
    from tokenloom.jobs.home import Home, open_catalog
    from tokenloom.jobs.ingest import ingest
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig
    from tokenloom.tokenizers.audio import publish_bundle as publish_audio
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual

    root = tmp_path_factory.mktemp("video-ingest")
    home = Home(root / "home")
    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.ingest.text_first = 0.0
    cfg.ingest.ray.progress_bars = False
    cfg.visual_tokenizer = VisualTokenizerConfig(image_size=32, max_pixels=32 * 32)
    visual = VisualTokenizer(cfg.visual_tokenizer)
    visual.init_codebook(torch.rand(64, 3, 32, 32))
    cfg.audio_tokenizer = AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=4,
                                               codebook_size=32, code_dim=4, chunk_seconds=2.0)
    audio = AudioTokenizer(cfg.audio_tokenizer)
    audio.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    vb, ab = publish_visual(visual.eval(), home.bundles), publish_audio(audio.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    result = ingest(home, [clips], "videos", cfg, {"text": text_bundle.id, "visual": vb.id, "audio": ab.id})
    rows = open_catalog(home, cfg).scan("videos").to_pylist()
    return home, cfg, result, rows


def _decoded_sound_seconds(path: Path) -> float | None:
    blocks, _ = read_sound(path)
    return None if blocks is None else sum(len(b) for b in blocks) / 16_000


@pytest.mark.long  # a video ingestion job of its own (~2 min); the demo's covers the path in `make test`
@pytest.mark.integration
def test_every_good_clip_once_with_frames_and_sound(ingested, clips):
    home, cfg, result, rows = ingested
    by_source = {Path(r["source"]).name: r for r in rows}
    good = {"clip-0.mp4", "clip-1.webm", "clip-2.mkv", "clip-3.mov", "videos.jsonl", "broken-sound.mkv"}
    assert set(by_source) == good and len(rows) == result.samples == 6
    vocab = home.manifest(rows[0]["vocab_id"])
    layout = SampleLayout(vocab)
    video_cfg = cfg.ingest.video
    for name, row in by_source.items():
        assert row["modalities"] == ("image+text+video" if name in ("clip-3.mov", "broken-sound.mkv")
                                     else "audio+image+text+video")
        path = clips / "paired" / "clip-paired.mp4" if name == "videos.jsonl" else next(clips.rglob(name))
        video, *caption = layout.disassemble(row["tokens"], row["segments"])
        assert isinstance(video, VideoPart) and len(caption) == (name != "broken-sound.mkv")  # no caption beside it
        # frames: counted independently with PyAV, at 2 per second; grid from the pixel budget
        with av.open(str(path)) as c:
            times = [float(f.time) for f in c.decode(c.streams.video[0])]
        expected_frames = len({int(t * video_cfg.fps + 1e-6) for t in times})
        w, h = frame_size(96, 64, video_cfg.max_frame_pixels)
        from tokenloom.tokenizers.visual import fit_to_budget

        H, W = fit_to_budget(h, w, video_cfg.max_frame_pixels, 8)
        assert video.frames.shape == (expected_frames, H // 8, W // 8)
        assert video.times.tolist() == [500 * k for k in range(expected_frames)]
        # sound: 50 frames per second of the decoded track, split at the frame times
        seconds = _decoded_sound_seconds(path)
        if name in ("clip-3.mov", "broken-sound.mkv"):
            assert video.audio == ()
            continue
        assert video.audio_frames == int(np.ceil(seconds * 16_000 / 320))
        assert [len(a) for a in video.audio[:-1]] == [25] * (expected_frames - 1)
        assert isinstance(caption[0], TextPart) and len(caption[0].ids)


@pytest.mark.long  # a video ingestion job of its own (~2 min); the demo's covers the path in `make test`
@pytest.mark.integration
def test_bad_videos_are_quarantined_with_reasons(ingested):
    _, _, result, _ = ingested
    assert result.quarantine_reasons == {"unreadable container": 2, "empty file": 1, "no video stream": 1,
                                         "absurd frame size": 1, "zero frames decoded": 1}
    assert result.quarantined == 6
    assert result.pools["video"]["notes"] == {"broken audio track": 1}
    assert result.pools["video"]["records_at_sink"] == 12
    # every video record then passed the sound stage, on the audio pool's resources
    sound = result.pools["video_sound"]
    assert sound["records_at_sink"] == sound["records"] == 12 and sum(sound["nodes"].values()) == 12
    assert sound["mode"] in ("tasks", "actors") and sound["seconds"] > 0


@pytest.mark.long  # a video ingestion job of its own (~2 min); the demo's covers the path in `make test`
@pytest.mark.integration
def test_decode_writes_an_mp4_with_its_sound(ingested, tmp_path):
    from tokenloom.jobs.tokenizer import decode_sample

    home, cfg, _, rows = ingested
    row = next(r for r in rows if r["source"].endswith("clip-0.mp4"))
    video, _ = SampleLayout(home.manifest(row["vocab_id"])).disassemble(row["tokens"], row["segments"])
    doc = decode_sample(home, cfg, "videos", row["sample_id"], tmp_path / "clip.mp4")
    assert doc["videos"] == [str(tmp_path / "clip.mp4")]
    with av.open(doc["videos"][0]) as c:
        frames = [f for f in c.decode(c.streams.video[0])]
        assert len(frames) == len(video.frames)
        assert [round(float(f.time) * 1000) for f in frames] == video.times.tolist()
        assert frames[0].width == video.frames.shape[2] * 8
        assert c.duration / 1e6 == pytest.approx(len(video.frames) * 0.5, abs=0.1)
    sound = _decoded_sound_seconds(tmp_path / "clip.mp4")
    assert sound == pytest.approx(video.audio_frames / 50, abs=0.07)  # AAC pads to whole 1024-sample frames


def test_write_video_keeps_each_frame_at_its_time(tmp_path):
    frames = np.random.default_rng(0).integers(0, 255, (3, 32, 48, 3), dtype=np.uint8)
    path = write_video(tmp_path / "x.mp4", frames, np.array([0, 500, 2000]))
    with av.open(str(path)) as c:
        assert [round(float(f.time) * 1000) for f in c.decode(c.streams.video[0])] == [0, 500, 2000]
