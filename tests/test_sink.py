"""The shard sink's write task on blocks with a known fate per row: what it writes, quarantines and
records as filtered, whether every row is kept (its no-copy path) or some are dropped."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenloom.platform.sink import ShardSink
from tokenloom.platform.workers import OUT_SCHEMA, _Marks, _output
from tokenloom.tokenizers.sequence import ImagePart, SampleLayout, TextPart
from tokenloom.tokenizers.vocab import VocabManifest

VOCAB = VocabManifest.build(200, visual_size=64)


class _Ctx:
    task_idx = 3


def _block(rows: list[dict]) -> pa.Table:
    """Pool output rows: each dict has `kind` (text, image, error, bad_id, filtered) and an index."""
    layout = SampleLayout(VOCAB)
    n = len(rows)
    batch = pa.table({"sample_id": [f"s{r['i']}" for r in rows], "source": ["src.jsonl"] * n,
                      "record": [f"src.jsonl:{r['i']}" for r in rows],
                      "error": [("malformed JSON: at column 3" if r["kind"] == "error" else None) for r in rows]})
    tokens, segments, marks = [None] * n, [None] * n, _Marks(n)
    for j, r in enumerate(rows):
        if r["kind"] == "error":
            continue
        marks.modality[j], marks.hashes[j] = "text", f"h{r['i']}"
        parts = [TextPart(np.arange(1, 4 + r["i"] % 5))]
        if r["kind"] == "image":
            parts = [ImagePart(np.arange(6).reshape(2, 3)), *parts]
        tokens[j], segments[j] = layout.assemble(parts)
        if r["kind"] == "bad_id":  # a worker bug the sink must catch: an id outside the vocabulary
            tokens[j] = np.concatenate([tokens[j], [VOCAB.size + 5]])
            segments[j][-1] = {**segments[j][-1], "length": segments[j][-1]["length"] + 1}
        if r["kind"] == "filtered":
            marks.filter[j], marks.reason[j] = "min_chars", "12 characters < 50"
    return _output("text", batch, tokens, segments, marks=marks)


@pytest.mark.parametrize("with_drops", [False, True])
def test_the_sink_writes_every_kept_row_once_and_each_dropped_row_where_it_belongs(tmp_path, with_drops):
    kinds = ["text", "image", "text", "image", "text"]
    if with_drops:
        kinds += ["error", "bad_id", "filtered", "text", "bad_id"]
    rows = [{"kind": k, "i": i} for i, k in enumerate(kinds)]
    blocks = [_block(rows[:4]), _block(rows[4:])]
    assert blocks[0].schema == OUT_SCHEMA
    sink = ShardSink(str(tmp_path / "data"), "job1", VOCAB.id, VOCAB.size, ["b1"])
    sink.on_write_start()
    out = sink.write(blocks, _Ctx())

    kept = {f"s{r['i']}" for r in rows if r["kind"] in ("text", "image")}
    written = pa.concat_tables([pq.read_table(uri.removeprefix("file://")) for uri in out.data_files])
    assert sorted(written.column("sample_id").to_pylist()) == sorted(kept)
    assert out.samples == len(kept) and out.keys.num_rows == len(kept)
    assert sorted(out.keys.column("sample_id").to_pylist()) == sorted(kept)
    # one file per modality mix, each holding only its mix, and the keys point at the right file
    assert len(out.data_files) == 2
    for uri in out.data_files:
        table = pq.read_table(uri.removeprefix("file://"))
        assert len(set(table.column("modalities").to_pylist())) == 1
        mine = out.keys.filter(pa.compute.equal(out.keys.column("data_file"), uri))
        assert sorted(mine.column("sample_id").to_pylist()) == sorted(table.column("sample_id").to_pylist())
    # tokens written are the pool's, row for row
    by_id = {sid: toks for b in blocks for sid, toks in zip(b.column("sample_id").to_pylist(),
                                                            b.column("tokens").to_pylist(), strict=True)}
    assert all(by_id[s] == t for s, t in zip(written.column("sample_id").to_pylist(),
                                             written.column("tokens").to_pylist(), strict=True))
    assert out.tokens == sum(len(by_id[s]) for s in kept)

    if not with_drops:
        assert out.quarantined == 0 and out.filtered == 0 and not out.quarantine_files
        return
    bad = pq.read_table(out.quarantine_files[0].removeprefix("file://"))
    assert sorted(bad.column("record").to_pylist()) == ["src.jsonl:5", "src.jsonl:6", "src.jsonl:9"]
    assert out.reasons == {"malformed JSON": 1, "validation": 2}
    filtered = pq.read_table(out.filtered_files[0].removeprefix("file://"))
    assert filtered.column("sample_id").to_pylist() == ["s7"] and out.filter_counts == {"min_chars": 1}
