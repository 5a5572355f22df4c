"""The trainer's view of a batch of responses: rows to feed, and each response token's log-probability.

A response is trained in its whole context (`<bos>`, prompt, hint, response), laid out as the
stream lays out a text sample (t = 0..n-1, one causal segment), so the log-probability the trainer
computes for a token is the one generation computed for it, up to numerics. Response token j of a
row sits at position s = len(prompt) + len(hint) + j and is scored by position s - 1; only those
positions go through the output head (the vocabulary projection is the largest activation).

Shapes: B responses, P positions (the longest context), T token slots (the longest response), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.contract import MODALITY_IDS


@dataclass
class ResponseBatch:
    ids: torch.Tensor  # [B, P, 1]
    coords: torch.Tensor  # [B, P, 3]
    where: torch.Tensor  # [B, T] the position that scores each response token (0 where masked)
    targets: torch.Tensor  # [B, T] response token ids (pad where masked)
    mask: torch.Tensor  # [B, T] bool: a response token (hints and padding excluded)
    logp_infer: torch.Tensor  # [B, T] behaviour log-probs
    versions: torch.Tensor  # [B, T] policy version of each token (-1 where masked)
    modality: torch.Tensor  # [B, T] the modality id of each response token

    def rows(self, select: slice) -> ResponseBatch:
        return ResponseBatch(*(getattr(self, f)[select] for f in self.__dataclass_fields__))


def response_batch(contexts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
                   versions: list[list[int]], pad: int) -> ResponseBatch:
    """contexts: each response's tokens before it (prompt and hint); responses: its sampled tokens."""
    if not responses or any(not r for r in responses):
        raise ValueError("every response in a training batch needs at least one token")
    B, P = len(responses), max(len(c) + len(r) for c, r in zip(contexts, responses, strict=True))
    T = max(len(r) for r in responses)
    ids = np.full((B, P), pad, dtype=np.int64)
    where, targets = np.zeros((B, T), dtype=np.int64), np.full((B, T), pad, dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    lp, ver = np.zeros((B, T), dtype=np.float32), np.full((B, T), -1, dtype=np.int64)
    for b, (ctx, resp) in enumerate(zip(contexts, responses, strict=True)):
        n = len(ctx) + len(resp)
        ids[b, :n] = ctx + resp
        k = len(resp)
        where[b, :k] = np.arange(len(ctx) - 1, n - 1)
        targets[b, :k], mask[b, :k] = resp, True
        lp[b, :k], ver[b, :k] = logprobs[b], versions[b]
    t = torch.arange(P)
    coords = torch.stack([t, t, t], -1)[None].expand(B, -1, -1).clone()
    return ResponseBatch(torch.from_numpy(ids)[..., None], coords, torch.from_numpy(where), torch.from_numpy(targets),
                         torch.from_numpy(mask), torch.from_numpy(lp), torch.from_numpy(ver),
                         torch.full((B, T), MODALITY_IDS["text"], dtype=torch.long))


def model_batch(batch: ResponseBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's input columns for the rows (text only: one causal segment per row)."""
    B, P = batch.ids.shape[:2]
    zeros = torch.zeros(B, P, dtype=torch.long, device=device)
    return {"ids": batch.ids.to(device), "coords": batch.coords.to(device),
            "modality": torch.full((B, P), MODALITY_IDS["text"], dtype=torch.long, device=device),
            "segment_ids": zeros, "doc_ids": zeros, "attention": zeros, "window": zeros}


def token_logprobs(model, batch: ResponseBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (log pi of each response token [B, T], the response positions' logits [B, T, V], routing aux loss)."""
    h, aux = model.forward(model_batch(batch, device))
    picked = h.gather(1, batch.where.to(device)[..., None].expand(-1, -1, h.shape[-1]))  # [B, T, D]
    logits = model.head(picked).float()
    logp = logits.log_softmax(-1).gather(-1, batch.targets.to(device)[..., None])[..., 0]
    return logp, logits, aux
