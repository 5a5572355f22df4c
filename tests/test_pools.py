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


@pytest.mark.integration
def test_a_jsonl_read_as_byte_ranges_commits_the_whole_files_samples(tmp_path, text_bundle):
    """Split reading (`ingest.split_bytes`): one corpus as 12 ranges commits the same samples (ids,
    tokens) and the same quarantine records as the file read whole."""
    import json

    from tokenloom.catalog import CatalogConfig, TokenCatalog
    from tokenloom.datasets.sources import byte_ranges, sample_id
    from tokenloom.platform.config import IngestConfig
    from tokenloom.platform.ingest import run_ingest
    from tokenloom.tokenizers.text import TextTokenizer
    from tokenloom.tokenizers.vocab import VocabManifest

    corpus = tmp_path / "corpus" / "big.jsonl"
    corpus.parent.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * j) % 97}" for j in range(i % 40 + 3))})
             for i in range(1500)]
    lines[10], lines[700], lines[1499] = "{broken", '{"text": ""}', '{"no": "text"}'
    corpus.write_text("\n".join(lines) + "\n")
    split_bytes = corpus.stat().st_size // 12 + 1
    assert len(byte_ranges(corpus.stat().st_size, split_bytes)) == 12

    vocab = VocabManifest.build(TextTokenizer.load(text_bundle.path).vocab_size, bundles={"text": text_bundle.id})
    catalog = TokenCatalog(CatalogConfig(), tmp_path / "home")
    got = {}
    for name, size in (("whole", 0), ("split", split_bytes)):
        cfg = IngestConfig()
        cfg.ray.progress_bars = False
        cfg.split_bytes = size
        cfg.dedup.enabled = False  # every document kept: the comparison is of reading, not of dedup
        result = run_ingest([corpus.parent], name, catalog, vocab, {"text": str(text_bundle.path)}, cfg)
        table = catalog.scan(name, columns=("sample_id", "source", "tokens"))
        got[name] = (sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True)),
                     result.quarantine_reasons)
    assert got["split"] == got["whole"]
    rows, reasons = got["split"]
    # a sample's id is its (file, line number): every good line once, numbered as in the whole file
    expected = {sample_id(str(corpus), f"line {i + 1}") for i in range(1500) if i not in (10, 700, 1499)}
    assert len(rows) == 1497 and {r[0] for r in rows} == expected
    assert sum(reasons.values()) == 3


def _corpus(folder, n: int, poison: set[int] = frozenset()):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"record {i} " + ("POISON-PILL " if i in poison else "")
                                 + " ".join(f"w{(i * j) % 89}" for j in range(i % 30 + 5))}) for i in range(n)]
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _ingest(catalog, name, corpus, text_bundle, workers_bundle=None, **changes):
    from tokenloom.platform.config import IngestConfig
    from tokenloom.platform.ingest import run_ingest
    from tokenloom.tokenizers.text import TextTokenizer
    from tokenloom.tokenizers.vocab import VocabManifest

    vocab = VocabManifest.build(TextTokenizer.load(text_bundle.path).vocab_size, bundles={"text": text_bundle.id})
    cfg = IngestConfig()
    cfg.ray.progress_bars = False
    cfg.dedup.enabled = False
    pool = cfg.pools["text"]
    pool.batch_size = 16
    for key, value in changes.items():
        target, attr = (cfg.faults, key) if key in ("kill_after_batches", "crash_on") else (pool, key)
        setattr(target, attr, value)
    result = run_ingest([corpus], name, catalog, vocab, {"text": str(workers_bundle or text_bundle.path)}, cfg)
    table = catalog.scan(name, columns=("sample_id", "tokens"))
    return result, sorted(zip(table.column("sample_id").to_pylist(), table.column("tokens").to_pylist(), strict=True))


