"""Elastic sub-models: which sub-model a training step runs, and export of one as a standalone model.

ERNIE 5.0 trains one model so that its sub-models (fewer layers, routing over fewer experts, a
smaller top-k) stay usable. `SubModel` names such a restriction; `sample_submodel` is a pure
function of (config, step), so every rank of a run computes the same draw without
communicating and a resumed run repeats the draws of the steps it replays; `export_submodel`
copies a sub-model's weights into a smaller model whose outputs equal the full model's under
the same restriction.

This module does not import `unified` (which imports `SubModel` from here): `export_submodel`
builds the smaller model as `type(model)(cfg)`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenloom.model.config import ModelConfig

if TYPE_CHECKING:
    from tokenloom.model.unified import UnifiedModel


@dataclass(frozen=True)
class SubModel:
    """An elastic restriction: layers kept (None: all), experts routable (None: all), top-k (None: config)."""

    layers: tuple[int, ...] | None = None
    experts: tuple[int, ...] | None = None
    top_k: int | None = None

    @property
    def full(self) -> bool:
        """No restriction: the full model."""
        return self.layers is None and self.experts is None and self.top_k is None

    def describe(self) -> dict:
        return {"layers": list(self.layers) if self.layers is not None else None,
                "experts": len(self.experts) if self.experts is not None else None, "top_k": self.top_k}

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError unless this restriction fits a model of `cfg`: distinct layer and expert
        indices in range, a top-k in [1, the model's top-k] and no larger than the experts kept.
        The messages name the command-line options that set each field."""
        moe = cfg.moe
        for name, option, picked, n in (("layers", "--layers", self.layers, cfg.n_layers),
                                        ("experts", "--experts", self.experts, moe.n_experts)):
            if picked is None:
                continue
            if not picked or len(set(picked)) != len(picked) or not all(0 <= i < n for i in picked):
                raise ValueError(f"sub-model {name} {list(picked)} ({option}) must be distinct indices in [0, {n}) "
                                 "for this model")
        if self.top_k is not None and not 1 <= self.top_k <= moe.top_k:
            raise ValueError(f"sub-model top-k (--top-k) must be in [1, {moe.top_k}] for this model, got {self.top_k}")
        kept = moe.n_experts if self.experts is None else len(self.experts)
        if (self.top_k or moe.top_k) > kept:
            raise ValueError(f"top-k {self.top_k or moe.top_k} exceeds the {kept} experts kept (--experts, --top-k)")


def sample_submodel(cfg: ModelConfig, step: int) -> SubModel:
    """The sub-model of training step `step`; the full model when elastic training is off."""
    e, moe = cfg.elastic, cfg.moe
    if not e.enabled:
        return SubModel()
    rng = np.random.default_rng([e.seed, step])
    layers = experts = top_k = None
    if rng.random() < e.depth_prob and cfg.n_layers > 1:
        keep = int(np.clip(round(rng.uniform(e.depth_min, e.depth_max) * cfg.n_layers), 1, cfg.n_layers - 1))
        layers = tuple(sorted(int(i) for i in rng.choice(cfg.n_layers, keep, replace=False)))
    if rng.random() < e.sparsity_prob and moe.top_k > 1:
        top_k = int(rng.integers(1, moe.top_k))
    if rng.random() < e.width_prob:
        k = top_k or moe.top_k
        keep = int(np.clip(round(rng.uniform(e.width_min, e.width_max) * moe.n_experts), k, moe.n_experts))
        experts = tuple(sorted(int(i) for i in rng.choice(moe.n_experts, keep, replace=False)))
    return SubModel(layers, experts, top_k)


# Deployment tiers (ERNIE 5.0: full, mid and edge sub-models of one elastic model). Fractions of
# the layers and of the experts kept, and the top-k (None: the model's). Layers are spread evenly
# over the depth, first and last always kept; experts are the lowest-numbered ones (elastic
# width training routes through random subsets, so no subset is preferred).
TIERS: dict[str, tuple[float, float, int | None]] = {
    "full": (1.0, 1.0, None),
    "mid": (0.6, 0.6, None),
    "edge": (0.35, 0.35, 1),
}


def tier_submodel(cfg: ModelConfig, tier: str) -> SubModel:
    """The documented cut of a deployment tier (`TIERS`) for a model of `cfg`."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {tuple(TIERS)}, got {tier!r}")
    layer_frac, expert_frac, top_k = TIERS[tier]
    if tier == "full":
        return SubModel()
    n, e = cfg.n_layers, cfg.moe.n_experts
    keep_layers = max(1, min(n, round(layer_frac * n)))
    layers = tuple(sorted({int(round(x)) for x in np.linspace(0, n - 1, keep_layers)}))
    k = min(top_k or cfg.moe.top_k, cfg.moe.top_k)
    keep_experts = max(k, min(e, round(expert_frac * e)))
    return SubModel(layers, tuple(range(keep_experts)), k if k != cfg.moe.top_k else None)


# the per-expert tensors of a layer, indexed by expert along dim 0
_EXPERT_KEYS = ("moe.router", "moe.expert_bias", "moe.experts.gate_up", "moe.experts.down")


def export_submodel(model: UnifiedModel, sub: SubModel) -> UnifiedModel:
    """A standalone model equal to `model` under `sub`: fewer layers, fewer experts, smaller k."""
    sub.check(model.cfg)
    cfg = copy.deepcopy(model.cfg)
    layers = list(range(cfg.n_layers)) if sub.layers is None else sorted(sub.layers)
    experts = list(range(cfg.moe.n_experts)) if sub.experts is None else sorted(sub.experts)
    cfg.n_layers, cfg.moe.n_experts = len(layers), len(experts)
    cfg.moe.top_k = sub.top_k or cfg.moe.top_k
    cfg.elastic.enabled = False
    small = type(model)(cfg)
    state = model.state_dict()
    keep = torch.tensor(experts)
    out = {}
    for key in small.state_dict():
        if key.startswith("blocks."):
            _, new_i, rest = key.split(".", 2)
            src = state[f"blocks.{layers[int(new_i)]}.{rest}"]
            if rest in _EXPERT_KEYS:
                src = src[keep]
            out[key] = src.clone()
        else:
            out[key] = state[key].clone()
    small.load_state_dict(out)
    return small
