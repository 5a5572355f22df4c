"""FlashMask in Triton: FlashAttention-2 forward and backward with column-wise tile skipping.

One program per (query tile, batch x query head) in the forward and the dQ pass, one per (key
tile, batch x query head) in the dK/dV pass. Before touching a tile, a program loads the key tile's
eight bounds (min/max of LTS, LTE, UTS, UTE, from `tiles.column_tile_bounds`) and classifies it as
in `tiles`: skipped tiles cost eight scalar loads, free tiles run unmasked, partial tiles load the
tile's column intervals and mask elementwise. Masks never exist beyond one tile.

Loop trip counts are constexpr (the number of tiles), with skipping done by a runtime `if` inside:
the Triton interpreter of this stack (Triton 3.6 with NumPy 2.4) cannot iterate over a runtime
bound, and the CI tests run this exact code under TRITON_INTERPRET=1. The price is one compile per
distinct tile count, i.e. per sequence length.

Softmax runs in base 2 (scores pre-multiplied by scale * log2 e). Rows that see nothing store
lse = +inf, so the backward's p = exp2(s - lse) is exactly zero for them. Dot products use
input_precision "ieee" for fp32 (what the interpreter needs, and what the tests compare), the
default tensor-core path for bf16/fp16. dK/dV are accumulated per query head in fp32 and summed
over each grouped-query group afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import column_tile_bounds

LOG2E = 1.4426950408889634


@triton.jit
def _classify(r0, r1, bounds_ptr):
    lts_min = tl.load(bounds_ptr + 0)
    lts_max = tl.load(bounds_ptr + 1)
    lte_min = tl.load(bounds_ptr + 2)
    lte_max = tl.load(bounds_ptr + 3)
    uts_min = tl.load(bounds_ptr + 4)
    uts_max = tl.load(bounds_ptr + 5)
    ute_min = tl.load(bounds_ptr + 6)
    ute_max = tl.load(bounds_ptr + 7)
    skip = ((r0 >= lts_max) & (r1 <= lte_min)) | ((r0 >= uts_max) & (r1 <= ute_min))
    free = ((r1 <= lts_min) | (r0 >= lte_max)) & ((r1 <= uts_min) | (r0 >= ute_max))
    return skip, free


@triton.jit
def _tile_mask(cols_ptr, offs_m, offs_n, seq_q, seq_k):
    valid = offs_n < seq_k
    lts = tl.load(cols_ptr + offs_n * 4 + 0, mask=valid, other=0)
    lte = tl.load(cols_ptr + offs_n * 4 + 1, mask=valid, other=0)
    uts = tl.load(cols_ptr + offs_n * 4 + 2, mask=valid, other=0)
    ute = tl.load(cols_ptr + offs_n * 4 + 3, mask=valid, other=0)
    rows = offs_m[:, None]
    masked = ((rows >= lts[None, :]) & (rows < lte[None, :])) | ((rows >= uts[None, :]) & (rows < ute[None, :]))
    return masked | (offs_n[None, :] >= seq_k)


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, COLS, BOUNDS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    stride_cb, stride_ch, stride_bb, stride_bh,
    seq_q, seq_k, heads, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_KT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    hk = h // group
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, seq_q)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < seq_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    cols = COLS + b * stride_cb + hk * stride_ch
    bounds = BOUNDS + b * stride_bb + hk * stride_bh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for kt in range(0, N_KT):
        skip, free = _classify(r0, r1, bounds + kt * 8)
        if skip == 0:
            offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n[:, None] < seq_k
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if free == 0:
                qk = tl.where(_tile_mask(cols, offs_m, offs_n, seq_q, seq_k), float("-inf"), qk)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok)
    tl.store(LSE + pid_bh * seq_q + offs_m, lse, mask=offs_m < seq_q)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, COLS, BOUNDS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_gb, stride_gs, stride_gh, stride_cb, stride_ch, stride_bb, stride_bh,
    seq_q, seq_k, heads, group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_QT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    hk = h // group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < seq_k
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok, other=0.0)
    cols = COLS + b * stride_cb + hk * stride_ch
    bounds = BOUNDS + b * stride_bb + hk * stride_bh + pid_n * 8
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for qt in range(0, N_QT):
        r0 = qt * BLOCK_M
        r1 = tl.minimum(r0 + BLOCK_M, seq_q)
        skip, free = _classify(r0, r1, bounds)
        if skip == 0:
            offs_m = r0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < seq_q
            q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + pid_bh * seq_q + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + pid_bh * seq_q + offs_m, mask=row_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if free == 0:
                qk = tl.where(_tile_mask(cols, offs_m, offs_n, seq_q, seq_k), float("-inf"), qk)
            p = tl.exp2(qk - lse[:, None])
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    dk = dk * sm_scale
    out_offsets = b * stride_gb + h * stride_gh + offs_n[:, None] * stride_gs + offs_d[None, :]
    tl.store(DK + out_offsets, dk, mask=col_ok)
    tl.store(DV + out_offsets, dv, mask=col_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, COLS, BOUNDS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_cb, stride_ch, stride_bb, stride_bh,
    seq_q, seq_k, heads, group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_KT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    hk = h // group
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, seq_q)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + pid_bh * seq_q + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * seq_q + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    cols = COLS + b * stride_cb + hk * stride_ch
    bounds = BOUNDS + b * stride_bb + hk * stride_bh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for kt in range(0, N_KT):
        skip, free = _classify(r0, r1, bounds + kt * 8)
        if skip == 0:
            offs_n = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n[:, None] < seq_k
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=col_ok, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if free == 0:
                qk = tl.where(_tile_mask(cols, offs_m, offs_n, seq_q, seq_k), float("-inf"), qk)
            p = tl.exp2(qk - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def default_blocks(head_dim: int) -> dict[str, int]:
    """Tile sizes: (fwd M, N), (bwd M, N). One key-tile size for all passes so one bounds table serves."""
    return {"block_m": 128, "block_n": 64, "block_m_bwd": 64, "num_warps": 4 if head_dim <= 64 else 8}


def _index_strides(x: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of an index table, with head stride 0 when one table serves all heads."""
    return x.stride(0), (x.stride(1) if x.shape[1] > 1 else 0)


