"""Deduplication: content keys per record, and which records to drop given everyone's keys.

Two halves, both pure. The *keys* are computed where a record is decoded (on the pool
actors): an exact content hash of the normalized record (text: NFKC + casefold + collapsed
whitespace; image: decoded pixels with shape, plus normalized caption; audio: the decoded
16 kHz mono samples as int16, plus normalized transcript), a MinHash of a text's word
5-gram shingles (`datasketch`) and a 64-bit perceptual hash of an image (`imagehash.phash`).

The *decision* (`find_duplicates`) sees every key of a job and of the dataset's current
samples, and is deterministic whatever order the tasks ran in: the dataset's existing samples
are always kept (earlier jobs first); the job's new samples are visited in (source, record)
order, with record positions compared as numbers ("line 2" before "line 10"); a sample is
dropped when it matches a sample already kept: same content hash (exact), estimated Jaccard
>= threshold over LSH candidates (near-text), phash Hamming distance <= threshold
(near-image). Matching only kept samples means a chain a~b~c with a !~ c drops b only.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PHASH_BITS = 64
# Stored signatures stay comparable only while these two stay fixed: datasketch's 32-bit scheme
# (uint32 values; it mixes each input hash with a murmur finalizer before permuting) over CRC-32
# of each shingle: C code with no Python frame per shingle, 4x faster than the SHA-1 default.
MINHASH_SCHEME = "affine32"
SHINGLE_HASH = zlib.crc32
_NUMBER = re.compile(r"(\d+)")


def normalize_text(text: str | None) -> str:
    """NFKC, casefolded, whitespace collapsed to single spaces and stripped."""
    return " ".join(unicodedata.normalize("NFKC", text or "").casefold().split())


def text_hash(text: str) -> str:
    return hashlib.sha256(b"text\0" + normalize_text(text).encode()).hexdigest()


def image_hash(pixels: np.ndarray, caption: str | None) -> str:
    """Of the decoded (H, W, 3) uint8 pixels (shape and bytes) and the normalized caption."""
    digest = hashlib.sha256(b"image\0" + repr(tuple(pixels.shape)).encode() + b"\0")
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    digest.update(b"\0" + normalize_text(caption).encode())
    return digest.hexdigest()


def video_hash(frames: np.ndarray, sound: str | None, caption: str | None) -> str:
    """Of a video's sampled frames [K, H, W, 3] (shape and bytes), its sound track's `AudioHasher`
    digest (None without sound) and the normalized caption."""
    digest = hashlib.sha256(b"video\0" + repr(tuple(frames.shape)).encode() + b"\0")
    digest.update(np.ascontiguousarray(frames, dtype=np.uint8).tobytes())
    digest.update(b"\0" + (sound or "").encode() + b"\0" + normalize_text(caption).encode())
    return digest.hexdigest()


class AudioHasher:
    """Streaming hash of decoded mono float blocks, quantized to int16, plus the transcript."""

    def __init__(self):
        self._digest = hashlib.sha256(b"audio\0")

    def update(self, block: np.ndarray) -> None:
        q = np.clip(np.rint(np.asarray(block, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")
        self._digest.update(q.tobytes())

    def hexdigest(self, transcript: str | None) -> str:
        digest = self._digest.copy()
        digest.update(b"\0" + normalize_text(transcript).encode())
        return digest.hexdigest()


def shingles(text: str, size: int = 5) -> list[bytes]:
    """Distinct word `size`-grams of the normalized text; a shorter text is one shingle."""
    words = normalize_text(text).split(" ")
    if len(words) <= size:
        return [" ".join(words).encode()]
    # the shifted word lists are of unequal length on purpose: zip stops at the last whole gram
    grams = map(" ".join, zip(*(words[i:] for i in range(size)), strict=False))
    return [g.encode() for g in dict.fromkeys(grams)]


def minhashes(texts: Sequence[str], num_perm: int = 128, shingle_size: int = 5) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash signatures (datasketch `MinHash.bulk`, seed 1, CRC-32 shingles)."""
    from datasketch import MinHash

    if not texts:
        return np.zeros((0, num_perm), dtype=np.uint32)
    sketches = MinHash.bulk([shingles(t, shingle_size) for t in texts], num_perm=num_perm, scheme=MINHASH_SCHEME,
                            hashfunc=SHINGLE_HASH)
    return np.stack([m.hashvalues for m in sketches]).astype(np.uint32)


def phash(pixels: np.ndarray) -> int:
    """The 64-bit DCT perceptual hash (`imagehash.phash`) of (H, W, 3) uint8 pixels."""
    import imagehash
    from PIL import Image

    bits = imagehash.phash(Image.fromarray(np.ascontiguousarray(pixels))).hash.flatten()
    return int("".join("1" if b else "0" for b in bits), 2)


# -- the decision --------------------------------------------------------------------------

