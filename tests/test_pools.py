"""Pool stages: a small job runs its tokenizer as Ray tasks, a large one on an actor pool
(`platform/pools.py`); both must commit exactly the same shards."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_task_and_actor_pools_commit_the_same_samples(tmp_path, stdlib_corpus, text_bundle):
    from tokenloom.catalog import CatalogConfig, TokenCatalog
    from tokenloom.platform.config import IngestConfig
    from tokenloom.platform.ingest import run_ingest
    from tokenloom.tokenizers.text import TextTokenizer
    from tokenloom.tokenizers.vocab import VocabManifest

    vocab = VocabManifest.build(TextTokenizer.load(text_bundle.path).vocab_size, bundles={"text": text_bundle.id})
    catalog = TokenCatalog(CatalogConfig(), tmp_path)
    rows = {}
    for name, threshold in (("tasks", 1 << 40), ("actors", 0)):
        cfg = IngestConfig()
        cfg.ray.progress_bars = False
        cfg.pools["text"].task_below_bytes = threshold
        result = run_ingest([stdlib_corpus], name, catalog, vocab, {"text": str(text_bundle.path)}, cfg)
        assert result.samples > 10
        table = catalog.scan(name, columns=("sample_id", "tokens", "content_hash"))
        rows[name] = sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))
    assert rows["tasks"] == rows["actors"]
