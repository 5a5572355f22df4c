"""model: the unified multimodal MoE transformer over one token space (single-device code).

Exports resolve lazily so that reading a config does not import torch.
"""

from tokenloom.model.config import ElasticConfig, ModelConfig

__all__ = ["ElasticConfig", "ModelConfig", "SubModel", "UnifiedModel", "export_submodel", "routing_metrics"]


def __getattr__(name: str):
    if name in ("UnifiedModel", "SubModel", "export_submodel", "routing_metrics"):
        from tokenloom.model import unified

        return getattr(unified, name)
    raise AttributeError(name)
