"""Tokenizer pool workers: one Ray Data callable class per modality.

Each actor loads its tokenizer bundle once, then turns batches of parsed records into shard
rows. Records that arrive already quarantined pass through untouched, so every input
record leaves the pool exactly once, as a sample or as a quarantine entry.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tokenloom.catalog.schema import SHARD_SCHEMA
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
    ]
)


def _text_tokens(ids: list[int], offset: int, bos: int, eos: int) -> np.ndarray:
    arr = np.empty(len(ids) + 2, dtype=np.int32)
    arr[0], arr[-1] = bos, eos
    arr[1:-1] = np.asarray(ids, dtype=np.int32) + offset
    return arr


def _segment(modality: str, start: int, length: int, grid=(), attention: str = "causal") -> dict:
    return {"modality": modality, "start": start, "length": length, "grid": list(grid), "attention": attention}


def _output(batch: pa.Table, token_lists: list, segments: list, errors: list | None = None) -> pa.Table:
    return pa.Table.from_arrays(
        [
            batch.column("sample_id"),
            batch.column("source"),
            batch.column("record"),
            pa.array(token_lists, type=OUT_SCHEMA.field("tokens").type),
            pa.array(segments, type=OUT_SCHEMA.field("segments").type),
            pa.array(errors, type=pa.string()) if errors is not None else batch.column("error"),
        ],
        schema=OUT_SCHEMA,
    )


class TextPoolWorker:
    """BPE-encode `payload` texts; ids become unified ids wrapped in <bos> ... <eos>."""

    needs = ("text",)

    def __init__(self, bundle_paths: dict[str, str], vocab: dict):
        manifest = VocabManifest.from_dict(vocab)
        self.tokenizer = TextTokenizer.load(bundle_paths["text"])
        if self.tokenizer.vocab_size > manifest.text.size:
            raise ValueError(
                f"text bundle has {self.tokenizer.vocab_size} ids but the manifest's text range holds {manifest.text.size}"
            )
        self.offset = manifest.text.start
        self.bos, self.eos = manifest.bos_id, manifest.eos_id

    def __call__(self, batch: pa.Table) -> pa.Table:
        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        good = [i for i, err in enumerate(errors) if err is None]
        encoded = self.tokenizer.encode_batch([payloads[i] for i in good]) if good else []
        token_lists: list[np.ndarray | None] = [None] * batch.num_rows
        segments: list[list[dict] | None] = [None] * batch.num_rows
        for i, ids in zip(good, encoded, strict=True):
            token_lists[i] = _text_tokens(ids, self.offset, self.bos, self.eos)
            segments[i] = [_segment("text", 0, len(token_lists[i]))]
        return _output(batch, token_lists, segments)


class ImagePoolWorker(TextPoolWorker):
    """Visual-tokenize images (dual-path tokenizer) with their captions, into one sample each.

    Layout of an image sample: `<bos> <boi> | h*w visual codes (raster) | <eoi> caption <eos>`,
    segments text (causal) | image (bidirectional, grid [h, w]) | text (causal). Records with
    no image (text-only lines of a pairs file) become text samples, as in the text pool.
    Images are resized into the tokenizer's pixel budget (aspect kept) and encoded in batches
    of equal size; on a GPU actor the tokenizer runs on the GPU.
    """

    needs = ("text", "visual")

    def __init__(self, bundle_paths: dict[str, str], vocab: dict):
        import torch

        from tokenloom.tokenizers.visual import load_visual

        super().__init__(bundle_paths, vocab)
        manifest = VocabManifest.from_dict(vocab)
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)  # an actor is one slot of the pool: parallelism comes from actors
        self.model = load_visual(bundle_paths["visual"]).to(self.device)
        if self.model.num_codes > manifest.visual.size:
            raise ValueError(f"visual bundle has {self.model.num_codes} codes but the manifest's visual range "
                             f"holds {manifest.visual.size}")
        self.visual_offset = manifest.visual.start
        self.boi, self.eoi = manifest.specials["<boi>"], manifest.specials["<eoi>"]

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

    def __call__(self, batch: pa.Table) -> pa.Table:
        from tokenloom.datasets.images import decode_image

        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        blobs = batch.column("blob").to_pylist()
        token_lists: list[np.ndarray | None] = [None] * batch.num_rows
        segments: list[list[dict] | None] = [None] * batch.num_rows
        pixels: dict[int, np.ndarray] = {}
        for i, err in enumerate(errors):
            if err is None and blobs[i] is not None:
                # decoded no larger than needed: the tokenizer resizes into its pixel budget anyway
                decoded, errors[i] = decode_image(blobs[i], max_decoded_pixels=4 * self.model.cfg.max_pixels)
                if decoded is not None:
                    pixels[i] = decoded.pixels
        codes = self._encode_images(pixels) if pixels else {}
        good = [i for i, err in enumerate(errors) if err is None]
        captions = self.tokenizer.encode_batch([payloads[i] or "" for i in good]) if good else []
        for i, caption in zip(good, captions, strict=True):
            if i not in codes:  # a text-only record
                token_lists[i] = _text_tokens(caption, self.offset, self.bos, self.eos)
                segments[i] = [_segment("text", 0, len(token_lists[i]))]
                continue
            grid = codes[i]
            h, w = grid.shape
            tail = _text_tokens(caption, self.offset, self.eoi, self.eos)  # <eoi> caption <eos>
            tokens = np.concatenate([np.array([self.bos, self.boi], dtype=np.int32),
                                     grid.reshape(-1).astype(np.int32) + self.visual_offset, tail])
            token_lists[i] = tokens
            segments[i] = [_segment("text", 0, 2), _segment("image", 2, h * w, (h, w), "bidirectional"),
                           _segment("text", 2 + h * w, len(tail))]
        return _output(batch, token_lists, segments, errors)


class AudioPoolWorker(TextPoolWorker):
    """RVQ-tokenize audio files with their transcripts, into one sample each.

    Layout: `<bos> <boa> | frames x L codes, frame-major (level 1 first) | <eoa> transcript <eos>`,
    segments text (causal) | audio (window, grid [frames, L]) | text (causal). A level-l code c
    becomes the id `audio[l].start + c` of the manifest. Files are read in blocks of the bundle's
    `chunk_seconds`, downmixed, resampled to 16 kHz and encoded block by block, so an hours-long
    file costs one block of memory; unreadable files, zero-length audio, rates out of range and
    NaN/infinite samples are quarantined with the reason.
    """

    needs = ("text", "audio")

    def __init__(self, bundle_paths: dict[str, str], vocab: dict):
        import torch

        from tokenloom.tokenizers.audio import load_audio

        super().__init__(bundle_paths, vocab)
        manifest = VocabManifest.from_dict(vocab)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(1)
        self.model = load_audio(bundle_paths["audio"]).to(self.device)
        levels, size = self.model.levels, self.model.cfg.codebook_size
        if len(manifest.audio) != levels or any(r.size < size for r in manifest.audio):
            raise ValueError(f"audio bundle has {levels} levels of {size} codes but the manifest's audio ranges are "
                             f"{[(r.start, r.stop) for r in manifest.audio]}")
        self.level_offsets = np.array([r.start for r in manifest.audio], dtype=np.int64)
        self.boa, self.eoa = manifest.specials["<boa>"], manifest.specials["<eoa>"]

    def _encode(self, path: str) -> np.ndarray:
        from tokenloom.datasets.audio import probe, read_blocks
        from tokenloom.tokenizers.audio import encode_long

        info = probe(path)
        return encode_long(self.model, read_blocks(path, self.model.cfg.chunk_seconds), info.sample_rate)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from tokenloom.datasets.audio import AudioProblem

        errors = batch.column("error").to_pylist()
        payloads = batch.column("payload").to_pylist()
        media = batch.column("media").to_pylist()
        token_lists: list[np.ndarray | None] = [None] * batch.num_rows
        segments: list[list[dict] | None] = [None] * batch.num_rows
        codes: dict[int, np.ndarray] = {}
        for i, err in enumerate(errors):
            if err is None and media[i] is not None:
                try:
                    codes[i] = self._encode(media[i])
                except AudioProblem as exc:
                    errors[i] = str(exc)
        good = [i for i, err in enumerate(errors) if err is None]
        texts = self.tokenizer.encode_batch([payloads[i] or "" for i in good]) if good else []
        for i, text in zip(good, texts, strict=True):
            if i not in codes:  # a text-only record of a pairs file
                token_lists[i] = _text_tokens(text, self.offset, self.bos, self.eos)
                segments[i] = [_segment("text", 0, len(token_lists[i]))]
                continue
            frames, levels = codes[i].shape
            audio_ids = (codes[i] + self.level_offsets[None, :]).reshape(-1).astype(np.int32)  # frame-major
            tail = _text_tokens(text, self.offset, self.eoa, self.eos)  # <eoa> transcript <eos>
            token_lists[i] = np.concatenate([np.array([self.bos, self.boa], dtype=np.int32), audio_ids, tail])
            segments[i] = [_segment("text", 0, 2), _segment("audio", 2, frames * levels, (frames, levels), "window"),
                           _segment("text", 2 + frames * levels, len(tail))]
        return _output(batch, token_lists, segments, errors)


WORKERS = {"text": TextPoolWorker, "image": ImagePoolWorker, "audio": AudioPoolWorker}
