"""Elastic training: which sub-model a training step runs (ERNIE 5.0's depth, width and sparsity).

`sample_submodel` is a pure function of (config, step): every rank of a run computes the same
draw without communicating, and a resumed run repeats the draws of the steps it replays.
"""

from __future__ import annotations

import numpy as np

from tokenloom.model.config import ModelConfig
from tokenloom.model.unified import SubModel


def sample_submodel(cfg: ModelConfig, step: int) -> SubModel:
    """The sub-model of training step `step`; the full model when elastic training is off."""
    e = cfg.elastic
    if not e.enabled:
        return SubModel()
    rng = np.random.default_rng([e.seed, step])
    layers = experts = top_k = None
    if rng.random() < e.depth_prob and cfg.n_layers > 1:
        keep = int(np.clip(round(rng.uniform(e.depth_min, e.depth_max) * cfg.n_layers), 1, cfg.n_layers - 1))
        layers = tuple(sorted(int(i) for i in rng.choice(cfg.n_layers, keep, replace=False)))
    if rng.random() < e.sparsity_prob and cfg.top_k > 1:
        top_k = int(rng.integers(1, cfg.top_k))
    if rng.random() < e.width_prob:
        k = top_k or cfg.top_k
        keep = int(np.clip(round(rng.uniform(e.width_min, e.width_max) * cfg.n_experts), k, cfg.n_experts))
        experts = tuple(sorted(int(i) for i in rng.choice(cfg.n_experts, keep, replace=False)))
    return SubModel(layers, experts, top_k)


def parse_indices(text: str, n: int, what: str) -> tuple[int, ...]:
    """'0,2,5' or '0-3,7' -> sorted unique indices in [0, n); a clear error otherwise."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"{what} takes indices like 0,2,5 or 0-3, got {text!r}") from None
    bad = [i for i in out if not 0 <= i < n]
    if bad or not out:
        raise ValueError(f"{what} {text!r} must name indices in [0, {n})")
    return tuple(sorted(out))