@pytest.mark.integration
@pytest.mark.long
def test_a_pool_actor_killed_mid_job_loses_and_duplicates_nothing(tmp_path, text_bundle):
    """SIGKILL of a text-pool actor after it tokenized its third batch (before returning it): Ray
    restarts it and retries the batch; the committed samples are exactly the fault-free job's."""
    from tokenloom.catalog import CatalogConfig, TokenCatalog

    corpus = _corpus(tmp_path / "corpus", 400)
    catalog = TokenCatalog(CatalogConfig(), tmp_path / "home")
    clean, expected = _ingest(catalog, "clean", corpus, text_bundle)  # a small job: tasks, no fault
    killed, got = _ingest(catalog, "killed", corpus, text_bundle, task_below_bytes=0, kill_after_batches=3)
    assert killed.pools["text"]["injected_kills"] == 1 and "injected_kills" not in clean.pools["text"]
    assert (clean.pools["text"]["mode"], killed.pools["text"]["mode"]) == ("tasks", "actors")
    assert got == expected and len(got) == 400 == killed.samples
    # the per-pool figures: every routed record came out of the pool once, and its tokens are the samples'
    for result in (clean, killed):
        figures = result.pools["text"]
        assert figures["records"] == figures["records_at_sink"] == 400
        assert figures["tokens"] == result.tokens and figures["seconds"] > 0 and 0 < figures["busy_fraction"] <= 1


@pytest.mark.integration
@pytest.mark.long
def test_records_that_kill_their_worker_are_quarantined_and_the_job_goes_on(tmp_path, text_bundle):
    """Two records whose tokenizing kills the worker process (an injected segfault): each is
    quarantined with the reason, every other record is committed once, on tasks and on actors."""
    from tokenloom.catalog import CatalogConfig, TokenCatalog
    from tokenloom.datasets.sources import sample_id
    from tokenloom.platform.guard import CRASH_REASON

    corpus = _corpus(tmp_path / "corpus", 120, poison={7, 8})  # lines 8 and 9: one batch of 16
    catalog = TokenCatalog(CatalogConfig(), tmp_path / "home")
    _, clean = _ingest(catalog, "clean", corpus, text_bundle)  # no fault injected: all 120
    path = str(corpus / "corpus.jsonl")
    poisoned = {sample_id(path, "line 8"), sample_id(path, "line 9")}
    expected = [row for row in clean if row[0] not in poisoned]
    assert len(clean) == 120 and len(expected) == 118
    for name, threshold in (("tasks", 1 << 40), ("actors", 0)):
        result, got = _ingest(catalog, name, corpus, text_bundle, task_below_bytes=threshold, crash_on="POISON-PILL")
        assert result.pools["text"]["mode"] == name
        assert (result.samples, result.quarantined, result.quarantine_reasons) == (118, 2, {CRASH_REASON: 2})
        assert got == expected


@pytest.mark.integration
def test_a_tokenizer_that_cannot_start_names_its_pool_and_commits_nothing(tmp_path, text_bundle):
    import shutil

    from tokenloom.catalog import CatalogConfig, TokenCatalog

    broken = tmp_path / "broken-bundle"
    shutil.copytree(text_bundle.path, broken)
    (broken / "tokenizer.json").write_text('{"model": 12')
    corpus = _corpus(tmp_path / "corpus", 40)
    catalog = TokenCatalog(CatalogConfig(), tmp_path / "home")
    for name, threshold in (("tasks", 1 << 40), ("actors", 0)):
        with pytest.raises(ValueError) as err:
            _ingest(catalog, name, corpus, text_bundle, broken, task_below_bytes=threshold)
        message = str(err.value)
        assert message.startswith("the text tokenizer pool could not start: tokenizer bundle") and "damaged" in message
        assert message.endswith("nothing committed") and "\n" not in message
        assert not catalog.exists(name) or catalog.snapshot(name) is None


def test_the_journal_isolates_a_batch_that_killed_a_worker_and_quarantines_the_record_it_names(tmp_path):
    """What a retried batch does, by the journal entry the dead process left (platform/guard.py)."""
    import hashlib
    import json

    import pyarrow as pa

    from tokenloom.platform.guard import CRASH_REASON, BatchGuard

    ids = ["a", "b", "c", "d"]
    batch = pa.table({"sample_id": ids, "payload": ["x"] * 4})
    entry = tmp_path / f"text-{hashlib.sha1(chr(0).join(ids).encode()).hexdigest()}"
    calls = []

    def tokenize(b):
        calls.append(b.column("sample_id").to_pylist())
        return b.append_column("out", pa.array(["tokens"] * b.num_rows))

    def quarantine(b, reason):
        return b.append_column("out", pa.array([reason] * b.num_rows))

    def run(state):
        calls.clear()
        if state is not None:
            entry.write_text(json.dumps(state))
        out = BatchGuard(str(tmp_path), "text").run(batch, tokenize, quarantine)
        assert not entry.exists()  # done: the entry is gone
        return out.column("sample_id").to_pylist(), out.column("out").to_pylist()

    assert run(None) == (ids, ["tokens"] * 4) and calls == [ids]  # no crash before: one call
    assert run({"mode": "batch", "poisoned": []}) == (ids, ["tokens"] * 4)  # a crash: record by record
    assert calls == [["a"], ["b"], ["c"], ["d"]]
    # a crash while "c" was named, after one while "a" was: both quarantined, the rest tokenized once
    assert run({"mode": "record", "current": "c", "poisoned": ["a"]}) == (
        ids, [CRASH_REASON, "tokens", CRASH_REASON, "tokens"])
    assert calls == [["b"], ["d"]]


