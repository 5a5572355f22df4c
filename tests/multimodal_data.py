"""Small multimodal token shards in the shard contract's layout, for model and stream tests.

The vocabulary is a real manifest (400 ids: specials 0-15, text 16-199, visual 200-299, audio
level 0 300-349, level 1 350-399) and samples are laid out by `tokenizers.sequence`, the same
code the ingestion pools use: `<bos><boi> image <eoi> caption <eos>`, `<bos><boa> frames x 2
codes <eoa> transcript <eos>`, and plain text `<bos> text <eos>`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenloom.catalog.schema import SEGMENT_TYPE
from tokenloom.datasets import ShardFile
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart
from tokenloom.tokenizers.vocab import VocabManifest

MANIFEST = VocabManifest.build(184, visual_size=100, audio_levels=2, audio_codebook=50)
LAYOUT = SampleLayout(MANIFEST)
VOCAB = MANIFEST.size
AUDIO_RANGES = tuple((r.start, r.stop) for r in MANIFEST.audio)


def _text(rng, n):
    return TextPart(rng.integers(0, MANIFEST.text.size, n))


def image_sample(rng, h=3, w=4, caption=5):
    return LAYOUT.assemble([ImagePart(rng.integers(0, MANIFEST.visual.size, (h, w))), _text(rng, caption)])


def audio_sample(rng, frames=10, transcript=4):
    return LAYOUT.assemble([AudioPart(rng.integers(0, 50, (frames, 2))), _text(rng, transcript)])


def text_sample(rng, n=30):
    return LAYOUT.assemble([_text(rng, n - 2)])


def write_shard(path, samples, sample_ids=None) -> ShardFile:
    """A token shard of (tokens, segments) samples; with `sample_ids`, their ids too."""
    columns = {"tokens": pa.array([t.tolist() for t, _ in samples], pa.list_(pa.int32())),
               "segments": pa.array([s for _, s in samples], pa.list_(SEGMENT_TYPE))}
    if sample_ids is not None:
        columns["sample_id"] = pa.array(list(sample_ids), pa.string())
    pq.write_table(pa.table(columns), path)
    return ShardFile(str(path), len(samples))


def mixed_samples(seed=0, n=6, frames=(3, 12)):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out += [image_sample(rng), audio_sample(rng, int(rng.integers(*frames))), text_sample(rng, int(rng.integers(10, 40)))]
    return out
