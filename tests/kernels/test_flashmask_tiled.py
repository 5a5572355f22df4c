"""The tiled PyTorch path (the CPU path) against the dense reference: output and q/k/v gradients.

Tolerances are in flashmask_helpers.py. Small block sizes make every test span many tiles, ragged ones
included, so skipping, partial masking and the online softmax are all exercised.
"""

from __future__ import annotations

import pytest
import torch
from flashmask_helpers import CASES, TOTAL, run_and_compare
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.kernels import MASK_BUILDERS, build_multimodal_mask, canonical_indices, flashmask_attention
from tokenloom.kernels.multimodal import Segment
from tokenloom.kernels.tiled import flashmask_tiled


def tiled(idx, causal, block_q=16, block_k=16):
    def fn(q, k, v):
        canonical = canonical_indices(idx, causal=causal, seq_q=q.shape[1])
        return flashmask_tiled(q, k, v, canonical, scale=q.shape[-1] ** -0.5, block_q=block_q, block_k=block_k)

    return fn


def qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, seq_q, heads, dim, generator=g).to(dtype),
        torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype),
        torch.randn(batch, seq_k, kv_heads, dim, generator=g).to(dtype),
    )


@pytest.mark.parametrize("name", sorted(MASK_BUILDERS))
def test_every_builder_matches_reference(name):
    builder = MASK_BUILDERS[name]
    args = CASES[name][0] if name in CASES else (41, 1)
    seq = TOTAL.get(name, 41)
    idx = builder.build(*args).expand(2, 1, seq, -1)
    q, k, v = qkv(2, seq, seq, 4, 2, 16)
    run_and_compare(tiled(idx, builder.causal), q, k, v, idx, causal=builder.causal)


def test_multimodal_mask_matches_reference():
    rows = [[Segment("text", 0, 20), Segment("image", 20, 16), Segment("text", 36, 9), Segment("audio", 45, 30, window=7)],
            [Segment("image", 0, 33), Segment("text", 33, 20, document=1)]]
    idx = build_multimodal_mask(rows, seq_len=80)
    q, k, v = qkv(2, 80, 80, 2, 1, 32)
    run_and_compare(tiled(idx, False, 16, 32), q, k, v, idx, causal=False)


def test_key_tiles_split_into_several_steps_match_reference(monkeypatch):
    from tokenloom.kernels import tiled as tiled_module

    monkeypatch.setattr(tiled_module, "MAX_TILES_PER_STEP", 3)
    idx = MASK_BUILDERS["global_sliding_window"].build(70, 5, 9).expand(2, 2, 70, 4)
    q, k, v = qkv(2, 70, 70, 4, 2, 16)
    run_and_compare(tiled(idx, False, 8, 16), q, k, v, idx, causal=False)


def test_fully_masked_rows_give_zeros_and_zero_grads():
    seq = 40
    # Non-causal [LTS, UTE] with LTS = 10 everywhere masks rows >= 10 in every column.
    idx = torch.stack([torch.full((seq,), 10), torch.zeros(seq)], -1).int().view(1, 1, seq, 2)
    q, k, v = qkv(1, seq, seq, 2, 2, 16)
    q.requires_grad_()
    out = tiled(idx, False)(q, k, v)
    assert torch.equal(out[:, 10:], torch.zeros_like(out[:, 10:]))
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad_q[:, 10:], torch.zeros_like(grad_q[:, 10:]))
    run_and_compare(tiled(idx, False), q, k, v, idx, causal=False)


