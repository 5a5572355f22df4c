"""Shared fixtures: small real inputs, made by the project's own code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def one_ray_session():
    """The ingestion tests share the local Ray runtime the first of them starts (`platform.ingest.
    ensure_ray` reuses a running one): starting Ray and its workers costs tens of seconds per
    module on two cores. It stops when the session ends."""
    yield
    import sys

    if "ray" in sys.modules:
        from tokenloom.platform.ingest import shutdown_ray

        shutdown_ray()


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory) -> Path:
    from tokenloom.samples.text import write_sample_corpus

    return write_sample_corpus(tmp_path_factory.mktemp("corpus"), max_bytes=150_000, with_bad_inputs=False)


@pytest.fixture(scope="session")
def corpus_texts(stdlib_corpus) -> list[str]:
    texts = []
    for path in sorted(stdlib_corpus.glob("*.jsonl")):
        texts += [json.loads(line)["text"] for line in path.read_text().splitlines()]
    return texts


@pytest.fixture(scope="session")
def text_bundle(tmp_path_factory, corpus_texts):
    from tokenloom.tokenizers.text import TextTokenizerConfig, train_text_tokenizer

    return train_text_tokenizer(corpus_texts, tmp_path_factory.mktemp("bundles"), TextTokenizerConfig(vocab_size=600))
