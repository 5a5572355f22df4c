"""The incremental plan without Ray: which inputs a job tokenizes, whose samples it deletes and
what it records in the source index, for new, changed, touched, removed and sidecar files."""

from __future__ import annotations

import json
import os

from PIL import Image

from tokenloom.datasets import sources
from tokenloom.platform.incremental import classify, plan, source_entry


def _index(files) -> dict[str, dict]:
    return {f.path: source_entry(f) for f in files}


def _corpus(tmp_path):
    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "cat.png")
    (tmp_path / "cat.txt").write_text("a red square")
    Image.new("RGB", (32, 32), (10, 10, 200)).save(tmp_path / "blue.png")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"image": "blue.png", "text": "a blue square"}) + "\n")
    (tmp_path / "doc.txt").write_text("a document")
    files, _ = sources.discover([tmp_path])
    return files


def test_first_job_tokenizes_pooled_files_and_records_every_input(tmp_path):
    files = _corpus(tmp_path)
    work = plan(files, classify(files, {}, [tmp_path]))
    names = [os.path.basename(f.path) for f in work.tokenize]
    assert names == ["cat.png", "doc.txt", "pairs.jsonl"]  # the caption and the paired image ride along
    assert work.delete_sources == []
    assert sorted(os.path.basename(e["path"]) for e in work.entries) == [
        "blue.png", "cat.png", "cat.txt", "doc.txt", "pairs.jsonl"]


def test_unchanged_inputs_plan_nothing_and_a_touch_is_recorded_only(tmp_path):
    files = _corpus(tmp_path)
    index = _index(files)
    assert plan(files, classify(files, index, [tmp_path])).empty
    os.utime(tmp_path / "doc.txt", ns=(1, 1))  # same bytes, new mtime
    touched, _ = sources.discover([tmp_path])
    work = plan(touched, classify(touched, index, [tmp_path]))
    assert work.empty and [os.path.basename(e["path"]) for e in work.entries] == ["doc.txt"]


def test_a_changed_caption_or_paired_image_rebuilds_the_samples_that_read_it(tmp_path):
    files = _corpus(tmp_path)
    index = _index(files)
    (tmp_path / "cat.txt").write_text("a crimson square, captioned again")
    Image.new("RGB", (32, 32), (10, 200, 10)).save(tmp_path / "blue.png")
    now, _ = sources.discover([tmp_path])
    work = plan(now, classify(now, index, [tmp_path]))
    assert sorted(os.path.basename(f.path) for f in work.tokenize) == ["cat.png", "pairs.jsonl"]
    assert sorted(os.path.basename(p) for p in work.delete_sources) == ["cat.png", "pairs.jsonl"]


def test_a_removed_caption_rebuilds_its_image_and_a_removed_file_waits_for_sync(tmp_path):
    files = _corpus(tmp_path)
    index = _index(files)
    (tmp_path / "cat.txt").unlink()
    (tmp_path / "doc.txt").unlink()
    now, _ = sources.discover([tmp_path])
    changes = classify(now, index, [tmp_path])
    assert sorted(os.path.basename(p) for p in changes.removed) == ["cat.txt", "doc.txt"]
    kept = plan(now, changes)
    assert [os.path.basename(f.path) for f in kept.tokenize] == ["cat.png"]
    assert [os.path.basename(p) for p in kept.delete_sources] == ["cat.png"]
    assert not any(e.get("removed") for e in kept.entries)
    synced = plan(now, changes, sync=True)
    assert sorted(os.path.basename(p) for p in synced.delete_sources) == ["cat.png", "cat.txt", "doc.txt"]
    assert sorted(os.path.basename(e["path"]) for e in synced.entries if e.get("removed")) == ["cat.txt", "doc.txt"]
