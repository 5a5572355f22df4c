"""The Triton kernel against the dense reference: on a GPU when there is one, else under the interpreter.

Without CUDA this module sets TRITON_INTERPRET=1 before the kernel module is imported (Triton reads
it when a function is decorated), and runs tiny fp32 shapes with 16-wide tiles. With CUDA it runs
bf16/fp16 at head dims 64 and 128 with the production tile sizes, plus fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from flashmask_helpers import run_and_compare  # noqa: E402

from tokenloom.kernels import (  # noqa: E402
    MASK_BUILDERS,
    Segment,
    build_multimodal_mask,
    canonical_indices,
    flashmask_attention,
)
from tokenloom.kernels.triton_flashmask import flashmask_triton  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TINY = {"block_m": 16, "block_n": 16, "block_m_bwd": 16, "num_warps": 1}

SMALL_CASES = {
    "causal_document": ([11, 20, 9],),
    "document": ([11, 20, 9],),
    "sliding_window": (40, 7),
    "global_sliding_window": (40, 3, 6),
    "prefix_lm_document": ([11, 20, 9], [3, 0, 9]),
    "causal_blockwise": ([11, 20, 9],),
    "qk_sparse": (40, (5, 12), (20, 23)),
    "share_question": ([(6, [5, 4]), (7, [9, 9])],),
    "full": (40,),
    "causal": (40,),
    "prefix_lm_causal": (40, 9),
    "random_eviction": (40, 5),
}


def triton_fn(idx, causal, blocks=None):
    def fn(q, k, v):
        canonical = canonical_indices(idx.to(q.device), causal=causal, seq_q=q.shape[1])
        return flashmask_triton(q, k, v, canonical, scale=q.shape[-1] ** -0.5, blocks=blocks)

    return fn


def qkv(batch, seq_q, seq_k, heads, kv_heads, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, seq_q, heads, dim), (batch, seq_k, kv_heads, dim), (batch, seq_k, kv_heads, dim))
    return tuple(torch.randn(s, generator=g).to(DEVICE, dtype) for s in shapes)


@pytest.mark.parametrize("name", sorted(SMALL_CASES))
def test_every_builder_fp32(name):
    builder = MASK_BUILDERS[name]
    idx = builder.build(*SMALL_CASES[name])
    seq = idx.shape[2]
    idx = idx.expand(2, 1, seq, -1)
    q, k, v = qkv(2, seq, seq, 2, 1, 16)
    run_and_compare(triton_fn(idx, builder.causal, TINY), q, k, v, idx, causal=builder.causal)


def test_multimodal_per_head_gqa_ragged_and_empty_rows():
    rows = [[Segment("text", 0, 9), Segment("image", 9, 12), Segment("audio", 21, 14, window=5)]]
    mm = build_multimodal_mask(rows, seq_len=37)  # two padding positions: empty rows, masked columns
    doc = MASK_BUILDERS["document"].build([20, 17])
    doc4 = torch.stack([doc[..., 0], torch.full_like(doc[..., 0], 37), torch.zeros_like(doc[..., 0]), doc[..., 1]], -1)
    idx = torch.cat([mm, doc4], dim=1)
    q, k, v = qkv(1, 37, 37, 4, 2, 16)
    out = run_and_compare(triton_fn(idx, False, TINY), q, k, v, idx, causal=False)
    assert torch.equal(out[:, 35:, :2].cpu(), torch.zeros(1, 2, 2, 16))


@pytest.mark.skipif(not ON_GPU, reason="bf16/fp16 and production tile sizes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["causal_document", "sliding_window", "global_sliding_window", "share_question"])
def test_gpu_half_precision_through_dispatcher(name, head_dim, dtype):
    args = {"causal_document": ([300, 500, 224],), "sliding_window": (1000, 128),
            "global_sliding_window": (1000, 16, 128), "share_question": ([(200, [300, 100]), (150, [250])],)}[name]
    builder = MASK_BUILDERS[name]
    idx = builder.build(*args)
    seq = idx.shape[2]
    idx = idx.expand(2, 1, seq, -1).to(DEVICE)
    q, k, v = qkv(2, seq, seq, 8, 2, head_dim, dtype=dtype)
    run_and_compare(lambda q, k, v: flashmask_attention(q, k, v, idx, causal=builder.causal), q, k, v, idx,
                    causal=builder.causal, out_atol=3e-2, grad_atol=6e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_intervals_gqa_per_head_unequal_lengths(seed):
    rnd = torch.Generator().manual_seed(seed)
    seq_q, seq_k = 37 + 5 * seed, 45 - 4 * seed
    causal = seed == 1
    n = 2 if causal else 4
    values = torch.randint(0, seq_q + 1, (2, 2, seq_k, n), generator=rnd)
    idx = torch.sort(values, dim=-1).values.to(torch.int32) if seed != 2 else values.to(torch.int32)
    q, k, v = qkv(2, seq_q, seq_k, 4, 2, 16, seed=seed)
    run_and_compare(triton_fn(idx, causal, TINY), q, k, v, idx, causal=causal)


def test_public_api_routes_to_triton_on_request():
    idx = MASK_BUILDERS["causal_document"].build([15, 18])
    q, k, v = qkv(1, 33, 33, 2, 2, 16)
    run_and_compare(lambda q, k, v: flashmask_attention(q, k, v, idx.to(DEVICE), causal=True, backend="triton"),
                    q, k, v, idx, causal=True)