@dataclass(frozen=True)
class Keys:
    """What dedup knows of one sample. `existing`: already in the dataset (never dropped)."""

    sample_id: str
    source: str = ""
    record: str = ""
    content_hash: str | None = None
    minhash: np.ndarray | None = None  # uint32 [num_perm]; text samples
    phash: int | None = None  # image samples
    existing: bool = False


@dataclass(frozen=True)
class Drop:
    sample_id: str
    duplicate_of: str
    kind: str  # "exact", "near-text", "near-image"
    similarity: float
    reason: str


def natural_key(keys: Keys) -> tuple:
    """(source, record) with the numbers in `record` compared as numbers."""
    return keys.source, tuple(int(p) if p.isdigit() else p for p in _NUMBER.split(keys.record))


def find_duplicates(new: Sequence[Keys], existing: Sequence[Keys] = (), *, exact: bool = True,
                    minhash_threshold: float | None = 0.8, num_perm: int = 128,
                    phash_threshold: int | None = 12) -> list[Drop]:
    """The samples of `new` to drop, each with the kept sample it duplicates (module docstring).

    `existing` is kept in the order given (oldest job first); a threshold of None switches
    that kind of near-duplicate off. Returns drops in the order the samples were visited.
    """
    from datasketch import LeanMinHash, MinHashLSH

    if minhash_threshold is not None and not 0.0 < minhash_threshold <= 1.0:
        raise ValueError(f"minhash threshold must be in (0, 1], got {minhash_threshold}")
    if phash_threshold is not None and not 0 <= phash_threshold <= PHASH_BITS:
        raise ValueError(f"phash Hamming threshold must be in [0, {PHASH_BITS}], got {phash_threshold}")
    hashes: dict[str, str] = {}
    lsh = MinHashLSH(threshold=minhash_threshold, num_perm=num_perm) if minhash_threshold is not None else None
    signatures: dict[str, np.ndarray] = {}
    phashes = np.zeros(64, dtype=np.uint64)  # the kept images' hashes, grown by doubling
    phash_ids: list[str] = []

    def keep(k: Keys) -> None:
        if exact and k.content_hash is not None:
            hashes.setdefault(k.content_hash, k.sample_id)
        if lsh is not None and k.minhash is not None and k.sample_id not in signatures:
            signatures[k.sample_id] = k.minhash
            lsh.insert(k.sample_id, LeanMinHash(seed=1, hashvalues=k.minhash, scheme=MINHASH_SCHEME))
        nonlocal phashes
        if phash_threshold is not None and k.phash is not None:
            if len(phash_ids) == phashes.size:
                phashes = np.concatenate([phashes, np.zeros_like(phashes)])
            phashes[len(phash_ids)] = k.phash
            phash_ids.append(k.sample_id)

    for k in existing:
        keep(k)
    drops: list[Drop] = []
    for k in sorted(new, key=natural_key):
        if k.existing:
            raise ValueError(f"sample {k.sample_id} is marked existing but passed as new")
        if exact and k.content_hash is not None and k.content_hash in hashes:
            kept = hashes[k.content_hash]
            drops.append(Drop(k.sample_id, kept, "exact", 1.0, f"same normalized content as {kept}"))
            continue
        if lsh is not None and k.minhash is not None:
            best = _best_text_match(k.minhash, lsh.query(LeanMinHash(seed=1, hashvalues=k.minhash, scheme=MINHASH_SCHEME)), signatures)
            if best is not None and best[1] >= minhash_threshold:
                drops.append(Drop(k.sample_id, best[0], "near-text", best[1],
                                  f"estimated Jaccard {best[1]:.3f} >= {minhash_threshold} with {best[0]}"))
                continue
        if phash_threshold is not None and k.phash is not None and phash_ids:
            distance, kept = _nearest_phash(k.phash, phashes[:len(phash_ids)], phash_ids)
            if distance <= phash_threshold:
                drops.append(Drop(k.sample_id, kept, "near-image", 1.0 - distance / PHASH_BITS,
                                  f"phash Hamming distance {distance} <= {phash_threshold} from {kept}"))
                continue
        keep(k)
    return drops


def _best_text_match(signature: np.ndarray, candidates: list[str], signatures: dict[str, np.ndarray]):
    """(id, estimated Jaccard) of the most similar candidate; ties go to the smallest id."""
    if not candidates:
        return None
    ordered = sorted(candidates)
    estimates = (np.stack([signatures[c] for c in ordered]) == signature).mean(axis=1)
    best = int(np.argmax(estimates))
    return ordered[best], float(estimates[best])


def _nearest_phash(value: int, phashes: np.ndarray, ids: list[str]) -> tuple[int, str]:
    distances = np.bitwise_count(phashes ^ np.uint64(value))
    best = int(np.argmin(distances))  # the first kept at the smallest distance
    return int(distances[best]), ids[best]


def counts_by_kind(drops: Sequence[Drop]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in drops:
        out[d.kind] = out.get(d.kind, 0) + 1
    return dict(sorted(out.items()))
