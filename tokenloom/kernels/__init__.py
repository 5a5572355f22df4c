"""FlashMask attention: column-wise row-interval masks, their builders, a dense reference, and kernels.

Importing this package has no side effects: Triton is imported only when a CUDA call selects it.
See `indices` for what `startend_row_indices` means.
"""

from .api import choose_backend, flashmask_attention
from .builders import (
    MASK_BUILDERS,
    MaskBuilder,
    causal_blockwise_mask,
    causal_document_mask,
    causal_mask,
    document_mask,
    full_mask,
    global_sliding_window_mask,
    prefix_lm_causal_mask,
    prefix_lm_document_mask,
    qk_sparse_mask,
    random_eviction_mask,
    share_question_mask,
    sliding_window_mask,
)
from .indices import canonical_indices, check_indices
from .multimodal import Segment, build_multimodal_mask, mask_from_columns, segment_columns
from .reference import dense_allowed_mask, flashmask_reference
from .tiles import classify_tiles, column_tile_bounds, tile_fractions

__all__ = [
    "MASK_BUILDERS",
    "MaskBuilder",
    "Segment",
    "build_multimodal_mask",
    "canonical_indices",
    "causal_blockwise_mask",
    "causal_document_mask",
    "causal_mask",
    "check_indices",
    "choose_backend",
    "classify_tiles",
    "column_tile_bounds",
    "dense_allowed_mask",
    "document_mask",
    "flashmask_attention",
    "flashmask_reference",
    "full_mask",
    "global_sliding_window_mask",
    "mask_from_columns",
    "prefix_lm_causal_mask",
    "prefix_lm_document_mask",
    "qk_sparse_mask",
    "random_eviction_mask",
    "segment_columns",
    "share_question_mask",
    "sliding_window_mask",
    "tile_fractions",
]
