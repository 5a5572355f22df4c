"""Validation loss of a model (or one of its elastic sub-models) on a snapshot's shards, per modality.

Images and audio are about 1% of a corpus, so a few batches of one shuffled stream often hold no
image or audio target at all. The shards are partitioned by modality mix (a data file holds one
mix), so the files are grouped by mix and each group is its own stream, read for `batches`
batches: every modality the split holds gets targets, and the cost stays bounded (`batches`
times the number of mixes). A group's stream stops early once it has begun its split again (its
epoch counter moved on), so a small split is not read over and over; the stream is endless and
its packer looks ahead (a window of pending pieces), so the rows read before that point can
still repeat samples of a split smaller than a few rows. `tokens_<m>` counts the targets
evaluated, repeats included: an exact single pass needs a one-pass mode of `TokenStream`.

The rows are the first batches of each group's stream with the given settings, so two models
evaluated with the same arguments see exactly the same positions. Losses are token-weighted means
per target modality (an audio frame counts its L codes), with the number of targets each rests
on. With several ranks each rank reads its share of every group (the stream's rank split) and the
sums are all-reduced; every rank runs the same number of batches (expert parallelism needs each
forward on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pyarrow.parquet as pq
import torch

from tokenloom.catalog.uris import filesystem_and_path
from tokenloom.contract import MODALITIES
from tokenloom.datasets import ShardFile, StreamConfig, TokenStream
from tokenloom.datasets.stream import EpochOrder, NoSampleFits
from tokenloom.model.elastic import SubModel
from tokenloom.model.unified import UnifiedModel, mask_indices

UNKNOWN_MIX = "mixed"  # files without a `modalities` column (hand-written shards) form one group


def mix_of(file: ShardFile) -> str:
    """A data file's modality mix (the partition key every row of it shares), or UNKNOWN_MIX."""
    filesystem, inner = filesystem_and_path(file.path)
    try:
        if "modalities" not in pq.read_schema(inner, filesystem=filesystem).names:
            return UNKNOWN_MIX
        column = pq.read_table(inner, columns=["modalities"], filesystem=filesystem).column("modalities")
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read token shard {file.path}: {exc}") from exc
    mixes = set(column.unique().to_pylist())
    return str(mixes.pop()) if len(mixes) == 1 else UNKNOWN_MIX


def group_by_mix(files: Sequence[ShardFile]) -> dict[str, list[ShardFile]]:
    """The files (with rows) by modality mix, in a fixed order."""
    groups: dict[str, list[ShardFile]] = {}
    for f in files:
        if f.num_rows > 0:
            groups.setdefault(mix_of(f), []).append(f)
    return dict(sorted(groups.items()))


def _all_reduce(values: torch.Tensor, world: int, op=None) -> torch.Tensor:
    if world == 1:
        return values
    if torch.distributed.get_backend() == "nccl":  # NCCL reduces only CUDA tensors
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    torch.distributed.all_reduce(values, op=op or torch.distributed.ReduceOp.SUM)
    return values.cpu()


@torch.no_grad()
def evaluate(model: UnifiedModel, files: Sequence[ShardFile], stream_cfg: StreamConfig, batches: int = 8,
             micro_batch_size: int = 8, sub: SubModel | None = None, rank: int = 0, world_size: int = 1,
             groups: dict[str, list[ShardFile]] | None = None, autocast=None) -> dict:
    """Loss per target modality: `loss_<m>` (None where no target), `tokens_<m>` (targets counted),
    `loss` and `tokens` over all, `rows` evaluated (all ranks) and `mixes` (the split's rows per mix).

    `groups`: `group_by_mix(files)` when the caller has it; `autocast`: the training precision's
    context. The model is put in eval mode and left there; a trainer puts it back."""
    if batches < 1 or micro_batch_size < 1:
        raise ValueError(f"evaluation needs batches >= 1 and micro_batch_size >= 1, got {batches}, {micro_batch_size}")
    if stream_cfg.split == "val" and stream_cfg.holdout <= 0:
        raise ValueError("the validation split needs stream.holdout > 0 (the fraction of samples held out)")
    model.eval()
    device = next(model.parameters()).device
    groups = group_by_mix(files) if groups is None else groups
    sums = torch.zeros(len(MODALITIES), dtype=torch.float64)
    counts = torch.zeros(len(MODALITIES), dtype=torch.float64)
    rows_read, mixes = 0, {}
    for mix, members in groups.items():
        split_rows = EpochOrder(members, stream_cfg.seed, 0, stream_cfg.shuffle_window, stream_cfg.holdout,
                                stream_cfg.split).total
        mixes[mix] = split_rows
        if split_rows < world_size:  # the same on every rank: a fixed function of the files
            continue
        stream = TokenStream(members, stream_cfg, rank=rank, world_size=world_size)
        rows = stream.batches(micro_batch_size)
        for _ in range(batches):
            raw = None
            if stream.state.epoch == 0:  # else the split was read through: this mix is done
                # NoSampleFits: e.g. an audio-only mix whose clips are all longer than a row
                with contextlib.suppress(NoSampleFits):
                    raw = next(rows)
            # every rank stops together when one has nothing (a lone rank would hang the reduce)
            stop = torch.tensor([float(raw is None)])
            if float(_all_reduce(stop, world_size, torch.distributed.ReduceOp.MAX if world_size > 1 else None)):
                break
            raw.pop("fill_ratio", None)  # a packing figure, not a model input
            batch = {k: torch.from_numpy(v).to(device) for k, v in raw.items()}  # (their own dtype, as the trainer's)
            with autocast or contextlib.nullcontext():
                _, parts = model.loss(batch, sub, indices=mask_indices(batch))
            sums += torch.stack([parts[f"sum_{m}"].double().cpu() for m in MODALITIES])
            counts += torch.stack([parts[f"count_{m}"].double().cpu() for m in MODALITIES])
            rows_read += micro_batch_size
    total = _all_reduce(torch.cat([sums, counts, torch.tensor([float(rows_read)], dtype=torch.float64)]), world_size)
    n = len(MODALITIES)
    sums, counts = total[:n], total[n : 2 * n]
    out: dict = {f"loss_{m}": (float(sums[i] / counts[i]) if counts[i] > 0 else None) for i, m in enumerate(MODALITIES)}
    out.update({f"tokens_{m}": int(counts[i]) for i, m in enumerate(MODALITIES)})
    out["loss"] = float(sums.sum() / counts.sum()) if counts.sum() > 0 else None
    out["tokens"] = float(counts.sum())
    out["rows"] = int(total[-1])
    out["mixes"] = mixes
    return out


def by_modality(result: dict | None, reason: str | None = None) -> dict:
    """An evaluation as {modality: {"loss", "tokens"[, "reason"]}}: a modality without held-out
    targets has loss None and says why (`reason`: why there was no evaluation at all)."""
    out = {}
    for m in MODALITIES:
        if result is None:
            out[m] = {"loss": None, "tokens": 0, "reason": reason}
        elif result[f"loss_{m}"] is None:
            out[m] = {"loss": None, "tokens": 0,
                      "reason": f"no {m} targets in the {result['rows']} held-out rows evaluated"}
        else:
            out[m] = {"loss": result[f"loss_{m}"], "tokens": result[f"tokens_{m}"]}
    return out
