from pathlib import Path

from tokenloom.datasets import sources
from tokenloom.samples.text import write_bad_inputs


def test_bad_inputs_become_quarantine_records_with_reasons(tmp_path):
    expected = write_bad_inputs(tmp_path)
    files, skipped = sources.discover([tmp_path])
    assert not skipped and len(files) == len(expected)
    by_file = {}
    for f in files:
        recs = list(sources.parse_file(f.path, f.modality, Path(f.path).read_bytes()))
        by_file[f.path.rsplit("/", 1)[-1]] = recs
    for name, bad_count in expected.items():
        assert sum(r.error is not None for r in by_file[name]) == bad_count, name
    reasons = {r.error for recs in by_file.values() for r in recs if r.error}
    assert "invalid UTF-8 at byte 3" in reasons
    assert "empty document" in reasons
    assert "content is a PNG image, not text" in reasons
    assert "record has no string field 'text'" in reasons
    assert any(r.startswith("malformed JSON") for r in reasons)
    good = [r.payload for r in by_file["mixed.jsonl"] if r.error is None]
    assert good == ["A good line survives its bad neighbours.", "Another good line, counted once."]


def test_sample_ids_are_stable_and_distinct(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    first = [r.sample_id for r in sources.parse_file(str(path), "text", path.read_bytes())]
    second = [r.sample_id for r in sources.parse_file(str(path), "text", path.read_bytes())]
    assert first == second and len(set(first)) == 2
    moved = tmp_path / "b.jsonl"
    moved.write_bytes(path.read_bytes())
    elsewhere = [r.sample_id for r in sources.parse_file(str(moved), "text", moved.read_bytes())]
    assert not set(elsewhere) & set(first)  # ids name (source, record), not content
    assert first[0] == sources.sample_id(str(path), "line 1")


def test_discover_routes_by_suffix_and_rejects_missing_paths(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.csv").write_text("x,y")
    files, skipped = sources.discover([tmp_path, tmp_path / "a.txt"])
    assert [f.modality for f in files] == ["text"]  # listed twice, read once
    assert skipped and "no tokenizer pool" in skipped[0][1]
    try:
        sources.discover([tmp_path / "nope"])
    except FileNotFoundError as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError("missing path accepted")
