"""The FlashMask paper's mask set, each as a small pure function returning `startend_row_indices`.

Every builder returns int32 `[1, 1, seq_len, n]` for one sequence (concatenate on dim 0 for a batch,
on dim 1 for per-head masks) and is meant for one value of `causal`, recorded in `MASK_BUILDERS`.
The formulas are written per key column j; "doc" is the packed document that contains j, [s, e).
Lengths are validated with ValueError, because a wrong length silently yields a wrong mask.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskBuilder:
    """A builder and the `causal` flag its indices must be used with."""

    build: Callable[..., torch.Tensor]
    causal: bool


def _check_positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_lengths(name: str, lengths: Sequence[int]) -> list[int]:
    if len(lengths) == 0:
        raise ValueError(f"{name} must list at least one length")
    return [_check_positive(f"{name}[{i}]", n) for i, n in enumerate(lengths)]


def _column_spans(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column: start and end of the span (document, block) that contains it."""
    sizes = torch.tensor(lengths, dtype=torch.int64)
    ends = sizes.cumsum(0)
    return (ends - sizes).repeat_interleave(sizes), ends.repeat_interleave(sizes)


def _pack(*columns: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.to(torch.int32) for c in columns], dim=-1).view(1, 1, columns[0].numel(), len(columns))


def full_mask(seq_len: int) -> torch.Tensor:
    """Nothing masked. causal=False, [LTS=S, UTE=0]."""
    s = _check_positive("seq_len", seq_len)
    return _pack(torch.full((s,), s), torch.zeros(s))


def causal_mask(seq_len: int) -> torch.Tensor:
    """Plain causal. causal=True, [LTS=S]."""
    s = _check_positive("seq_len", seq_len)
    return _pack(torch.full((s,), s))


def sliding_window_mask(seq_len: int, window: int) -> torch.Tensor:
    """Causal, each row sees its last `window` keys (itself included). causal=True, [LTS=j+window]."""
    s, w = _check_positive("seq_len", seq_len), _check_positive("window", window)
    return _pack((torch.arange(s) + w).clamp(max=s))


def causal_document_mask(doc_lens: Sequence[int]) -> torch.Tensor:
    """Packed documents, causal inside each. causal=True, [LTS=e]."""
    _, ends = _column_spans(_check_lengths("doc_lens", doc_lens))
    return _pack(ends)


def document_mask(doc_lens: Sequence[int]) -> torch.Tensor:
    """Packed documents, bidirectional inside each. causal=False, [LTS=e, UTE=s]."""
    starts, ends = _column_spans(_check_lengths("doc_lens", doc_lens))
    return _pack(ends, starts)


