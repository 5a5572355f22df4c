"""The run configuration: composes each component's config; read from TOML plus overrides.

Every component owns a small dataclass; this file only nests them, so a TOML file has one
table per component (`[train]`, `[model]`, `[ingest.pools.text]`, ...) and the command line
takes dotted overrides (`train.steps=50 model.dim=128`). Unknown keys and ill-typed values
fail with a message that names the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.catalog import CatalogConfig
from tokenloom.datasets import StreamConfig
from tokenloom.model import ModelConfig
from tokenloom.platform.config import IngestConfig, PoolConfig
from tokenloom.tokenizers.audio.config import AudioTokenizerConfig
from tokenloom.tokenizers.text import TextTokenizerConfig
from tokenloom.tokenizers.visual.config import VisualTokenizerConfig
from tokenloom.trainer import TrainConfig


@dataclass
class RunConfig:
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    text_tokenizer: TextTokenizerConfig = field(default_factory=TextTokenizerConfig)
    visual_tokenizer: VisualTokenizerConfig = field(default_factory=VisualTokenizerConfig)
    audio_tokenizer: AudioTokenizerConfig = field(default_factory=AudioTokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def _coerce(value, hint, key: str):
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"config key {key} takes true/false, got {value!r}")
    if hint in (int, float, str):
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ValueError(f"config key {key} takes a {hint.__name__}, got {value!r}") from None
    if origin is tuple:
        items = value if isinstance(value, list | tuple) else str(value).split(",")
        args = typing.get_args(hint)
        if len(items) != len(args):
            raise ValueError(f"config key {key} takes {len(args)} comma-separated values, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(items, args, strict=True))
    return value


def _apply(obj, data: dict, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ValueError(f"unknown config key {full!r}; {prefix or 'top level'} accepts: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {full!r} is a section; set its fields, e.g. {full}.<field>=...")
            _apply(current, value, full + ".")
        elif isinstance(current, dict) and key == "pools":
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise ValueError(f"config key {full!r} is a section per modality; set e.g. {full}.text.max_actors=4")
            for modality, pool_data in value.items():
                pool = current.setdefault(modality, PoolConfig())
                _apply(pool, pool_data, f"{full}.{modality}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], full))


def _nest(dotted: dict[str, str]) -> dict:
    out: dict = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"config key {key!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (for example train.steps=50)")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def load_run_config(path: Path | None = None, overrides: list[str] | None = None,
                    base: RunConfig | None = None) -> RunConfig:
    cfg = base or RunConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
        _apply(cfg, data, "")
    if overrides:
        _apply(cfg, _nest(parse_overrides(overrides)), "")
    return cfg