class _TritonFlashMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, canonical, scale, blocks):
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        batch, seq_q, heads, head_dim = q.shape
        seq_k, kv_heads = k.shape[1], k.shape[2]
        block_m, block_n = blocks["block_m"], blocks["block_n"]
        canonical = canonical.contiguous()
        bounds = column_tile_bounds(canonical, seq_q=seq_q, block_k=block_n)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        out = torch.empty_like(q)
        lse = torch.empty((batch * heads, seq_q), device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(seq_q, block_m), batch * heads)
        _fwd_kernel[grid](
            q, k, v, out, lse, canonical, bounds,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            *_index_strides(canonical), *_index_strides(bounds),
            seq_q, seq_k, heads, heads // kv_heads, scale * LOG2E,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, N_KT=triton.cdiv(seq_k, block_n),
            PRECISION=precision, num_warps=blocks["num_warps"], num_stages=2,
        )
        ctx.save_for_backward(q, k, v, out, lse, canonical, bounds)
        ctx.scale, ctx.blocks, ctx.precision = scale, blocks, precision
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, canonical, bounds = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        batch, seq_q, heads, head_dim = q.shape
        seq_k, kv_heads = k.shape[1], k.shape[2]
        group = heads // kv_heads
        block_m, block_n = ctx.blocks["block_m_bwd"], ctx.blocks["block_n"]
        delta = (out.float() * grad_out.float()).sum(-1).transpose(1, 2).reshape(batch * heads, seq_q).contiguous()
        dk_heads = torch.empty((batch, seq_k, heads, head_dim), device=q.device, dtype=torch.float32)
        dv_heads = torch.empty_like(dk_heads)
        dq = torch.empty_like(q)
        common = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=ctx.precision,
                      num_warps=ctx.blocks["num_warps"], num_stages=1)
        strides = (
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        )
        _bwd_dkdv_kernel[(triton.cdiv(seq_k, block_n), batch * heads)](
            q, k, v, grad_out, lse, delta, dk_heads, dv_heads, canonical, bounds, *strides,
            dk_heads.stride(0), dk_heads.stride(1), dk_heads.stride(2),
            *_index_strides(canonical), *_index_strides(bounds),
            seq_q, seq_k, heads, group, ctx.scale * LOG2E, ctx.scale,
            N_QT=triton.cdiv(seq_q, block_m), **common,
        )
        _bwd_dq_kernel[(triton.cdiv(seq_q, block_m), batch * heads)](
            q, k, v, grad_out, lse, delta, dq, canonical, bounds, *strides,
            *_index_strides(canonical), *_index_strides(bounds),
            seq_q, seq_k, heads, group, ctx.scale * LOG2E, ctx.scale,
            N_KT=triton.cdiv(seq_k, block_n), **common,
        )
        dk = dk_heads.view(batch, seq_k, kv_heads, group, head_dim).sum(3).to(k.dtype)
        dv = dv_heads.view(batch, seq_k, kv_heads, group, head_dim).sum(3).to(v.dtype)
        return dq, dk, dv, None, None, None


def flashmask_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    canonical: torch.Tensor,
    *,
    scale: float,
    blocks: dict[str, int] | None = None,
) -> torch.Tensor:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hk, D], canonical indices [B, 1|Hk, Sk, 4] -> [B, Sq, Hq, D].

    Head dim must be a power of two in [16, 128]. `blocks` overrides the tile sizes (tests use 16).
    """
    head_dim = q.shape[-1]
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"the Triton FlashMask kernel supports head dims 16, 32, 64, 128; got {head_dim}")
    return _TritonFlashMask.apply(q, k, v, canonical, scale, blocks or default_blocks(head_dim))