def share_question_mask(documents: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """Per document a question then answers; each answer sees the question and itself, causally.

    `documents` is [(question_len, [answer_len, ...]), ...]. Nothing after a question's document,
    and nothing after an answer (other answers included), sees it: causal=True, [LTS].
    """
    if len(documents) == 0:
        raise ValueError("share_question_mask needs at least one (question_len, answer_lens) document")
    lts: list[torch.Tensor] = []
    offset = 0
    for d, (question, answers) in enumerate(documents):
        question = _check_positive(f"documents[{d}] question_len", question)
        answers = _check_lengths(f"documents[{d}] answer_lens", answers)
        _, answer_ends = _column_spans(answers)
        doc_end = offset + question + sum(answers)
        lts.append(torch.full((question,), doc_end))
        lts.append(answer_ends + offset + question)
        offset = doc_end
    return _pack(torch.cat(lts))


def prefix_lm_causal_mask(seq_len: int, prefix_len: int) -> torch.Tensor:
    """A bidirectional prefix, then causal. causal=False, [LTS=S, UTE=0 in the prefix else j]."""
    s = _check_positive("seq_len", seq_len)
    if not 0 <= prefix_len <= s:
        raise ValueError(f"prefix_len must lie in [0, seq_len={s}], got {prefix_len}")
    column = torch.arange(s)
    return _pack(torch.full((s,), s), torch.where(column < prefix_len, 0, column))


def prefix_lm_document_mask(doc_lens: Sequence[int], prefix_lens: Sequence[int]) -> torch.Tensor:
    """Packed prefix-LM documents. causal=False, [LTS=e, UTE=s in the doc's prefix else j]."""
    lengths = _check_lengths("doc_lens", doc_lens)
    if len(prefix_lens) != len(lengths) or any(not 0 <= p <= n for p, n in zip(prefix_lens, lengths, strict=True)):
        raise ValueError(f"prefix_lens must give one prefix in [0, doc_len] per document, got {list(prefix_lens)}")
    starts, ends = _column_spans(lengths)
    prefix_ends = starts + torch.tensor(list(prefix_lens)).repeat_interleave(torch.tensor(lengths))
    column = torch.arange(starts.numel())
    return _pack(ends, torch.where(column < prefix_ends, starts, column))


def global_sliding_window_mask(seq_len: int, global_tokens: int, window: int) -> torch.Tensor:
    """The first `global_tokens` see and are seen by all; others see |i - j| < window. causal=False.

    Column j >= g masks rows [g, j - window + 1) and [j + window, S): [LTS, LTE, UTS, UTE].
    """
    s, w = _check_positive("seq_len", seq_len), _check_positive("window", window)
    if not 0 <= global_tokens <= s:
        raise ValueError(f"global_tokens must lie in [0, seq_len={s}], got {global_tokens}")
    column = torch.arange(s)
    is_global = column < global_tokens
    lts = torch.where(is_global, s, (column + w).clamp(max=s))
    uts = torch.where(is_global, 0, global_tokens)
    ute = torch.where(is_global, 0, (column - w + 1).clamp(min=global_tokens))
    return _pack(lts, torch.full((s,), s), uts, ute)


def causal_blockwise_mask(block_lens: Sequence[int]) -> torch.Tensor:
    """In-context blocks, causal inside each; the last block sees all. causal=True, [LTS=e, LTE=last start]."""
    lengths = _check_lengths("block_lens", block_lens)
    _, ends = _column_spans(lengths)
    total, last_start = sum(lengths), sum(lengths[:-1])
    in_last = ends == total
    return _pack(torch.where(in_last, total, ends), torch.where(in_last, total, last_start))


def qk_sparse_mask(seq_len: int, query_drop: tuple[int, int], key_drop: tuple[int, int]) -> torch.Tensor:
    """Causal with a dropped query range (rows see nothing) and a dropped key range (columns seen by none).

    causal=True, [LTS, LTE]: dropped key columns mask [0, S), others mask the dropped rows.
    """
    s = _check_positive("seq_len", seq_len)
    for name, (lo, hi) in (("query_drop", query_drop), ("key_drop", key_drop)):
        if not 0 <= lo <= hi <= s:
            raise ValueError(f"{name} must be a range (start, end) inside [0, {s}], got {(lo, hi)}")
    column = torch.arange(s)
    dropped_key = (column >= key_drop[0]) & (column < key_drop[1])
    return _pack(torch.where(dropped_key, 0, query_drop[0]), torch.where(dropped_key, s, query_drop[1]))


def random_eviction_mask(seq_len: int, seed: int = 0) -> torch.Tensor:
    """Causal; key j is evicted at a random row in (j, S] and unseen from then on. causal=True, [LTS]."""
    s = _check_positive("seq_len", seq_len)
    rng = random.Random(seed)
    return _pack(torch.tensor([rng.randint(j + 1, s) for j in range(s)]))


MASK_BUILDERS: dict[str, MaskBuilder] = {
    "full": MaskBuilder(full_mask, causal=False),
    "causal": MaskBuilder(causal_mask, causal=True),
    "sliding_window": MaskBuilder(sliding_window_mask, causal=True),
    "causal_document": MaskBuilder(causal_document_mask, causal=True),
    "document": MaskBuilder(document_mask, causal=False),
    "share_question": MaskBuilder(share_question_mask, causal=True),
    "prefix_lm_causal": MaskBuilder(prefix_lm_causal_mask, causal=False),
    "prefix_lm_document": MaskBuilder(prefix_lm_document_mask, causal=False),
    "global_sliding_window": MaskBuilder(global_sliding_window_mask, causal=False),
    "causal_blockwise": MaskBuilder(causal_blockwise_mask, causal=True),
    "qk_sparse": MaskBuilder(qk_sparse_mask, causal=True),
    "random_eviction": MaskBuilder(random_eviction_mask, causal=True),
}
