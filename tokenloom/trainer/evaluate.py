"""Validation loss of a model (or one of its elastic sub-models) on a snapshot's shards.

The rows are the first `batches` x `micro_batch_size` rows of a stream with the given settings,
so two models evaluated with the same arguments see exactly the same positions. Losses are
token-weighted means per target modality (an audio frame counts its L codes).
"""

from __future__ import annotations

import torch

from tokenloom.contract import MODALITIES
from tokenloom.datasets import ShardFile, StreamConfig, TokenStream
from tokenloom.model.elastic import SubModel
from tokenloom.model.unified import UnifiedModel, mask_indices


@torch.no_grad()
def evaluate(model: UnifiedModel, files: list[ShardFile], stream_cfg: StreamConfig, batches: int = 8,
             micro_batch_size: int = 8, sub: SubModel | None = None) -> dict[str, float | None]:
    model.eval()
    stream = TokenStream(files, stream_cfg)
    rows = stream.batches(micro_batch_size)
    sums = dict.fromkeys(MODALITIES, 0.0)
    counts = dict.fromkeys(MODALITIES, 0.0)
    for _ in range(batches):
        batch = {k: torch.from_numpy(v).long() for k, v in next(rows).items()}
        _, parts = model.loss(batch, sub, indices=mask_indices(batch))
        for m in MODALITIES:
            sums[m] += float(parts[f"sum_{m}"])
            counts[m] += float(parts[f"count_{m}"])
    out: dict[str, float | None] = {f"loss_{m}": (sums[m] / counts[m] if counts[m] else None) for m in MODALITIES}
    total = sum(counts.values())
    out["loss"] = sum(sums.values()) / total if total else None
    out["tokens"] = float(total)
    return out

