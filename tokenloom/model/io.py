"""A trained model on disk: `model.safetensors` (weights) + `model.json` (its ModelConfig).

Loading never unpickles. Tied output weights are stored once (as the embedding). Model folders
written before the experts' settings moved into `ModelConfig.moe` hold them as flat config keys
(`n_experts`, `top_k`, ...); `config_from_dict` reads both forms.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenloom.model.config import ElasticConfig, ModelConfig, MoEConfig
from tokenloom.model.unified import UnifiedModel

FORMAT = "tokenloom.model/1"


def config_from_dict(doc: dict) -> ModelConfig:
    """A ModelConfig from its `dataclasses.asdict` form, nested (`moe: {...}`) or with flat MoE keys."""
    doc = dict(doc)
    elastic = ElasticConfig(**doc.pop("elastic", {}))
    moe = dict(doc.pop("moe", {}))
    flat = [f.name for f in dataclasses.fields(MoEConfig) if f.name in doc]
    if flat and moe:
        raise ValueError(f"model config gives the expert settings both nested (moe) and flat ({flat}); keep one")
    moe.update({name: doc.pop(name) for name in flat})
    doc["audio_ranges"] = tuple(tuple(r) for r in doc.get("audio_ranges", ()))
    doc.setdefault("rope_axes", "sections")  # folders written before the key existed used sections
    return ModelConfig(**doc, moe=MoEConfig(**moe), elastic=elastic)


def save_model(state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, extra: dict | None = None) -> Path:
    """Write a model folder from a full (not expert-sharded) state dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    doc = {"format": FORMAT, "config": dataclasses.asdict(cfg), **(extra or {})}
    (out / "model.json").write_text(json.dumps(doc, indent=2))
    return out


def annotate_model(folder: Path, **entries) -> None:
    """Add entries to a model folder's model.json (e.g. the vocabulary manifest it was trained on)."""
    meta = Path(folder) / "model.json"
    doc = json.loads(meta.read_text())
    doc.update(entries)
    tmp = meta.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(meta)


def load_model(path: Path) -> tuple[UnifiedModel, dict]:
    """A model folder -> (model in eval mode, its model.json document)."""
    path = Path(path)
    meta_path, weights = path / "model.json", path / "model.safetensors"
    if not meta_path.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{path} is not a model folder (it needs model.json and model.safetensors)")
    doc = json.loads(meta_path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a TokenLoom model (format={doc.get('format')!r})")
    cfg = config_from_dict(doc["config"])
    model = UnifiedModel(cfg)
    state = load_file(str(weights))
    if cfg.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state)
    return model.eval(), doc
