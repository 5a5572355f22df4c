"""`flashmask_attention`: validate once, canonicalize the indices, then pick a backend.

The Triton kernel is chosen for CUDA tensors in bf16/fp16 with a head dim it is built for. Other
cases go to PyTorch: short sequences (Sq x Sk up to DENSE_MAX_PAIRS) to the dense path, which
expands the intervals into a boolean mask for `scaled_dot_product_attention` (at 256 positions
that is ~2x faster on a CPU than tiling, and the mask is small); longer ones to the tiled path,
which never materialises the mask. The Triton module is imported only when chosen, so importing
tokenloom.kernels never touches Triton or a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .indices import canonical_indices, check_indices, masked_rows
from .tiled import flashmask_tiled

BACKENDS = ("auto", "torch", "dense", "triton")
DENSE_MAX_PAIRS = 1024 * 1024  # (query, key) pairs up to which the dense path is chosen
TRITON_DTYPES = (torch.bfloat16, torch.float16)
TRITON_HEAD_DIMS = (16, 32, 64, 128)


def choose_backend(q: torch.Tensor, seq_k: int | None = None) -> str:
    """'triton' for CUDA bf16/fp16 with a supported head dim; else 'dense' for short sequences
    (when `seq_k` is given) and 'torch' (tiled) for long ones."""
    if q.is_cuda and q.dtype in TRITON_DTYPES and q.shape[-1] in TRITON_HEAD_DIMS:
        return "triton"
    if seq_k is not None and q.shape[1] * seq_k <= DENSE_MAX_PAIRS:
        return "dense"
    return "torch"


def flashmask_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, canonical: torch.Tensor, *,
                    scale: float) -> torch.Tensor:
    """The intervals expanded to a boolean mask for SDPA (in fp32, like the tiled path, whatever the
    input dtype or autocast); rows that see no key return zeros."""
    allowed = ~masked_rows(canonical, q.shape[1])  # [B, Hk or 1, Sq, Sk]
    if allowed.shape[1] not in (1, q.shape[2]):
        allowed = allowed.repeat_interleave(q.shape[2] // allowed.shape[1], dim=1)
    seen = allowed.any(-1, keepdim=True)
    allowed = allowed | ~seen  # keep SDPA finite on empty rows; they are zeroed below
    with torch.autocast(q.device.type, enabled=False):  # fp32 arithmetic, as on the tiled path
        y = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), attn_mask=allowed,
                                           scale=scale, enable_gqa=q.shape[2] != k.shape[2]).to(q.dtype)
    return (y * seen).transpose(1, 2)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise ValueError("sequence lengths must be at least 1")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """FlashMask attention. q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (Hq % Hk == 0) -> [B, Sq, Hq, D].

    `startend_row_indices` is int32 [B, Hk or 1, Sk, 1|2|4] as documented in `indices`. Rows that
    see no key return zeros. Differentiable in q, k and v.
    """
    check_inputs(q, k, v)
    batch, seq_q, _, head_dim = q.shape
    check_indices(startend_row_indices, causal=causal, batch=batch, kv_heads=k.shape[2], seq_k=k.shape[1])
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    canonical = canonical_indices(startend_row_indices.to(q.device), causal=causal, seq_q=seq_q)
    chosen = choose_backend(q, k.shape[1]) if backend == "auto" else backend
    if chosen == "dense":
        return flashmask_dense(q, k, v, canonical, scale=scale)
    if chosen == "triton":
        from .triton_flashmask import flashmask_triton

        return flashmask_triton(q, k, v, canonical, scale=scale)
    return flashmask_tiled(q, k, v, canonical, scale=scale)
