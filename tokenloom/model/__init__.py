"""model: the unified multimodal MoE transformer over one token space (single-device code).

Exports resolve lazily so that reading a config does not import torch.
"""

from tokenloom.model.config import ElasticConfig, ModelConfig, MoEConfig

__all__ = ["ElasticConfig", "ModelConfig", "MoEConfig", "SubModel", "UnifiedModel", "export_submodel",
           "routing_metrics", "sample_submodel"]

_LAZY = {"UnifiedModel": "unified", "routing_metrics": "unified", "SubModel": "elastic",
         "export_submodel": "elastic", "sample_submodel": "elastic"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"tokenloom.model.{_LAZY[name]}"), name)
    raise AttributeError(name)
