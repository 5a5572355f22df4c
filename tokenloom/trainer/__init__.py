"""trainer: DeepSpeed engine, the loop, checkpoints and metrics.

Exports resolve lazily so that reading a config does not import torch or DeepSpeed.
"""

from tokenloom.trainer.config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        from tokenloom.trainer import loop

        return getattr(loop, name)
    raise AttributeError(name)
