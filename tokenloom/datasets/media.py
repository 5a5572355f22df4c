"""Media files read the way ingestion reads them, for the jobs that train and evaluate tokenizers.

A tokenizer trained or evaluated on files must see exactly what the ingestion pools would feed
it: the same discovery (folders walked, pairs files followed, sidecars skipped), the same image
normalization (`images.decode_image`) and the same audio path (`audio.read_mono`: blocks,
downmix, resampling). Unusable files come back as (path, reason), never as an exception, so a
caller can report them and go on. One reader per modality, in `READERS`, with one signature.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tokenloom.datasets import sources

Items = list[tuple[str, np.ndarray]]  # (path, decoded array)
Rejected = list[tuple[str, str]]  # (path, reason)


def load_images(paths: Sequence[str | Path], max_seconds: float | None = None) -> tuple[Items, Rejected]:
    """Image files under `paths` as (H, W, 3) uint8 RGB arrays (`max_seconds` is ignored)."""
    from tokenloom.datasets.images import decode_image

    files, skipped = sources.discover(paths)
    good, bad = [], list(skipped)
    for src in files:
        if src.modality not in ("image", sources.REFERENCED) or src.path.lower().endswith(".jsonl"):
            continue
        decoded, problem = decode_image(Path(src.path).read_bytes())
        if problem:
            bad.append((src.path, problem))
        else:
            good.append((src.path, decoded.pixels))
    return good, bad


def load_audio(paths: Sequence[str | Path], max_seconds: float | None = None) -> tuple[Items, Rejected]:
    """Audio files under `paths` as 16 kHz mono float32 arrays, at most `max_seconds` each."""
    from tokenloom.datasets.audio import AudioProblem, read_mono

    files, skipped = sources.discover(paths)
    good, bad = [], list(skipped)
    limit = int(max_seconds * 16_000) if max_seconds else None
    for src in files:
        if src.modality not in ("audio", sources.REFERENCED) or sources.ROUTES.get(Path(src.path).suffix.lower()) != "audio":
            continue
        try:
            parts, total = [], 0
            for block in read_mono(src.path, 30.0):
                parts.append(block)
                total += len(block)
                if limit and total >= limit:
                    break
            good.append((src.path, np.concatenate(parts)[:limit]))
        except AudioProblem as exc:
            bad.append((src.path, str(exc)))
    return good, bad


READERS: dict[str, Callable[..., tuple[Items, Rejected]]] = {"image": load_images, "audio": load_audio}
NOUNS = {"image": "images", "audio": "audio files"}  # for messages


def split_heldout(items: Items, fraction: float) -> tuple[Items, Items]:
    """A stable held-out split by path hash: at least one item held out and one kept."""
    ranked = sorted(items, key=lambda it: hashlib.sha256(it[0].encode()).hexdigest())
    n = min(len(ranked) - 1, max(1, round(len(ranked) * fraction)))
    held = {id(it) for it in ranked[:n]}
    return [it for it in items if id(it) not in held], [it for it in items if id(it) in held]


def train_and_heldout(modality: str, inputs: Sequence[str | Path], heldout: Sequence[str | Path] = (),
                      fraction: float = 0.1) -> tuple[Items, Items, Rejected]:
    """Training and held-out media of one modality: the explicit held-out files, or a `fraction`
    of the inputs by path hash. ValueError when either side would be empty."""
    read = READERS[modality]
    train, rejected = read(inputs)
    if heldout:
        held, more = read(heldout)
        rejected += more
    elif len(train) >= 2:
        train, held = split_heldout(train, fraction)
    else:
        held = []
    if not train or not held:
        raise ValueError(f"need at least two usable {NOUNS[modality]} (one held out) under "
                         f"{', '.join(map(str, inputs))}; found {len(train) + len(held)}"
                         + (f", rejected {len(rejected)}: {rejected[0][1]}" if rejected else ""))
    return train, held, rejected