@st.composite
def problems(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    causal, n = draw(st.sampled_from([(True, 1), (True, 2), (False, 2), (False, 4)]))
    seq_q = draw(st.integers(1, 50))
    seq_k = draw(st.integers(1, 50))
    index_heads = draw(st.sampled_from([1, kv_heads]))
    rnd = draw(st.randoms(use_true_random=False))
    values = [[[sorted(rnd.randint(0, seq_q) for _ in range(n)) for _ in range(seq_k)] for _ in range(index_heads)]
              for _ in range(batch)]
    idx = torch.tensor(values, dtype=torch.int32)
    blocks = draw(st.sampled_from([(8, 8), (16, 8), (8, 32), (32, 16)]))
    return batch, seq_q, seq_k, heads, kv_heads, draw(st.sampled_from([8, 16])), causal, idx, blocks


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(0, 2**16))
def test_random_shapes_and_masks_match_reference(problem, seed):
    batch, seq_q, seq_k, heads, kv_heads, dim, causal, idx, blocks = problem
    q, k, v = qkv(batch, seq_q, seq_k, heads, kv_heads, dim, seed=seed)
    run_and_compare(tiled(idx, causal, *blocks), q, k, v, idx, causal=causal)


@settings(max_examples=25, deadline=None)
@given(problems(), st.integers(0, 2**16))
def test_dense_path_matches_reference(problem, seed):
    batch, seq_q, seq_k, heads, kv_heads, dim, causal, idx, _ = problem
    q, k, v = qkv(batch, seq_q, seq_k, heads, kv_heads, dim, seed=seed)
    run_and_compare(lambda q, k, v: flashmask_attention(q, k, v, idx, causal=causal, backend="dense"), q, k, v, idx,
                    causal=causal)


def test_public_api_with_per_head_indices_and_gqa():
    seq = 150
    idx = torch.cat([MASK_BUILDERS["causal_document"].build([70, 80]), MASK_BUILDERS["sliding_window"].build(seq, 30)], 1)
    q, k, v = qkv(1, seq, seq, 6, 2, 16)
    run_and_compare(lambda q, k, v: flashmask_attention(q, k, v, idx, causal=True), q, k, v, idx, causal=True)


def test_bf16_inputs_and_autocast():
    seq = 64
    idx = MASK_BUILDERS["causal_document"].build([30, 34])
    q, k, v = qkv(1, seq, seq, 2, 2, 32, dtype=torch.bfloat16)
    out = run_and_compare(lambda q, k, v: flashmask_attention(q, k, v, idx, causal=True), q, k, v, idx,
                          causal=True, out_atol=3e-2, grad_atol=3e-2)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (x.float() for x in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = flashmask_attention(q32, k32, v32, idx, causal=True)
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, flashmask_attention(q32, k32, v32, idx, causal=True), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v, i: (q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1), i), "multiple"),
        (lambda q, k, v, i: (q, k, v, i.float()), "int32"),
        (lambda q, k, v, i: (q, k, v, i[..., :1].expand(-1, -1, -1, 4)), "causal=False"),
        (lambda q, k, v, i: (q, k, v, i[:, :, :5]), "seq_k"),
        (lambda q, k, v, i: (q, k, v[:, :, :, :8], i), "same shape"),
    ],
)
def test_bad_inputs_raise_with_reason(change, message):
    q, k, v = qkv(1, 16, 16, 4, 2, 16)
    idx = MASK_BUILDERS["causal"].build(16)
    with pytest.raises(ValueError, match=message):
        flashmask_attention(*change(q, k, v, idx), causal=True)


def test_dispatcher_picks_triton_only_for_cuda_half_precision():
    from types import SimpleNamespace

    from tokenloom.kernels import choose_backend

    def fake(is_cuda, dtype, dim):
        return SimpleNamespace(is_cuda=is_cuda, dtype=dtype, shape=(1, 8, 2, dim))

    assert choose_backend(fake(True, torch.bfloat16, 128)) == "triton"
    assert choose_backend(fake(True, torch.float16, 64)) == "triton"
    assert choose_backend(fake(True, torch.float32, 64)) == "torch"
    assert choose_backend(fake(True, torch.bfloat16, 80)) == "torch"
    assert choose_backend(fake(False, torch.bfloat16, 64)) == "torch"
    assert choose_backend(fake(False, torch.float32, 64), seq_k=8) == "dense"  # short: the mask is small
    assert choose_backend(fake(False, torch.float32, 64), seq_k=10**6) == "torch"
    with pytest.raises(ValueError, match="backend"):
        flashmask_attention(*qkv(1, 8, 8, 1, 1, 8), MASK_BUILDERS["causal"].build(8), causal=True, backend="cuda")
