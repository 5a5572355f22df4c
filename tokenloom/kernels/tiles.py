"""Tile classification: which (query tile, key tile) blocks are skipped, masked elementwise, or free.

FlashMask's saving comes from here. Per tile of key columns it keeps the min and max of each of
LTS, LTE, UTS, UTE (O(Sk / block_k) numbers). A query tile of rows [r0, r1) is

    fully masked  if  r0 >= max LTS and r1 <= min LTE   (inside every column's lower interval)
                  or  r0 >= max UTS and r1 <= min UTE   (inside every column's upper interval)
    unmasked      if  (r1 <= min LTS or r0 >= max LTE) and (r1 <= min UTS or r0 >= max UTE)
    partial       otherwise.

The tests are sufficient, not necessary: a tile they call partial may happen to be fully masked or
free, which costs time but never correctness, because partial tiles are masked elementwise.
Key columns past Sk (padding to a whole tile) count as fully masked, so a ragged last tile is
partial and its padding is masked by the same elementwise path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKIP, PARTIAL, FULL = 0, 1, 2


def column_tile_bounds(canonical: torch.Tensor, *, seq_q: int, block_k: int) -> torch.Tensor:
    """Canonical [B, H, Sk, 4] -> int32 [B, H, nK, 8]: (min, max) of LTS, LTE, UTS, UTE per key tile."""
    batch, heads, seq_k, _ = canonical.shape
    tiles = -(-seq_k // block_k)
    pad = tiles * block_k - seq_k
    if pad:
        fully_masked = torch.tensor([0, seq_q, 0, 0], dtype=canonical.dtype, device=canonical.device)
        canonical = torch.cat([canonical, fully_masked.expand(batch, heads, pad, 4)], dim=2)
    per_tile = canonical.view(batch, heads, tiles, block_k, 4)
    low, high = per_tile.amin(dim=3), per_tile.amax(dim=3)
    return torch.stack([low, high], dim=-1).flatten(-2).to(torch.int32).contiguous()


def classify_tiles(bounds: torch.Tensor, *, seq_q: int, block_q: int) -> torch.Tensor:
    """Tile bounds [B, H, nK, 8] -> int8 [B, H, nQ, nK] of SKIP, PARTIAL or FULL."""
    tiles_q = -(-seq_q // block_q)
    r0 = (torch.arange(tiles_q, device=bounds.device) * block_q).view(1, 1, tiles_q, 1)
    r1 = (r0 + block_q).clamp(max=seq_q)
    lts_min, lts_max, lte_min, lte_max, uts_min, uts_max, ute_min, ute_max = (
        bounds[..., c].unsqueeze(2) for c in range(8)
    )
    fully = ((r0 >= lts_max) & (r1 <= lte_min)) | ((r0 >= uts_max) & (r1 <= ute_min))
    unmasked = ((r1 <= lts_min) | (r0 >= lte_max)) & ((r1 <= uts_min) | (r0 >= ute_max))
    classes = torch.full(fully.shape, PARTIAL, dtype=torch.int8, device=bounds.device)
    classes = classes.masked_fill(unmasked, FULL)
    return classes.masked_fill(fully, SKIP)


def tile_fractions(classes: torch.Tensor) -> dict[str, float]:
    """Share of tiles skipped, partial and free: what a benchmark reports next to its timings."""
    total = classes.numel()
    return {name: float((classes == value).sum()) / total for name, value in
            (("skipped", SKIP), ("partial", PARTIAL), ("free", FULL))}


def pad_columns(canonical: torch.Tensor, *, seq_q: int, block_k: int) -> torch.Tensor:
    """Canonical [B, H, Sk, 4] padded with fully masked columns to whole key tiles."""
    pad = -canonical.shape[2] % block_k
    if not pad:
        return canonical
    padded = F.pad(canonical, (0, 0, 0, pad))
    padded[:, :, -pad:, 1] = seq_q
    return padded
