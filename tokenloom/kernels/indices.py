"""FlashMask column-wise row intervals: what `startend_row_indices` means, and one canonical form.

FlashMask (Wang et al., ICLR 2025) describes a mask per *key column* j by at most two *row* intervals
that are masked:

    row i is masked for column j  iff  LTS[j] <= i < LTE[j]  or  UTS[j] <= i < UTE[j]

so a mask costs O(Sk) integers instead of Sq x Sk booleans. `startend_row_indices` is int32
`[batch, heads or 1, seq_k, n]`; `heads` is the number of key/value heads (or 1, shared by all).
The last dimension depends on `causal`, as in the paper and in PaddlePaddle:

    causal=True,  n=1: [LTS]                 LTE = Sq; nothing in the upper triangle
    causal=True,  n=2: [LTS, LTE]
    causal=False, n=2: [LTS, UTE]            LTE = Sq and UTS = 0: rows >= LTS and rows < UTE masked
    causal=False, n=4: [LTS, LTE, UTS, UTE]

With causal=True the causal mask (row i < column j masked, aligned at the top-left corner) applies
in addition. Values are clamped to [0, Sq], which changes nothing: rows live in [0, Sq).

Every kernel works on one canonical form, `[batch, heads or 1, seq_k, 4]` = (LTS, LTE, UTS, UTE),
in which the causal triangle is folded in as the upper interval [0, j) (a causal mask never uses
UTS/UTE, so the slot is free), and empty intervals are written as [Sq, Sq) and [0, 0). The
canonical form is therefore always non-causal, and a tile's min/max bounds stay tight.
"""

from __future__ import annotations

import torch

VALUES_PER_COLUMN = {True: (1, 2), False: (2, 4)}


def check_indices(startend_row_indices: torch.Tensor, *, causal: bool, batch: int, kv_heads: int, seq_k: int) -> None:
    """Raise ValueError when the indices do not fit the attention problem they are meant for."""
    idx = startend_row_indices
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"startend_row_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"startend_row_indices must be int32 (int64 accepted), got {idx.dtype}")
    if idx.dim() != 4:
        raise ValueError(
            f"startend_row_indices must be 4-D [batch, heads or 1, seq_k, 1|2|4], got shape {tuple(idx.shape)}"
        )
    b, h, s, n = idx.shape
    if b != batch or s != seq_k:
        raise ValueError(
            f"startend_row_indices shape {tuple(idx.shape)} does not match batch={batch}, seq_k={seq_k}"
        )
    if h not in (1, kv_heads):
        raise ValueError(f"startend_row_indices has {h} heads; expected 1 or the {kv_heads} key/value heads")
    allowed = VALUES_PER_COLUMN[bool(causal)]
    if n not in allowed:
        hint = (
            "a causal mask takes [LTS] or [LTS, LTE]; for an upper interval pass causal=False with 4 values"
            if causal
            else "a non-causal mask takes [LTS, UTE] or [LTS, LTE, UTS, UTE]; for [LTS] alone pass causal=True"
        )
        raise ValueError(f"startend_row_indices has {n} values per column with causal={causal}: {hint}")


def canonical_indices(startend_row_indices: torch.Tensor, *, causal: bool, seq_q: int) -> torch.Tensor:
    """[B, H, Sk, 1|2|4] in the paper's form -> int32 [B, H, Sk, 4] (LTS, LTE, UTS, UTE), non-causal."""
    idx = startend_row_indices.to(torch.int32).clamp(0, seq_q)
    b, h, seq_k, n = idx.shape
    full = torch.full((b, h, seq_k), seq_q, dtype=torch.int32, device=idx.device)
    zero = torch.zeros((b, h, seq_k), dtype=torch.int32, device=idx.device)
    if causal:
        lts = idx[..., 0]
        lte = idx[..., 1] if n == 2 else full
        column = torch.arange(seq_k, dtype=torch.int32, device=idx.device).clamp(max=seq_q)
        uts, ute = zero, column.expand(b, h, seq_k)
    elif n == 2:
        lts, lte, uts, ute = idx[..., 0], full, zero, idx[..., 1]
    else:
        lts, lte, uts, ute = idx.unbind(-1)
    lower_empty = lts >= lte
    upper_empty = uts >= ute
    lts = torch.where(lower_empty, full, lts)
    lte = torch.where(lower_empty, full, lte)
    uts = torch.where(upper_empty, zero, uts)
    ute = torch.where(upper_empty, zero, ute)
    return torch.stack([lts, lte, uts, ute], dim=-1).contiguous()


def masked_rows(canonical: torch.Tensor, seq_q: int) -> torch.Tensor:
    """Canonical [B, H, Sk, 4] -> bool [B, H, Sq, Sk], True where masked. Dense: for references only."""
    rows = torch.arange(seq_q, device=canonical.device).view(1, 1, seq_q, 1)
    lts, lte, uts, ute = (canonical[..., c].unsqueeze(2) for c in range(4))
    return ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
