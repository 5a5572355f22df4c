"""A small decoder-only transformer over the unified token space.

Single-device PyTorch that reads like the papers it follows (pre-norm RMSNorm, rotary
positions, SwiGLU MLP, tied embeddings). Packed documents are kept apart by the attention
mask built from `doc_ids`, and rotary positions restart per document via `position_ids`.
No engine, parallelism or I/O lives here: the trainer applies those from outside.

Shapes: B batch, L sequence, D model dim, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from tokenloom.model.config import ModelConfig


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, L, 1, Dh/2] for the given positions [B, L]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    angles = position_ids.float()[..., None] * freqs  # [B, L, Dh/2]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, L, L]: query i may see key j iff j <= i and both lie in the same document."""
    L = doc_ids.shape[-1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b l (three h d) -> three b l h d", three=3, h=self.n_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (rearrange(t, "b l h d -> b h l d") for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(rearrange(y, "b h l d -> b l (h d)"))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.dim)
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] for input ids [B, L]."""
        cos, sin = rope_tables(position_ids, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta)
        mask = document_causal_mask(doc_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(self.norm(x))

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
