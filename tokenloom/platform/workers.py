"""Tokenizer pool workers: one Ray Data callable class per modality.

Each actor loads its tokenizer bundle once, then turns batches of parsed records into shard
rows. Records that arrive already quarantined pass through untouched, so every input
record leaves the pool exactly once, as a sample, a quarantine entry or a filtered record.
The pool is where a record is decoded, so it is also where it is measured: the quality
filters (`datasets.filters`) mark records they drop, and the dedup keys (`datasets.dedup`:
content hash, text MinHash, image phash) travel with each row to the sink and the driver,
which decides what is a duplicate once every key of the job is known.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pyarrow as pa

from tokenloom.catalog.schema import SHARD_SCHEMA
from tokenloom.datasets import dedup as keys
from tokenloom.datasets import filters
from tokenloom.platform.guard import BatchGuard
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart, VideoPart
from tokenloom.tokenizers.text import TextTokenizer
from tokenloom.tokenizers.vocab import VocabManifest

OUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("record", pa.string()),
        pa.field("tokens", pa.list_(pa.int32())),
        pa.field("segments", SHARD_SCHEMA.field("segments").type),
        pa.field("error", pa.string()),
        pa.field("content_hash", pa.string()),  # of the normalized record (exact-duplicate key)
        pa.field("modality", pa.string()),  # what the record is (text, image, audio): filters and dedup
        pa.field("filter", pa.string()),  # the quality filter that dropped a valid record, else null
        pa.field("filter_reason", pa.string()),
        pa.field("minhash", pa.list_(pa.uint32())),  # text records, when near-duplicate text is on
        pa.field("phash", pa.uint64()),  # image records, when near-duplicate images are on
        pa.field("pool", pa.string()),  # the pool that tokenized the record (per-pool figures)
        pa.field("node", pa.string()),  # the Ray node it ran on (placement by pool label)
        pa.field("note", pa.string()),  # what was dropped from a kept sample (a video's broken sound track)
        pa.field("sound_node", pa.string()),  # video rows: the Ray node their sound was tokenized on (audio pool)
    ]
)


class PoolStartError(RuntimeError):
    """A pool worker could not be built (a damaged bundle, a manifest that does not fit it, ...)."""


def _names_pool(init):
    """Errors while a worker is built become one `PoolStartError` naming its pool and the cause."""
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except PoolStartError:
            raise
        except Exception as exc:
            raise PoolStartError(f"the {self.pool} tokenizer pool could not start: {exc}") from exc
    return wrapped


class _Marks:
    """Per-row filter results and dedup keys of one batch, filled in as rows are handled."""

    def __init__(self, n: int):
        self.hashes: list[str | None] = [None] * n
        self.modality: list[str | None] = [None] * n
        self.filter: list[str | None] = [None] * n
        self.reason: list[str | None] = [None] * n
        self.minhash: list[np.ndarray | None] = [None] * n
        self.phash: list[int | None] = [None] * n

    def columns(self) -> list[pa.Array]:
        return [pa.array(self.hashes, pa.string()), pa.array(self.modality, pa.string()),
                pa.array(self.filter, pa.string()), pa.array(self.reason, pa.string()),
                pa.array(self.minhash, pa.list_(pa.uint32())), pa.array(self.phash, pa.uint64())]


_NODE: list[str] = []  # this process's Ray node id, once known (a process never moves)


def _node_id() -> str | None:
    """The Ray node this worker process runs on (None outside Ray)."""
    if not _NODE:
        import ray

        if not ray.is_initialized():
            return None
        _NODE.append(ray.get_runtime_context().get_node_id())
    return _NODE[0]


def _output(pool: str, batch: pa.Table, token_lists: list, segments: list, errors: list | None = None,
            marks: _Marks | None = None, notes: list | None = None) -> pa.Table:
    marks = marks or _Marks(batch.num_rows)
    return pa.Table.from_arrays(
        [
            batch.column("sample_id"),
            batch.column("source"),
            batch.column("record"),
            pa.array(token_lists, type=OUT_SCHEMA.field("tokens").type),
            pa.array(segments, type=OUT_SCHEMA.field("segments").type),
            pa.array(errors, type=pa.string()) if errors is not None else batch.column("error"),
            *marks.columns(),
            pa.array([pool] * batch.num_rows, pa.string()),
            pa.array([_node_id()] * batch.num_rows, pa.string()),
            pa.array(notes if notes is not None else [None] * batch.num_rows, pa.string()),
            pa.nulls(batch.num_rows, pa.string()),
        ],
        schema=OUT_SCHEMA,
    )


class TextPoolWorker:
    """BPE-encode `payload` texts into text samples (`tokenizers.sequence` lays them out)."""

    needs = ("text",)
    pool = "text"

    @_names_pool
    def __init__(self, bundle_paths: dict[str, str], vocab: dict, text_first: float = 0.0,
                 quality: dict | None = None, dedup: dict | None = None, guard: dict | None = None):
        manifest = VocabManifest.from_dict(vocab)
        # the in-flight journal and injected faults (platform/guard.py); None: batches run unguarded
        self.guard = BatchGuard(**guard, pool=self.pool) if guard else None
        self.text_first = text_first
        self.quality = filters.from_dict(quality)  # asdict(FilterConfig); None = the defaults
        dedup = dedup or {}
        on = bool(dedup.get("enabled", False))
        self.minhash = on and dedup.get("text", True) and dedup.get("near_text", True)  # else no signature
        self.phash = on and dedup.get("image", True) and dedup.get("near_image", True)
        self.num_perm = int(dedup.get("num_perm", 128))
        self.shingle_size = int(dedup.get("shingle_size", 5))
        if self.minhash:  # datasketch imports scipy (seconds): load it while the read tasks run, not on a batch
            import datasketch  # noqa: F401
        if self.phash:
            import imagehash  # noqa: F401
        self.tokenizer = TextTokenizer.load(bundle_paths["text"])
        if self.tokenizer.vocab_size > manifest.text.size:
            raise ValueError(
                f"text bundle has {self.tokenizer.vocab_size} ids but the manifest's text range holds {manifest.text.size}"
            )
        self.layout = SampleLayout(manifest)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """A batch of parsed records -> shard rows, through the journal when there is one."""
        if self.guard is None:
            return self.tokenize(batch)
        return self.guard.run(batch, self.tokenize, self.quarantined)

    def quarantined(self, batch: pa.Table, reason: str) -> pa.Table:
        """The batch's records as quarantine rows with `reason`."""
        n = batch.num_rows
        return _output(self.pool, batch, [None] * n, [None] * n, [reason] * n)

    def _layout(self, sample_id: str, media: list, text: np.ndarray) -> list:
        """A media sample's parts: media then its text, or text first for a `text_first` share
        of the samples (a fixed hash of the sample id)."""
        parts = [*media, TextPart(np.asarray(text))]
        if media and int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest()) / 2**64 < self.text_first:
            parts = parts[::-1]
        return parts

    def _mark_text(self, marks: _Marks, rows: list[int], texts: list[str], encoded: list) -> None:
        """Filter results, content hash and MinHash of text-only records."""
        kept = []
        for i, text, ids in zip(rows, texts, encoded, strict=True):
            marks.modality[i], marks.hashes[i] = "text", keys.text_hash(text)
            # the measures feed the filters only: not computed when the filters are off
            failed = self.quality.enabled and filters.first_failure("text", filters.text_measures(text, len(ids)),
                                                                    self.quality)
            if failed:
                marks.filter[i], marks.reason[i] = failed
            else:
                kept.append((i, text))
        if self.minhash and kept:
            signatures = keys.minhashes([t for _, t in kept], self.num_perm, self.shingle_size)
            for (i, _), signature in zip(kept, signatures, strict=True):
                marks.minhash[i] = signature

    def _samples(self, batch: pa.Table, errors: list, marks: _Marks, media: dict, has_file: list[bool],
                 notes: list | None = None) -> pa.Table:
        """A media pool's output rows: each good record's `media` part (by row) with its caption or
        transcript, laid out by `_layout`; a record without a media file (`has_file` false: a
        text-only line of a pairs file) becomes a text sample, marked as one."""
        payloads = batch.column("payload").to_pylist()
        good = [i for i, err in enumerate(errors) if err is None and marks.filter[i] is None]
        texts = self.tokenizer.encode_batch([payloads[i] or "" for i in good]) if good else []
        text_only = [(i, t) for i, t in zip(good, texts, strict=True) if not has_file[i]]
        self._mark_text(marks, [i for i, _ in text_only], [payloads[i] or "" for i, _ in text_only],
                        [t for _, t in text_only])
        ids = batch.column("sample_id").to_pylist()
        token_lists: list[np.ndarray | None] = [None] * batch.num_rows
        segments: list[list[dict] | None] = [None] * batch.num_rows
        for i, text in zip(good, texts, strict=True):
            parts = [media[i]] if i in media else []
            token_lists[i], segments[i] = self.layout.assemble(self._layout(ids[i], parts, text))
        return _output(self.pool, batch, token_lists, segments, errors, marks, notes)

    def tokenize(self, batch: pa.Table) -> pa.Table:
        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        good = [i for i, err in enumerate(errors) if err is None]
        encoded = self.tokenizer.encode_batch([payloads[i] for i in good]) if good else []
        token_lists: list[np.ndarray | None] = [None] * batch.num_rows
        segments: list[list[dict] | None] = [None] * batch.num_rows
        marks = _Marks(batch.num_rows)
        self._mark_text(marks, good, [payloads[i] for i in good], encoded)
        for i, ids in zip(good, encoded, strict=True):
            token_lists[i], segments[i] = self.layout.assemble([TextPart(np.asarray(ids))])
        return _output(self.pool, batch, token_lists, segments, marks=marks)


