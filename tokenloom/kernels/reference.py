"""Dense FlashMask reference: indices -> boolean Sq x Sk mask -> scaled_dot_product_attention.

It materializes the whole mask on purpose: it is the ground truth every kernel is tested against,
so it shares nothing with them but the meaning of the indices (`indices.canonical_indices`).
Rows whose every key is masked give zeros, as in the kernels (SDPA alone would give NaN there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .indices import canonical_indices, check_indices, masked_rows


def dense_allowed_mask(
    startend_row_indices: torch.Tensor, *, causal: bool, seq_q: int, query_heads: int | None = None
) -> torch.Tensor:
    """Indices [B, H, Sk, n] -> bool [B, H or query_heads, Sq, Sk], True where attention is allowed."""
    allowed = ~masked_rows(canonical_indices(startend_row_indices, causal=causal, seq_q=seq_q), seq_q)
    if query_heads is not None and allowed.shape[1] != 1:
        allowed = allowed.repeat_interleave(query_heads // allowed.shape[1], dim=1)
    return allowed


def flashmask_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> [B, Sq, Hq, D], by SDPA with the dense boolean mask."""
    batch, seq_q, query_heads, _ = q.shape
    kv_heads = k.shape[2]
    check_indices(startend_row_indices, causal=causal, batch=batch, kv_heads=kv_heads, seq_k=k.shape[1])
    allowed = dense_allowed_mask(startend_row_indices, causal=causal, seq_q=seq_q, query_heads=query_heads)
    any_allowed = allowed.any(dim=-1, keepdim=True)
    safe = allowed | ~any_allowed
    group = query_heads // kv_heads
    qh = rearrange(q, "b s h d -> b h s d")
    kh = rearrange(k, "b s h d -> b h s d").repeat_interleave(group, dim=1)
    vh = rearrange(v, "b s h d -> b h s d").repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=safe, scale=scale)
    out = out * any_allowed.to(out.dtype)
    return rearrange(out, "b h s d -> b s h d")
