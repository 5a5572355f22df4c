"""The home folder every job works in, and the look-ups jobs share.

A home (`./.tokenloom`, `--home`, or TOKENLOOM_HOME) holds everything a run makes: the sample
corpus, tokenizer bundles, vocabulary manifests, the SQLite catalog and its warehouse, runs and
evaluations. Jobs find things through these helpers so that a missing or damaged piece is
reported the same way wherever it is needed.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import tokenloom
from tokenloom.catalog import DatasetNotFound, TokenCatalog
from tokenloom.tokenizers import bundle as bundles
from tokenloom.tokenizers.vocab import VocabManifest

# mistakes a user can fix (the command line prints them as one line and exits with status 2);
# a damaged bundle is a tokenizers.bundle.BundleError, a ValueError
USER_ERRORS = (ValueError, FileNotFoundError, DatasetNotFound, PermissionError)


@dataclass(frozen=True)
class Home:
    root: Path

    @staticmethod
    def resolve(path: str | Path | None = None) -> Home:
        return Home(Path(path or os.environ.get("TOKENLOOM_HOME") or ".tokenloom").absolute())

    @property
    def bundles(self) -> Path:
        return self.root / "bundles"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    def new_dir(self, prefix: str, name: str | None = None, folder: str = "runs") -> Path:
        """`<folder>/<name>`, or a fresh `<folder>/<prefix>-<time>-<random>` when no name is given."""
        return self.root / folder / (name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")

    def bundle(self, ref: str | None, kind: str) -> bundles.BundleInfo:
        """A bundle of `kind` by id, path or `latest` (None: latest), hashed again so a damaged
        bundle is refused with its name before any worker loads it."""
        info = bundles.verify(bundles.resolve(self.bundles, ref or "latest", kind))
        if info.kind != kind:
            raise bundles.BundleError(f"bundle {info.id} is a {info.kind} tokenizer, not a {kind} one")
        return info

    def manifest(self, vocab_id: str) -> VocabManifest:
        path = self.vocab / f"{vocab_id}.json"
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary manifest {vocab_id} not found in {self.vocab}")
        return VocabManifest.load(path)


def open_catalog(home: Home, cfg) -> TokenCatalog:
    return TokenCatalog(cfg.catalog, home.root)


def code_version() -> str:
    """The package version plus the git commit it runs from, when there is one."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(tokenloom.__file__).parent,
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{tokenloom.__version__}+{sha}" if sha else tokenloom.__version__


def model_folder(path: Path) -> Path:
    """A model folder, or a training run folder holding one under model/."""
    path = Path(path)
    if (path / "model" / "model.json").is_file():
        return path / "model"
    if (path / "model.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither a model folder nor a training run with a model/ folder")
