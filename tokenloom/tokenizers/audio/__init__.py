"""The RVQ audio tokenizer (SEANet-style encoder/decoder, ResidualVQ with quantizer dropout):
model, training, evaluation and bundles. Names are imported lazily so that reading a config
never imports torch."""

from __future__ import annotations

import importlib

from tokenloom.tokenizers.audio.config import AudioTokenizerConfig

_LAZY = {
    "AudioTokenizer": "model",
    "MultiScaleMel": "model",
    "parameter_count": "model",
    "AudioEvalResult": "train",
    "AudioTrainResult": "train",
    "encode_long": "train",
    "evaluate": "train",
    "level_counts": "train",
    "load_audio": "train",
    "publish_bundle": "train",
    "train_audio": "train",
}

__all__ = ["AudioTokenizerConfig", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"tokenloom.tokenizers.audio.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
