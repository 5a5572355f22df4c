"""Tokenizer bundles: a directory with weights, a JSON config and a content hash as its id.

The id is the SHA-256 of the bundle's files (names and bytes), so two trainings that give
the same tokenizer give the same id, and a shard that names a bundle names exact weights.
Weights are safetensors for neural tokenizers and HF `tokenizer.json` for BPE; nothing is
ever unpickled. Because the id is the content hash, a damaged bundle is detected by hashing
it again (`verify`) and is reported as a `BundleError` naming the bundle, before any job uses it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "bundle.json"
WEIGHTS = "model.safetensors"
KINDS = ("text", "visual", "audio")
TRAIN_HINT = {"text": "--corpus", "visual": "--images", "audio": "--audio"}


class BundleError(ValueError):
    """A tokenizer bundle that cannot be used as it is on disk (damaged, or of another kind)."""


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
    try:
        config = json.loads(config_path.read_text())
        kind = config["kind"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"tokenizer bundle {Path(path).name} is damaged: {config_path} is not a bundle "
                          f"config ({type(exc).__name__}: {exc})") from None
    return BundleInfo(id=Path(path).name, kind=kind, path=Path(path), config=config)


def verify(path: Path) -> BundleInfo:
    """Hash the bundle again: BundleError when its content no longer matches its id."""
    info = load_info(path)
    kind, _, digest = info.id.rpartition("-")
    if kind == info.kind and len(digest) == 16 and content_hash(Path(path))[:16] != digest:
        raise BundleError(f"tokenizer bundle {info.id} is damaged: its files no longer hash to its id "
                          f"(at {path}); restore it or train a new one")
    return info


def _bundles(store: Path, kind: str) -> list[Path]:
    """Bundles of one kind in the store, oldest first."""
    if not store.exists():
        return []
    return sorted((p for p in store.glob(f"{kind}-*") if (p / CONFIG_NAME).is_file()), key=lambda p: p.stat().st_mtime)


def latest(store: Path, kind: str) -> Path:
    """The newest bundle of `kind`, or FileNotFoundError saying how to make one."""
    found = _bundles(store, kind)
    if not found:
        raise FileNotFoundError(f"no {kind} tokenizer in {store}; train one with `tokenloom tokenizer train {kind} "
                                f"{TRAIN_HINT.get(kind, '')} PATH`")
    return found[-1]


def by_recipe(store: Path, kind: str, recipe: dict) -> BundleInfo | None:
    """The newest bundle of `kind` whose training config equals `recipe`, if any."""
    for path in reversed(_bundles(store, kind)):
        info = load_info(path)
        if info.config.get("config") == recipe:
            return info
    return None


def resolve(store: Path, bundle: str, kind: str | None = None) -> Path:
    """A bundle given by id (under `store`), by path, or as `latest` (the newest of `kind`)."""
    if bundle == "latest" and kind is not None:
        return latest(store, kind)
    candidate = Path(bundle)
    if (candidate / CONFIG_NAME).is_file():
        return candidate
    if (store / bundle / CONFIG_NAME).is_file():
        return store / bundle
    known = sorted(p.name for p in store.glob("*") if (p / CONFIG_NAME).is_file()) if store.exists() else []
    raise FileNotFoundError(
        f"no tokenizer bundle {bundle!r} in {store}; known bundles: {', '.join(known) or 'none'} "
        f"(train one with `tokenloom tokenizer train {kind or 'text'}`)"
    )


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
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    info = load_info(Path(path))
    if info.kind != kind or info.config.get("format") != fmt:
        raise BundleError(f"bundle {info.id} is a {info.kind} tokenizer, not a {kind} tokenizer ({fmt})")
    module = build(info.config)
    try:
        load_model(module, str(Path(path) / WEIGHTS), strict=True)
    except (SafetensorError, OSError, RuntimeError) as exc:  # RuntimeError: tensors that do not fit the config
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BundleError(f"tokenizer bundle {info.id} is damaged: {Path(path) / WEIGHTS}: {reason}") from None
    module.eval().requires_grad_(False)
    module.bundle_id = info.id
    return module
