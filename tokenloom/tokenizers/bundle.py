"""Tokenizer bundles: a directory with weights, a JSON config and a content hash as its id.

The id is the SHA-256 of the bundle's files (names and bytes), so two trainings that give
the same tokenizer give the same id, and a shard that names a bundle names exact weights.
Weights are safetensors for neural tokenizers and HF `tokenizer.json` for BPE; nothing is
ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "bundle.json"


def content_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class BundleInfo:
    id: str
    kind: str
    path: Path
    config: dict


def publish(staging: Path, store: Path, kind: str) -> BundleInfo:
    """Move a finished staging directory into `store/<kind>-<hash>/` and return its info.

    Publishing the same content twice is a no-op that returns the existing bundle.
    """
    bundle_id = f"{kind}-{content_hash(staging)[:16]}"
    final = store / bundle_id
    if final.exists():
        shutil.rmtree(staging)
    else:
        store.mkdir(parents=True, exist_ok=True)
        staging.rename(final)
    return load_info(final)


def staging_dir(store: Path) -> Path:
    store.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".staging-", dir=store))


def load_info(path: Path) -> BundleInfo:
    config_path = Path(path) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a tokenizer bundle (no {CONFIG_NAME})")
    config = json.loads(config_path.read_text())
    return BundleInfo(id=Path(path).name, kind=config["kind"], path=Path(path), config=config)


def resolve(store: Path, bundle: str) -> Path:
    """A bundle given by id (under `store`) or by path."""
    candidate = Path(bundle)
    if (candidate / CONFIG_NAME).is_file():
        return candidate
    if (store / bundle / CONFIG_NAME).is_file():
        return store / bundle
    known = sorted(p.name for p in store.glob("*") if (p / CONFIG_NAME).is_file()) if store.exists() else []
    raise FileNotFoundError(
        f"no tokenizer bundle {bundle!r} in {store}; known bundles: {', '.join(known) or 'none'} "
        "(train one with `tokenloom tokenizer train text`)"
    )


WEIGHTS = "model.safetensors"


def publish_module(module, store: Path, kind: str, doc: dict) -> BundleInfo:
    """Publish a torch module as a neural tokenizer bundle: safetensors weights plus
    `bundle.json` (`doc` with its `kind`), content-addressed like every bundle."""
    from safetensors.torch import save_model

    staging = staging_dir(store)
    save_model(module, str(staging / WEIGHTS))
    (staging / CONFIG_NAME).write_text(json.dumps({**doc, "kind": kind}, indent=2, sort_keys=True))
    return publish(staging, store, kind)


def load_module(path: Path | str, kind: str, fmt: str, build):
    """Load a bundle written by `publish_module`: check kind and format, `build(config)` the
    module, load its weights (safetensors, strict), return it in eval mode without gradients."""
    from safetensors.torch import load_model

    info = load_info(Path(path))
    if info.kind != kind or info.config.get("format") != fmt:
        raise ValueError(f"bundle {info.id} is a {info.kind} tokenizer, not a {kind} tokenizer ({fmt})")
    module = build(info.config)
    load_model(module, str(Path(path) / WEIGHTS), strict=True)
    module.eval().requires_grad_(False)
    module.bundle_id = info.id
    return module
