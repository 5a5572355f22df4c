"""Model configuration: the size knobs, and the vocabulary size taken from the manifest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: taken from the dataset's vocabulary manifest
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 8 / 3
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def validate(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it comes from the vocabulary manifest)")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"model.dim {self.dim} must split into {self.n_heads} heads of even size")
