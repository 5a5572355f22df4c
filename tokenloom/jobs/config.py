"""The run configuration: composes each component's config; read from TOML plus overrides.

Every component owns a small dataclass; this file only nests them, so a TOML file has one
table per component (`[train]`, `[model]`, `[ingest.pools.text]`, ...) and the command line
takes dotted overrides (`train.steps=50 model.dim=128`). Unknown keys and ill-typed values
fail with a message that names the key and what it accepts.

Recipes are TOML files in the repository's `configs/` folder (`demo`, `tiny`, `gpu`); a
`--config` that names no file but a recipe (`--config tiny`) reads `configs/<name>.toml`.
The dataclass defaults are the embedded setup; a recipe only sets what differs.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
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
from tokenloom.trainer.rl.config import RLConfig

RECIPES = Path(__file__).resolve().parents[2] / "configs"  # the repository's recipe folder


@dataclass
class DemoConfig:
    """How much sample data `tokenloom demo` writes and trains its media tokenizers on."""

    dataset: str = "stdlib-docs"
    corpus_bytes: int = 2_000_000  # stdlib docstrings
    image_variants: int = 2  # crops per sample photo
    utterances: int = 24  # speech files with transcripts
    speech_train_clips: int = 96  # utterances the demo's audio tokenizer trains on
    speech_heldout_clips: int = 6
    videos: int = 4  # short synthetic clips with a spoken sound track (plus one paired, plus broken ones)


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
    demo: DemoConfig = field(default_factory=DemoConfig)
    rl: RLConfig = field(default_factory=RLConfig)


def _coerce(value, hint, key: str):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # `X | None`: "none" or an X
        if value is None or str(value).lower() in ("none", "null"):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
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
    if origin is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):  # a TOML array of tables
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ValueError(f"config key {key} is a list of tables ([[{key}]] in TOML)")
        items = []
        for i, table in enumerate(value):
            item = typing.get_args(hint)[0]()
            _apply(item, table, f"{key}[{i}].")
            items.append(item)
        return items
    if origin is dict:  # an inline table of name = number
        if not isinstance(value, dict):
            raise ValueError(f"config key {key} is a table of name = number, e.g. {key} = {{a = 0.7, b = 0.3}}")
        value_hint = typing.get_args(hint)[1] if typing.get_args(hint) else str
        return {str(k): _coerce(v, value_hint, f"{key}.{k}") for k, v in value.items()}
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


def apply_overrides(section, overrides: list[str], prefix: str = "") -> None:
    """Set `key=value` overrides on one config dataclass (keys relative to it; `prefix` names it in errors)."""
    _apply(section, _nest(parse_overrides(overrides)), prefix)


def recipe_path(name_or_path: str | Path) -> Path:
    """A config file path, or the recipe `configs/<name>.toml` for a bare name such as `tiny`."""
    path = Path(name_or_path)
    if path.is_file() or path.suffix or len(path.parts) > 1:
        return path
    recipe = RECIPES / f"{name_or_path}.toml"
    if not recipe.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.toml")) if RECIPES.is_dir() else []
        raise FileNotFoundError(f"config {name_or_path!r} is neither a file nor a recipe in {RECIPES} "
                                f"(recipes: {', '.join(known) or 'none'})")
    return recipe


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    base: RunConfig | None = None) -> RunConfig:
    """The defaults, then the TOML file (or recipe name) `path`, then dotted `overrides`."""
    cfg = base or RunConfig()
    if path is not None:
        path = recipe_path(path)
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

