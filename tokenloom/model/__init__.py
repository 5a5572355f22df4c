"""model: the transformer over the unified token space (single-device code).

Exports resolve lazily so that reading a config does not import torch.
"""

from tokenloom.model.config import ModelConfig

__all__ = ["ModelConfig", "Transformer"]


def __getattr__(name: str):
    if name == "Transformer":
        from tokenloom.model.transformer import Transformer

        return Transformer
    raise AttributeError(name)
