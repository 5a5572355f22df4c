"""Small multimodal token shards in the shard contract's layout, for model and stream tests.

Vocabulary (400 ids): specials 0-15, text 16-199, visual 200-299, audio level 0 300-349, level 1 350-399.
Samples: `<bos><boi> image <eoi> caption <eos>`, `<bos><boa> frames x 2 codes <eoa> transcript <eos>`, plain text.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.datasets import ShardFile

VOCAB = 400
AUDIO_RANGES = ((300, 350), (350, 400))


def seg(modality, start, length, grid=(), attention=None):
    return {"modality": modality, "start": start, "length": length, "grid": list(grid),
            "attention": attention or {"text": "causal", "image": "bidirectional", "audio": "window"}[modality]}


def image_sample(rng, h=3, w=4, caption=5):
    toks = np.r_[1, 3, rng.integers(200, 300, h * w), 4, rng.integers(16, 200, caption), 2]
    return toks, [seg("text", 0, 2), seg("image", 2, h * w, (h, w)), seg("text", 2 + h * w, caption + 2)]


def audio_sample(rng, frames=10, transcript=4):
    codes = np.stack([rng.integers(300, 350, frames), rng.integers(350, 400, frames)], 1).reshape(-1)
    toks = np.r_[1, 5, codes, 6, rng.integers(16, 200, transcript), 2]
    return toks, [seg("text", 0, 2), seg("audio", 2, 2 * frames, (frames, 2)), seg("text", 2 + 2 * frames, transcript + 2)]


def text_sample(rng, n=30):
    return rng.integers(16, 200, n), [seg("text", 0, n)]


def write_shard(path, samples) -> ShardFile:
    pq.write_table(pa.table({
        "tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
        "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE)),
    }), path)
    return ShardFile(str(path), len(samples))


def mixed_samples(seed=0, n=6, frames=(3, 12)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out += [image_sample(rng), audio_sample(rng, int(rng.integers(*frames))), text_sample(rng, int(rng.integers(10, 40)))]
    return out