@pytest.mark.integration
@pytest.mark.long
def test_on_a_three_node_cluster_each_pool_runs_only_where_its_label_is(tmp_path, text_bundle):
    """`ray.cluster_utils.Cluster`: a head without pool labels, a node labelled for the text pool,
    one for the image pool (where videos go too) and one for the audio pool. The same ingestion,
    pointed at the cluster (`ingest.ray.address`), commits every record, and each pool's records
    were tokenized only on its labelled node: a video's frames on the image node, its sound on the
    audio node."""
    import shutil

    import ray
    import torch
    from ray.cluster_utils import Cluster

    from tokenloom.jobs.config import RunConfig
    from tokenloom.jobs.home import Home
    from tokenloom.jobs.ingest import ingest
    from tokenloom.platform.ingest import shutdown_ray, token_auth_for_clusters
    from tokenloom.samples.images import write_sample_images
    from tokenloom.samples.video import write_sample_videos
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig
    from tokenloom.tokenizers.audio import publish_bundle as publish_audio
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle

    home = Home(tmp_path / "home")
    inputs = tmp_path / "inputs"
    write_sample_images(inputs / "photos", with_bad_inputs=False, variants=0)
    _corpus(inputs / "docs", 60)
    write_sample_videos(inputs / "videos", with_bad_inputs=False, clips=2)
    cfg = RunConfig()
    cfg.visual_tokenizer = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                 vit_heads=2, fusion_heads=2, max_pixels=64 * 64)
    torch.manual_seed(0)
    untrained = VisualTokenizer(cfg.visual_tokenizer)
    untrained.init_codebook(torch.rand(64, 3, 32, 32))
    visual = publish_bundle(untrained.eval(), home.bundles)
    cfg.audio_tokenizer = AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=2,
                                               codebook_size=32, code_dim=4, chunk_seconds=2.0)
    sound = AudioTokenizer(cfg.audio_tokenizer)
    sound.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    audio = publish_audio(sound.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg.ingest.ray.progress_bars = False
    cfg.ingest.dedup.enabled = False

    shutdown_ray()  # the session's local runtime: this test brings its own cluster
    # the nodes must use the token auth the driver will use to connect (`ingest.ray.address`), whether
    # or not an earlier test of the session enabled it
    token_auth_for_clusters()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        text_node = cluster.add_node(num_cpus=1, resources={"text_pool": 2})
        image_node = cluster.add_node(num_cpus=1, resources={"image_pool": 2})
        audio_node = cluster.add_node(num_cpus=1, resources={"audio_pool": 2})
        cluster.wait_for_nodes()
        cfg.ingest.ray.address = cluster.address
        result = ingest(home, [inputs], "spread", cfg, {"text": text_bundle.id, "visual": visual.id,
                                                       "audio": audio.id})
    finally:
        ray.shutdown()
        cluster.shutdown()
    pools = result.pools
    assert set(pools) == {"text", "image", "video", "video_sound"}
    assert pools["text"]["nodes"] == {text_node.node_id: 60}  # the 60 documents, all on the text node
    assert set(pools["image"]["nodes"]) == {image_node.node_id} and pools["image"]["records"] > 5
    assert pools["video"]["nodes"] == {image_node.node_id: 3}  # 2 captioned clips and 1 paired
    assert pools["video_sound"]["nodes"] == {audio_node.node_id: 3}
    assert result.samples == 60 + pools["image"]["records"] + 3 - result.quarantined - result.filtered
