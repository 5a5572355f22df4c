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


class TextPoolWorker:
    """BPE-encode `payload` texts; ids become unified ids wrapped in <bos> ... <eos>."""

    def __init__(self, bundle_path: str, vocab: dict):
        manifest = VocabManifest.from_dict(vocab)
        self.tokenizer = TextTokenizer.load(bundle_path)
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
            arr = np.empty(len(ids) + 2, dtype=np.int32)
            arr[0], arr[-1] = self.bos, self.eos
            arr[1:-1] = np.asarray(ids, dtype=np.int32) + self.offset
            token_lists[i] = arr
            segments[i] = [{"modality": "text", "start": 0, "length": len(arr), "grid": [], "attention": "causal"}]
        return pa.Table.from_arrays(
            [
                batch.column("sample_id"),
                batch.column("source"),
                batch.column("record"),
                pa.array(token_lists, type=OUT_SCHEMA.field("tokens").type),
                pa.array(segments, type=OUT_SCHEMA.field("segments").type),
                batch.column("error"),
            ],
            schema=OUT_SCHEMA,
        )


WORKERS = {"text": TextPoolWorker}