class ImagePoolWorker(TextPoolWorker):
    """Visual-tokenize images (dual-path tokenizer) with their captions, into one sample each.

    An image sample is `[ImagePart, TextPart(caption)]`: `<bos> <boi> | h*w visual codes (raster)
    | <eoi> caption <eos>` (see `tokenizers.sequence`), or caption first for the
    `ingest.text_first` share of samples. Records with
    no image (text-only lines of a pairs file) become text samples, as in the text pool.
    Images are resized into the tokenizer's pixel budget (aspect kept) and encoded in batches
    of equal size; on a GPU actor the tokenizer runs on the GPU.
    """

    needs = ("text", "visual")
    pool = "image"

    @_names_pool
    def __init__(self, bundle_paths: dict[str, str], vocab: dict, text_first: float = 0.0,
                 quality: dict | None = None, dedup: dict | None = None, guard: dict | None = None):
        import torch

        from tokenloom.tokenizers.visual import load_visual

        super().__init__(bundle_paths, vocab, text_first, quality, dedup, guard)
        manifest = VocabManifest.from_dict(vocab)
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)  # an actor is one slot of the pool: parallelism comes from actors
        self.model = load_visual(bundle_paths["visual"]).to(self.device)
        if self.model.num_codes > manifest.visual.size:
            raise ValueError(f"visual bundle has {self.model.num_codes} codes but the manifest's visual range "
                             f"holds {manifest.visual.size}")

    def _encode_images(self, pixels: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        from tokenloom.tokenizers.visual import prepare

        prepared = {i: prepare(p, self.model.cfg) for i, p in pixels.items()}
        by_shape: dict[tuple, list[int]] = {}
        for i, image in prepared.items():
            by_shape.setdefault(tuple(image.shape), []).append(i)
        codes: dict[int, np.ndarray] = {}
        for rows in by_shape.values():
            for start in range(0, len(rows), 16):
                chunk = rows[start:start + 16]
                x = self.torch.stack([prepared[i] for i in chunk]).to(self.device)
                out = self.model.encode(x).cpu().numpy()
                for j, i in enumerate(chunk):
                    codes[i] = out[j]
        return codes

    def tokenize(self, batch: pa.Table) -> pa.Table:
        from tokenloom.datasets.images import decode_image

        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        blobs = batch.column("blob").to_pylist()
        pixels: dict[int, np.ndarray] = {}
        marks = _Marks(batch.num_rows)
        for i, err in enumerate(errors):
            if err is None and blobs[i] is not None:
                # decoded no larger than needed: the tokenizer resizes into its pixel budget anyway
                decoded, errors[i] = decode_image(blobs[i], max_decoded_pixels=4 * self.model.cfg.max_pixels)
                if decoded is None:
                    continue
                marks.modality[i] = "image"
                marks.hashes[i] = keys.image_hash(decoded.pixels, payloads[i])
                failed = filters.first_failure("image", filters.image_measures(decoded.pixels), self.quality)
                if failed:  # not encoded: a filtered image is written to the side file only
                    marks.filter[i], marks.reason[i] = failed
                    continue
                pixels[i] = decoded.pixels
                if self.phash:
                    marks.phash[i] = keys.phash(decoded.pixels)
        codes = self._encode_images(pixels) if pixels else {}
        return self._samples(batch, errors, marks, {i: ImagePart(c) for i, c in codes.items()},
                             [b is not None for b in blobs])


class AudioPoolWorker(TextPoolWorker):
    """RVQ-tokenize audio files with their transcripts, into one sample each.

    An audio sample is `[AudioPart, TextPart(transcript)]`: `<bos> <boa> | frames x L codes,
    frame-major | <eoa> transcript <eos>` (see `tokenizers.sequence`), or transcript first for
    the `ingest.text_first` share of samples. Files are read in blocks of the bundle's
    `chunk_seconds`, downmixed, resampled to 16 kHz and encoded block by block, so an hours-long
    file costs one block of memory; unreadable files, zero-length audio, rates out of range and
    NaN/infinite samples are quarantined with the reason.
    """

    needs = ("text", "audio")
    pool = "audio"

    @_names_pool
    def __init__(self, bundle_paths: dict[str, str], vocab: dict, text_first: float = 0.0,
                 quality: dict | None = None, dedup: dict | None = None, guard: dict | None = None):
        import torch

        from tokenloom.tokenizers.audio import load_audio

        super().__init__(bundle_paths, vocab, text_first, quality, dedup, guard)
        manifest = VocabManifest.from_dict(vocab)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.model = load_audio(bundle_paths["audio"]).to(self.device)
        levels, size = self.model.levels, self.model.cfg.codebook_size
        if len(manifest.audio) != levels or any(r.size < size for r in manifest.audio):
            raise ValueError(f"audio bundle has {levels} levels of {size} codes but the manifest's audio ranges are "
                             f"{[(r.start, r.stop) for r in manifest.audio]}")

    def _encode(self, path: str) -> tuple[np.ndarray, dict[str, float], keys.AudioHasher]:
        """Codes of the file, with its filter measures and content hasher, from one streaming pass."""
        from tokenloom.datasets.audio import read_mono
        from tokenloom.tokenizers.audio import encode_long

        cfg = self.model.cfg
        meter = filters.AudioMeter(cfg.sample_rate, self.quality.audio.silence_rms)
        hasher = keys.AudioHasher()

        def measured(blocks):
            for block in meter.tap(blocks):
                hasher.update(block)
                yield block

        codes = encode_long(self.model, measured(read_mono(path, cfg.chunk_seconds, cfg.sample_rate)))
        return codes, meter.measures(), hasher

    def tokenize(self, batch: pa.Table) -> pa.Table:
        from tokenloom.datasets.audio import AudioProblem

        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        media = batch.column("media").to_pylist()
        codes: dict[int, np.ndarray] = {}
        marks = _Marks(batch.num_rows)
        for i, err in enumerate(errors):
            if err is None and media[i] is not None:
                try:
                    codes[i], measures, hasher = self._encode(media[i])
                except AudioProblem as exc:
                    errors[i] = str(exc)
                    continue
                marks.modality[i], marks.hashes[i] = "audio", hasher.hexdigest(payloads[i])
                failed = filters.first_failure("audio", measures, self.quality)
                if failed:
                    marks.filter[i], marks.reason[i] = failed
        return self._samples(batch, errors, marks, {i: AudioPart(c) for i, c in codes.items()},
                             [m is not None for m in media])


# what the video pool hands the sound stage beside each record (`VideoPoolWorker` -> `VideoSoundPoolWorker`)
VIDEO_STAGE_FIELDS = [
    pa.field("frames", pa.large_binary()),  # visual codes, int32 [K, h, w] in C order
    pa.field("frames_shape", pa.list_(pa.int32())),  # (K, h, w)
    pa.field("times", pa.list_(pa.int64())),  # each frame's time, ms
    pa.field("sound", pa.large_binary()),  # the sound track, mono float32 at 16 kHz; null without one
    pa.field("video_hash", pa.string()),  # dedup key of frames, sound and caption
    pa.field("video_note", pa.string()),  # what was dropped (a broken sound track)
    pa.field("frames_node", pa.string()),  # the Ray node the record passed the video pool on
]


class VideoPoolWorker:
    """Video files, first stage: frames on the video pool (the visual pool's nodes and resources).

    Each file is probed and bounded before decoding, its frames sampled at `ingest.video.fps` and
    tokenized by the visual tokenizer (resized into `max_frame_pixels`, all frames of a video at one
    grid size, encoded in batches), and its sound track decoded and resampled to 16 kHz (blocks of the
    audio bundle's `chunk_seconds`, as the audio pool reads files). The record leaves with its frame
    codes, the decoded sound and the dedup key (`VIDEO_STAGE_FIELDS`) for the second stage,
    `VideoSoundPoolWorker` on the audio pool, which RVQ-encodes the sound and lays out the sample.
    Unusable files carry their reason in `error` (`datasets/video.py`); a sound track that does not
    decode is dropped and the video kept, with a note.
    """

    needs = ("visual", "audio")  # the audio bundle's config only (its rate and block length), not its weights
    pool = "video"

    @_names_pool
    def __init__(self, bundle_paths: dict[str, str], vocab: dict, text_first: float = 0.0,
                 quality: dict | None = None, dedup: dict | None = None, guard: dict | None = None,
                 video: dict | None = None):
        import torch

        from tokenloom.datasets.video import VideoConfig
        from tokenloom.tokenizers.audio.train import config_from_dict
        from tokenloom.tokenizers.bundle import load_info
        from tokenloom.tokenizers.visual import load_visual

        manifest = VocabManifest.from_dict(vocab)
        self.guard = BatchGuard(**guard, pool=self.pool) if guard else None
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.video = VideoConfig(**(video or {}))
        self.visual = load_visual(bundle_paths["visual"]).to(self.device)
        self.sound = config_from_dict(load_info(bundle_paths["audio"]).config["config"])
        if self.visual.num_codes > manifest.visual.size:
            raise ValueError(f"visual bundle has {self.visual.num_codes} codes but the manifest's visual range "
                             f"holds {manifest.visual.size}")

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.guard is None:
            return self.tokenize(batch)
        return self.guard.run(batch, self.tokenize, self.quarantined)

    def _with(self, batch: pa.Table, errors: list, columns: dict[str, list]) -> pa.Table:
        n = batch.num_rows
        columns = {**columns, "frames_node": [_node_id()] * n}  # every row passed this pool
        out = batch.set_column(batch.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
        for f in VIDEO_STAGE_FIELDS:
            out = out.append_column(f, pa.array(columns.get(f.name, [None] * n), f.type))
        return out

    def quarantined(self, batch: pa.Table, reason: str) -> pa.Table:
        return self._with(batch, [reason] * batch.num_rows, {})

    def _frames_codes(self, pixels: np.ndarray) -> np.ndarray:
        """[K, H, W, 3] uint8 frames -> [K, h, w] visual codes at the video pixel budget."""
        from tokenloom.tokenizers.visual import fit_to_budget, to_tensor
        from tokenloom.tokenizers.visual.model import resize_images

        cfg = self.visual.cfg
        size = fit_to_budget(pixels.shape[1], pixels.shape[2], self.video.max_frame_pixels, cfg.factor)
        out = []
        with self.torch.inference_mode():
            for start in range(0, len(pixels), 16):
                x = self.torch.stack([to_tensor(p) for p in pixels[start:start + 16]])
                out.append(self.visual.encode(resize_images(x, size).to(self.device)).cpu().numpy())
        return np.concatenate(out)

    def _encode(self, path: str, caption: str | None) -> dict:
        """One file's stage output (`VIDEO_STAGE_FIELDS` by name); VideoProblem when unusable."""
        from tokenloom.datasets.video import probe, read_sound, sample_frames

        info = probe(path, self.video)
        frames = sample_frames(path, self.video, info)
        codes = self._frames_codes(frames.pixels).astype(np.int32)
        blocks, note = read_sound(path, self.sound.chunk_seconds, self.sound.sample_rate)
        sound, sound_hash = None, None
        if blocks is not None:
            hasher = keys.AudioHasher()
            wav = []
            for block in blocks:
                hasher.update(block)
                wav.append(np.asarray(block, dtype=np.float32))
            sound, sound_hash = np.concatenate(wav).tobytes(), hasher.hexdigest(None)
        return {"frames": codes.tobytes(), "frames_shape": list(codes.shape),
                "times": [int(t) for t in frames.times], "sound": sound,
                "video_hash": keys.video_hash(frames.pixels, sound_hash, caption), "video_note": note}

    def tokenize(self, batch: pa.Table) -> pa.Table:
        from tokenloom.datasets.video import VideoProblem

        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        media = batch.column("media").to_pylist()
        columns: dict[str, list] = {f.name: [None] * batch.num_rows for f in VIDEO_STAGE_FIELDS}
        for i, err in enumerate(errors):
            if err is None and media[i] is not None:
                try:
                    got = self._encode(media[i], payloads[i])
                except VideoProblem as exc:
                    errors[i] = str(exc)
                    continue
                for name, value in got.items():
                    columns[name][i] = value
        return self._with(batch, errors, columns)


class VideoSoundPoolWorker(TextPoolWorker):
    """Video files, second stage: the sound on the audio pool (its nodes and resources).

    The sound track the video pool decoded (`VideoPoolWorker`) is RVQ-encoded by the audio
    tokenizer (`encode_long`, as audio files are) and each frame is followed by the audio frames of
    its interval: `<bos><bov> [frame 0] [its sound] [frame 1] ... <eov> caption <eos>`
    (`tokenizers.sequence.VideoPart`), or caption first for the `ingest.text_first` share. Records
    the first stage quarantined pass through with their reason; its notes stay with the sample. The
    rows count for the video pool at the sink (`pool` = "video", `node` = where the frames ran), and
    `sound_node` says where this stage ran (every row it passed, for the `video_sound` figures).
    """

    needs = ("text", "audio")
    pool = "video"

    @_names_pool
    def __init__(self, bundle_paths: dict[str, str], vocab: dict, text_first: float = 0.0,
                 quality: dict | None = None, dedup: dict | None = None, guard: dict | None = None):
        import torch

        from tokenloom.tokenizers.audio import load_audio

        super().__init__(bundle_paths, vocab, text_first, quality, dedup, guard)
        self.guard = BatchGuard(**guard, pool="video_sound") if guard else None  # its own journal entries
        manifest = VocabManifest.from_dict(vocab)
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.audio = load_audio(bundle_paths["audio"]).to(self.device)
        if len(manifest.audio) != self.audio.levels:
            raise ValueError(f"audio bundle has {self.audio.levels} levels but the manifest has {len(manifest.audio)}")
        if self.layout.bov is None:
            raise ValueError("the vocabulary manifest has no <bov>/<eov> specials")

    def _part(self, frames: bytes, shape: list[int], times: list[int], sound: bytes | None) -> VideoPart:
        from tokenloom.datasets.video import interval_starts
        from tokenloom.tokenizers.audio import encode_long

        codes = np.frombuffer(frames, dtype=np.int32).reshape(shape).astype(np.int64)
        times = np.asarray(times, dtype=np.int64)
        if sound is None:
            return VideoPart(codes, times)
        audio = encode_long(self.audio, [np.frombuffer(sound, dtype=np.float32)])
        rate = self.audio.cfg.frame_rate
        starts = interval_starts(times, len(audio), rate)
        ends = np.r_[starts[1:], len(audio)]
        return VideoPart(codes, times, tuple(audio[a:b] for a, b in zip(starts, ends, strict=True)),
                         np.round(starts * 1000 / rate).astype(np.int64))

    def quarantined(self, batch: pa.Table, reason: str) -> pa.Table:
        return self._with_nodes(super().quarantined(batch, reason), batch)

    @staticmethod
    def _with_nodes(out: pa.Table, batch: pa.Table) -> pa.Table:
        """The video pool's rows: `node` where the frames ran, `sound_node` where the sound ran."""
        frames_node = batch.column("frames_node")
        out = out.set_column(out.schema.get_field_index("node"), "node", frames_node)
        return out.set_column(out.schema.get_field_index("sound_node"), "sound_node",
                              pa.array([_node_id()] * batch.num_rows, pa.string()))

    def tokenize(self, batch: pa.Table) -> pa.Table:
        errors = batch.column("error").to_pylist()
        media = batch.column("media").to_pylist()
        cols = {name: batch.column(name).to_pylist() for name in ("frames", "frames_shape", "times", "sound",
                                                                  "video_hash", "video_note")}
        videos: dict[int, VideoPart] = {}
        marks = _Marks(batch.num_rows)
        for i, err in enumerate(errors):
            if err is None and media[i] is not None:
                videos[i] = self._part(cols["frames"][i], cols["frames_shape"][i], cols["times"][i], cols["sound"][i])
                marks.modality[i], marks.hashes[i] = "video", cols["video_hash"][i]
        out = self._samples(batch, errors, marks, videos, [m is not None for m in media], cols["video_note"])
        return self._with_nodes(out, batch)


WORKERS = {"text": TextPoolWorker, "image": ImagePoolWorker, "audio": AudioPoolWorker, "video": VideoPoolWorker,
           "video_sound": VideoSoundPoolWorker}
# the stages a modality's records pass through, in order (each a `WORKERS` entry), and the pool
# whose resources and bounds a stage runs on (`ingest.pools`), where it is not the stage's own
STAGES = {"video": ("video", "video_sound")}
STAGE_POOL = {"video_sound": "audio"}


def stages(modality: str) -> tuple[str, ...]:
    return STAGES.get(modality, (modality,))


def needs(modality: str) -> set[str]:
    """The tokenizer bundles a modality's stages need."""
    return {kind for stage in stages(modality) for kind in WORKERS[stage].needs}
