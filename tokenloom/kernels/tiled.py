"""FlashMask in plain PyTorch: tiled online-softmax forward and backward that skip masked tiles.

This is the path a machine without a GPU trains on (and the fused kernel's twin). It never builds
an Sq x Sk mask: it loops over key tiles in Python and, for each, runs one batched matmul over
every query tile that is not fully masked against it (all batches and heads at once), masking
elementwise only the partial tiles, which are sorted first so their scores are a contiguous view.
Grouped-query heads that share a key/value head are folded into the rows of a query tile, so a
key tile is multiplied once per group rather than once per query head.

All arithmetic is fp32 whatever the input dtype (bf16 matmuls have no fast path on AVX2 CPUs, and
the softmax statistics need fp32 anyway); outputs and gradients come back in the input dtypes.
Rows that see no key at all produce zeros, and their log-sum-exp is stored as +inf so that the
backward's probabilities exp(s - lse) are exactly zero there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .tiles import FULL, SKIP, classify_tiles, column_tile_bounds, pad_columns

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
MAX_TILES_PER_STEP = 32  # 32 x (128 x 128) fp32 scores = 2 MiB per temporary


@dataclass(frozen=True)
class TilePlan:
    """The non-skipped tiles, grouped by key tile (partial ones first within each group)."""

    q_tile: torch.Tensor  # [n] index into the tiled query rows (b, kv head, query tile)
    k_tile: torch.Tensor  # [n] index into the tiled keys (b, kv head, key tile)
    col_tile: torch.Tensor  # [n] index into the tiled mask columns (b, index head, key tile)
    row0: torch.Tensor  # [n] first query row of the tile
    counts: list[int]  # non-skipped tiles per key tile
    partial_counts: list[int]  # of which partial


def make_plan(canonical: torch.Tensor, *, seq_q: int, kv_heads: int, block_q: int, block_k: int) -> TilePlan:
    batch, index_heads, seq_k, _ = canonical.shape
    tiles_q, tiles_k = -(-seq_q // block_q), -(-seq_k // block_k)
    classes = classify_tiles(column_tile_bounds(canonical, seq_q=seq_q, block_k=block_k), seq_q=seq_q, block_q=block_q)
    classes = classes.expand(batch, kv_heads, tiles_q, tiles_k)
    kt, b, h, qt = (classes.permute(3, 0, 1, 2) != SKIP).nonzero(as_tuple=True)
    is_full = classes[b, h, qt, kt] == FULL
    order = torch.argsort(kt * 2 + is_full.long(), stable=True)
    kt, b, h, qt, is_full = kt[order], b[order], h[order], qt[order], is_full[order]
    index_head = h if index_heads > 1 else torch.zeros_like(h)
    return TilePlan(
        q_tile=(b * kv_heads + h) * tiles_q + qt,
        k_tile=(b * kv_heads + h) * tiles_k + kt,
        col_tile=(b * index_heads + index_head) * tiles_k + kt,
        row0=qt * block_q,
        counts=torch.bincount(kt, minlength=tiles_k).tolist(),
        partial_counts=torch.bincount(kt[~is_full], minlength=tiles_k).tolist(),
    )


def tile_queries(x: torch.Tensor, kv_heads: int, block: int) -> torch.Tensor:
    """[B, S, Hq, D] -> fp32 [B * Hk * nQ, block * group, D]: rows ordered (row in tile, head in group)."""
    batch, seq, heads, dim = x.shape
    tiles = -(-seq // block)
    x = F.pad(x.float(), (0, 0, 0, 0, 0, tiles * block - seq))
    x = x.reshape(batch, tiles, block, kv_heads, heads // kv_heads, dim).permute(0, 3, 1, 2, 4, 5)
    return x.reshape(batch * kv_heads * tiles, block * (heads // kv_heads), dim)


def untile_queries(x: torch.Tensor, batch: int, seq: int, heads: int, kv_heads: int, block: int) -> torch.Tensor:
    tiles = -(-seq // block)
    x = x.view(batch, kv_heads, tiles, block, heads // kv_heads, -1).permute(0, 2, 3, 1, 4, 5)
    return x.reshape(batch, tiles * block, heads, -1)[:, :seq]


def tile_keys(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, S, Hk, D] -> fp32 [B * Hk * nK, block, D]."""
    batch, seq, heads, dim = x.shape
    tiles = -(-seq // block)
    x = F.pad(x.float(), (0, 0, 0, 0, 0, tiles * block - seq))
    return x.reshape(batch, tiles, block, heads, dim).permute(0, 3, 1, 2, 4).reshape(batch * heads * tiles, block, dim)


def untile_keys(x: torch.Tensor, batch: int, seq: int, heads: int, block: int) -> torch.Tensor:
    tiles = -(-seq // block)
    return x.view(batch, heads, tiles, block, -1).permute(0, 2, 3, 1, 4).reshape(batch, tiles * block, heads, -1)[:, :seq]


def _mask_partial(scores: torch.Tensor, columns: torch.Tensor, row0: torch.Tensor, block_q: int) -> None:
    """Set masked entries of partial tiles' scores [n, block_q * group, block_k] to -inf, in place."""
    n, _, block_k = scores.shape
    rows = (row0.view(n, 1, 1) + torch.arange(block_q, device=row0.device).view(1, block_q, 1)).to(torch.int32)
    lts, lte, uts, ute = (columns[:, None, :, c] for c in range(4))
    masked = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
    scores.view(n, block_q, -1, block_k).masked_fill_(masked.unsqueeze(2), float("-inf"))


def _steps(plan: TilePlan):
    """Slices of the plan, one key tile at a time, at most MAX_TILES_PER_STEP tiles each (bounds temporaries)."""
    max_tiles = MAX_TILES_PER_STEP
    start = 0
    for count, partial in zip(plan.counts, plan.partial_counts, strict=True):
        for offset in range(0, count, max_tiles):
            size = min(max_tiles, count - offset)
            yield slice(start + offset, start + offset + size), min(max(partial - offset, 0), size)
        start += count


def tiled_forward(q_t, k_t, v_t, columns, plan: TilePlan, block_q: int):
    """Online softmax over key tiles. Returns normalized output rows and their log-sum-exp (+inf if empty)."""
    rows, width = q_t.shape[0], q_t.shape[1]
    m = torch.full((rows, width), float("-inf"), device=q_t.device)
    denom = torch.zeros((rows, width), device=q_t.device)
    acc = torch.zeros((rows, width, v_t.shape[-1]), device=q_t.device)
    for sl, partial in _steps(plan):
        qi, ki = plan.q_tile[sl], plan.k_tile[sl]
        scores = torch.bmm(q_t.index_select(0, qi), k_t.index_select(0, ki).transpose(1, 2))
        if partial:
            _mask_partial(scores[:partial], columns.index_select(0, plan.col_tile[sl][:partial]),
                          plan.row0[sl][:partial], block_q)
        m_old = m.index_select(0, qi)
        m_new = torch.maximum(m_old, scores.amax(dim=-1))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        probs = scores.sub_(m_safe.unsqueeze(-1)).exp_()
        alpha = (m_old - m_safe).exp_()
        denom.index_copy_(0, qi, denom.index_select(0, qi).mul_(alpha).add_(probs.sum(dim=-1)))
        acc_old = acc.index_select(0, qi).mul_(alpha.unsqueeze(-1))
        acc.index_copy_(0, qi, torch.baddbmm(acc_old, probs, v_t.index_select(0, ki)))
        m.index_copy_(0, qi, m_new)
    empty = denom == 0
    lse = (m + denom.log()).masked_fill(empty, float("inf"))
    return acc.div_(denom.masked_fill_(empty, 1.0).unsqueeze(-1)), lse


def tiled_backward(q_t, k_t, v_t, o_t, do_t, lse, columns, plan: TilePlan, block_q: int):
    """FlashAttention-2 backward over the same tiles. Returns d(q_t), d(k_t), d(v_t) in the tiled layout."""
    delta = (o_t * do_t).sum(dim=-1)
    dq, dk, dv = torch.zeros_like(q_t), torch.zeros_like(k_t), torch.zeros_like(v_t)
    for sl, partial in _steps(plan):
        qi, ki = plan.q_tile[sl], plan.k_tile[sl]
        qg, dog, kg, vg = q_t.index_select(0, qi), do_t.index_select(0, qi), k_t.index_select(0, ki), v_t.index_select(0, ki)
        scores = torch.bmm(qg, kg.transpose(1, 2))
        if partial:
            _mask_partial(scores[:partial], columns.index_select(0, plan.col_tile[sl][:partial]),
                          plan.row0[sl][:partial], block_q)
        probs = scores.sub_(lse.index_select(0, qi).unsqueeze(-1)).exp_()
        dv.index_add_(0, ki, torch.bmm(probs.transpose(1, 2), dog))
        dscores = torch.bmm(dog, vg.transpose(1, 2)).sub_(delta.index_select(0, qi).unsqueeze(-1)).mul_(probs)
        dq.index_add_(0, qi, torch.bmm(dscores, kg))
        dk.index_add_(0, ki, torch.bmm(dscores.transpose(1, 2), qg))
    return dq, dk, dv


class _TiledFlashMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, canonical, scale, block_q, block_k):
        batch, seq_q, heads, _ = q.shape
        seq_k, kv_heads = k.shape[1], k.shape[2]
        with torch.autocast(device_type=q.device.type, enabled=False):
            plan = make_plan(canonical, seq_q=seq_q, kv_heads=kv_heads, block_q=block_q, block_k=block_k)
            columns = pad_columns(canonical, seq_q=seq_q, block_k=block_k).view(-1, block_k, 4)
            q_t = tile_queries(q, kv_heads, block_q) * scale
            k_t, v_t = tile_keys(k, block_k), tile_keys(v, block_k)
            o_t, lse = tiled_forward(q_t, k_t, v_t, columns, plan, block_q)
        ctx.save_for_backward(q_t, k_t, v_t, o_t, lse, columns)
        ctx.plan, ctx.scale, ctx.block_q, ctx.block_k = plan, scale, block_q, block_k
        ctx.shapes = (batch, seq_q, seq_k, heads, kv_heads, q.dtype, k.dtype, v.dtype)
        return untile_queries(o_t, batch, seq_q, heads, kv_heads, block_q).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q_t, k_t, v_t, o_t, lse, columns = ctx.saved_tensors
        batch, seq_q, seq_k, heads, kv_heads, q_dtype, k_dtype, v_dtype = ctx.shapes
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            do_t = tile_queries(grad_out, kv_heads, ctx.block_q)
            dq, dk, dv = tiled_backward(q_t, k_t, v_t, o_t, do_t, lse, columns, ctx.plan, ctx.block_q)
            dq = untile_queries(dq.mul_(ctx.scale), batch, seq_q, heads, kv_heads, ctx.block_q).to(q_dtype)
            dk = untile_keys(dk, batch, seq_k, kv_heads, ctx.block_k).to(k_dtype)
            dv = untile_keys(dv, batch, seq_k, kv_heads, ctx.block_k).to(v_dtype)
        return dq, dk, dv, None, None, None, None


def flashmask_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    canonical: torch.Tensor,
    *,
    scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> torch.Tensor:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hk, D], canonical indices [B, 1|Hk, Sk, 4] -> [B, Sq, Hq, D]."""
    return _TiledFlashMask.apply(q, k, v, canonical, scale, block_q, block_k)
