"""The dual-path visual tokenizer (CNN detail path + ViT semantic path, cross-attention
fusion, vector-quantize-pytorch quantizer, convolutional decoder): model, training,
evaluation and bundles. Names are imported lazily so that reading a config never imports torch."""

from __future__ import annotations

import importlib

from tokenloom.tokenizers.visual.config import VisualTokenizerConfig, fit_to_budget

_LAZY = {
    "VisualTokenizer": "model",
    "matched_baseline": "model",
    "parameter_count": "model",
    "EvalResult": "train",
    "VisualTrainResult": "train",
    "evaluate": "train",
    "load_visual": "train",
    "prepare": "train",
    "save_grid": "train",
    "to_pixels": "train",
    "to_tensor": "train",
    "train_visual": "train",
}

__all__ = ["VisualTokenizerConfig", "fit_to_budget", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"tokenloom.tokenizers.visual.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
