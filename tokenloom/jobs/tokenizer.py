"""Tokenizer jobs: train a tokenizer into a bundle, evaluate a bundle on files, decode a sample.

The media tokenizers go through one path: `tokenizers.registry` gives each kind's training and
evaluation behind one signature, `datasets.media` reads its files the way ingestion would, and
this job only wires them to the home (bundle store, run folders, eval folders).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenloom.datasets import media, sources
from tokenloom.jobs.home import Home, open_catalog
from tokenloom.tokenizers import bundle as bundles
from tokenloom.tokenizers.registry import TrainedBundle, neural_tokenizer
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart, VideoPart
from tokenloom.tokenizers.text import train_text_tokenizer


def corpus_texts(paths: Sequence[str | Path]) -> Iterator[str]:
    """Good text records of the given files/folders (bad ones are skipped, as ingestion would)."""
    files, _ = sources.discover(paths)
    for src in files:
        if src.modality != "text":
            continue
        for rec in sources.parse_file(src.path, "text", Path(src.path).read_bytes()):
            if rec.payload is not None:
                yield rec.payload


def train_text(home: Home, corpus: Sequence[str | Path], cfg) -> bundles.BundleInfo:
    texts = corpus_texts(corpus)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"no usable text found under {', '.join(map(str, corpus))}")
    return train_text_tokenizer(_chain(first, texts), home.bundles, cfg.text_tokenizer)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def config_section(kind: str) -> str:
    """The run config section of a media tokenizer kind ("visual" -> "visual_tokenizer")."""
    return neural_tokenizer(kind).section


def train(home: Home, kind: str, inputs: Sequence[str | Path], cfg, heldout: Sequence[str | Path] = (),
          run_name: str | None = None, resume: bool = False, progress: bool = True,
          arrays: tuple[list, list] | None = None) -> tuple[TrainedBundle, list[tuple[str, str]]]:
    """Train a media tokenizer of `kind` on files (or on given (train, held-out) arrays): the
    trained bundle and the files rejected with their reasons."""
    spec = neural_tokenizer(kind)
    section = getattr(cfg, spec.section)
    section.validate()
    if resume and not run_name:
        raise ValueError("--resume needs --run NAME (the run folder to continue)")
    rejected: list[tuple[str, str]] = []
    if arrays is None:
        train_items, held_items, rejected = media.train_and_heldout(spec.media, inputs, heldout)
        arrays = ([a for _, a in train_items], [a for _, a in held_items])
    trained = spec.train(arrays[0], arrays[1], section, home.bundles, home.new_dir(kind, run_name),
                         resume=resume, progress=progress)
    return trained, rejected


def evaluate(home: Home, kind: str, bundle_ref: str, inputs: Sequence[str | Path], out_dir: Path | None = None,
             max_seconds: float = 30.0, **options) -> dict:
    """Metrics of a media bundle on anyone's files (audio: the first `max_seconds` of each),
    with pictures/recordings and a metrics.json in `out_dir`."""
    spec = neural_tokenizer(kind)
    unknown = set(options) - set(spec.options)
    if unknown:
        raise ValueError(f"{kind} evaluation takes no option {sorted(unknown)}")
    info = home.bundle(bundle_ref, kind)
    good, bad = media.READERS[spec.media](inputs, max_seconds)
    if not good:
        raise ValueError(f"no usable {media.NOUNS[spec.media]} under {', '.join(map(str, inputs))}"
                         + (f" ({len(bad)} rejected, e.g. {bad[0][0]}: {bad[0][1]})" if bad else ""))
    out_dir = Path(out_dir or home.new_dir(info.id, folder="evals"))
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = spec.evaluate(info.path, [a for _, a in good], [p for p, _ in good], out_dir, **options)
    doc["rejected"] = [{"path": p, "reason": r} for p, r in bad]
    (out_dir / "metrics.json").write_text(json.dumps(doc, indent=2))
    return doc


def decode_sample(home: Home, cfg, dataset: str, sample: str, out: Path, at: str | None = None,
                  levels: int | None = None) -> dict:
    """A committed sample back to files: its images as PNG, its audio as WAV (from the first
    `levels` RVQ levels, all by default), its text parts as text."""
    from pyiceberg.expressions import EqualTo

    rows = open_catalog(home, cfg).scan(dataset, at=at, where=EqualTo("sample_id", sample),
                                        columns=("sample_id", "tokens", "segments", "vocab_id")).to_pylist()
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no sample {sample!r}")
    vocab = home.manifest(rows[0]["vocab_id"])
    parts = SampleLayout(vocab).disassemble(rows[0]["tokens"], rows[0]["segments"])
    needs = {"text": TextPart in map(type, parts),
             "visual": any(isinstance(p, (ImagePart, VideoPart)) for p in parts),
             "audio": any(isinstance(p, AudioPart) or (isinstance(p, VideoPart) and p.audio) for p in parts)}
    decoders = {}
    for kind in (k for k, needed in needs.items() if needed):
        if not vocab.bundles.get(kind):
            raise ValueError(f"sample {sample} needs the {kind} tokenizer but its vocabulary names no {kind} bundle")
        decoders[kind] = part_decoder(home, kind, vocab.bundles[kind], levels)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = {"dataset": dataset, "sample_id": sample, "images": [], "audio": [], "videos": [], "text": []}
    files = {ImagePart: (".png", "images", "visual"), AudioPart: (".wav", "audio", "audio"),
             VideoPart: (".mp4", "videos", None)}
    counts = {t: sum(isinstance(p, t) for p in parts) for t in files}
    seen = dict.fromkeys(counts, 0)
    for part in parts:
        if isinstance(part, TextPart):
            doc["text"].append(decoders["text"](part))
            continue
        kind = type(part)
        suffix, key, decoder = files[kind]
        stem = out.with_suffix("") if out.suffix.lower() == suffix else out
        target = stem.with_suffix(suffix) if counts[kind] == 1 else stem.with_name(f"{stem.name}-{seen[kind]}{suffix}")
        seen[kind] += 1
        if kind is VideoPart:
            _write_video(part, target, decoders)
        else:
            decoders[decoder](part, target)
        doc[key].append(str(target))
    if not parts:
        raise ValueError(f"sample {sample} has no image, audio, video or text to decode")
    return doc


def _write_video(part: VideoPart, target: Path, decoders: dict) -> None:
    """A video part as an MP4: frames decoded by the visual tokenizer at their times, the sound
    intervals decoded by the audio tokenizer and laid at their own times (silence where none)."""
    import numpy as np

    from tokenloom.datasets.video import write_video

    frames = np.stack([decoders["visual"](ImagePart(codes), None) for codes in part.frames])
    sound = None
    if part.audio:
        rate = decoders["audio"].sample_rate
        pieces = [(int(ms) * rate // 1000, decoders["audio"](AudioPart(codes), None))
                  for ms, codes in zip(part.audio_times, part.audio, strict=True) if len(codes)]
        sound = np.zeros(max(start + len(wav) for start, wav in pieces), dtype=np.float32)
        for start, wav in pieces:
            sound[start:start + len(wav)] = wav
    write_video(target, frames, part.times, sound)


def part_decoder(home: Home, kind: str, bundle_id: str, levels: int | None, per_token: bool = False):
    """A function that writes one part decoded with the bundle `bundle_id` to a file (or, given no
    file, returns its pixels or samples); with
    `per_token` a text part decodes to the list of its tokens' strings (the report shows them)."""
    path = home.bundle(bundle_id, kind).path
    if kind == "text":
        from tokenloom.tokenizers.text import TextTokenizer

        tok = TextTokenizer.load(path)
        if per_token:
            return lambda part: [tok.decode([int(i)]) for i in part.ids]
        return lambda part: tok.decode(part.ids.tolist())
    import torch

    if kind == "visual":
        from PIL import Image

        from tokenloom.tokenizers.visual import load_visual, to_pixels

        model = load_visual(path)

        def draw(part: ImagePart, target: Path | None):
            pixels = to_pixels(model.decode(torch.from_numpy(part.codes)[None])[0])
            if target is None:
                return pixels
            Image.fromarray(pixels).save(target, format="PNG")

        return draw
    import soundfile as sf

    from tokenloom.tokenizers.audio import load_audio

    model = load_audio(path)
    if levels is not None and not 1 <= levels <= model.levels:
        raise ValueError(f"--levels must be 1..{model.levels} for this bundle, got {levels}")

    def write(part: AudioPart, target: Path | None):
        wav = model.decode(torch.from_numpy(part.codes)[None], levels)[0, 0].clamp(-1, 1).numpy()
        if target is None:
            return wav
        sf.write(target, wav, model.cfg.sample_rate, subtype="PCM_16")

    write.sample_rate = model.cfg.sample_rate
    return write
