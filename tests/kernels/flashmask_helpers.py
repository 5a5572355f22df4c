"""Shared helpers for the FlashMask tests: brute-force masks, builder cases, comparison with the reference.

A plain module with a unique name rather than conftest.py, so that `from ... import` in the test
files cannot pick up another test folder's conftest.

Tolerances (documented once, used everywhere): kernels run in fp32 and are compared with the dense
reference computed in fp64 on the same inputs: outputs within 2e-5 and q/k/v gradients within 1e-4
(absolute, for unit-normal inputs). bf16 inputs are compared with the fp32 reference within 3e-2.

The kernels cannot be more exact than the platform's fp32 matmul. On an IEEE fp32 matmul the scores
q.k^T of these inputs are off by at most ~3 eps |q|.|k| and the tolerances hold as written; one CI machine
once gave 6.4e-5 on an output (a reduced-precision fp32 matmul), where a mask or softmax bug gives
errors of order 0.1. So each comparison first measures the scores' error of the platform's fp32
matmul on its own q and k (`matmul_error_factor`) and widens both tolerances by that factor beyond
IEEE's, never narrower than written.
"""

from __future__ import annotations

import torch

from tokenloom.kernels import flashmask_reference

OUT_ATOL, GRAD_ATOL = 2e-5, 1e-4
IEEE_ERROR_IN_EPS = 8.0  # an IEEE fp32 matmul stays within ~3 eps |q|.|k| per score here; bf16x3 is ~128


def matmul_error_factor(q: torch.Tensor, k: torch.Tensor) -> float:
    """How many times IEEE's error the platform's fp32 matmul makes on the scores q.k^T (at least 1).

    Each score's error is measured in units of eps_fp32 * |q|.|k| (the standard bound for a dot
    product), so the figure does not depend on the head dimension or the inputs' size."""
    q32, k32 = q.detach().cpu().float(), k.detach().cpu().float()
    q32, k32 = q32[..., : k32.shape[2], :].transpose(1, 2), k32.transpose(1, 2)  # [B, H, S, D], one q head per kv head
    q64, k64 = q32.double(), k32.double().transpose(-1, -2)
    error = (torch.matmul(q32, k32.transpose(-1, -2)).double() - torch.matmul(q64, k64)).abs()
    bound = torch.finfo(torch.float32).eps * torch.matmul(q64.abs(), k64.abs()) + torch.finfo(torch.float64).tiny
    return max(1.0, (error / bound).max().item() / IEEE_ERROR_IN_EPS)


def brute_force_allowed(seq_q: int, seq_k: int, allowed) -> torch.Tensor:
    """bool [1, 1, Sq, Sk] from a Python predicate allowed(i, j): the mask written the obvious way."""
    return torch.tensor([[allowed(i, j) for j in range(seq_k)] for i in range(seq_q)]).view(1, 1, seq_q, seq_k)


def run_and_compare(fn, q, k, v, idx, *, causal: bool, out_atol=OUT_ATOL, grad_atol=GRAD_ATOL):
    """Run fn(q, k, v) forward and backward; compare output and grads with the fp64 dense reference."""
    factor = matmul_error_factor(q, k)
    out_atol, grad_atol = out_atol * factor, grad_atol * factor
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    grad_out = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    scale = q.shape[-1] ** -0.5
    ref = flashmask_reference(q64, k64, v64, idx.cpu(), causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.cpu().double())
    assert not torch.isnan(out).any(), "output has NaN"
    platform = f" (tolerances x{factor:.1f} for this platform's fp32 matmul)" if factor > 1 else ""
    torch.testing.assert_close(out.cpu().double(), ref, atol=out_atol, rtol=0, msg=lambda m: m + platform)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert not torch.isnan(got).any(), f"d{name} has NaN"
        torch.testing.assert_close(got.cpu().double(), want, atol=grad_atol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}{platform}")
    return out


# Builder cases: arguments and the mask written as a predicate allowed(row, col).
S = 41
DOCS = [13, 9, 19]
STARTS = [0, 13, 22]


def doc_of(i: int, lengths=DOCS) -> int:
    total = 0
    for d, n in enumerate(lengths):
        total += n
        if i < total:
            return d
    raise IndexError(i)


def _answer_id(i: int) -> int:
    """Share-question layout [(5, [4, 4]), (6, [3, 2, 3])]: -1 for a question token, else a unique answer id."""
    layout = [(5, [4, 4]), (6, [3, 2, 3])]
    pos, ident = 0, 0
    for question, answers in layout:
        if i < pos + question:
            return -1
        pos += question
        for a in answers:
            if i < pos + a:
                return ident
            pos += a
            ident += 1
    raise IndexError(i)


SQ_DOCS = [5 + 4 + 4, 6 + 3 + 2 + 3]

CASES = {
    "full": ((S,), lambda i, j: True),
    "causal": ((S,), lambda i, j: i >= j),
    "sliding_window": ((S, 6), lambda i, j: j <= i < j + 6),
    "causal_document": ((DOCS,), lambda i, j: doc_of(i) == doc_of(j) and i >= j),
    "document": ((DOCS,), lambda i, j: doc_of(i) == doc_of(j)),
    "share_question": (
        ([(5, [4, 4]), (6, [3, 2, 3])],),
        lambda i, j: doc_of(i, SQ_DOCS) == doc_of(j, SQ_DOCS) and i >= j and _answer_id(j) in (-1, _answer_id(i)),
    ),
    "prefix_lm_causal": ((S, 7), lambda i, j: j < 7 or j <= i),
    "prefix_lm_document": (
        (DOCS, [4, 0, 19]),
        lambda i, j: doc_of(i) == doc_of(j) and (j < STARTS[doc_of(j)] + [4, 0, 19][doc_of(j)] or j <= i),
    ),
    "global_sliding_window": ((S, 3, 5), lambda i, j: i < 3 or j < 3 or abs(i - j) < 5),
    "causal_blockwise": ((DOCS,), lambda i, j: i >= j and (doc_of(i) == doc_of(j) or doc_of(i) == 2)),
    "qk_sparse": ((S, (10, 15), (20, 24)), lambda i, j: i >= j and not 10 <= i < 15 and not 20 <= j < 24),
}

TOTAL = {"share_question": sum(SQ_DOCS)}
