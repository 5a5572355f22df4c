import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _parse_all(files):
    """Every record of a job's pooled sources, by file name."""
    return {Path(f.path).name: list(sources.parse_file(f.path, f.modality, Path(f.path).read_bytes()))
            for f in files if f.modality not in sources.UNPOOLED}


def test_deeply_nested_json_is_quarantined_not_fatal(tmp_path):
    deep, shallow_deep = "[" * 100_000 + "]" * 100_000, "[" * 20_000 + "]" * 20_000  # the second fits the sniff
    (tmp_path / "text.jsonl").write_text(f'{deep}\n{{"text": "hello world"}}\n')
    (tmp_path / "head.jsonl").write_text(f'{shallow_deep}\n{{"text": "still read"}}\n')
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 90)).save(tmp_path / "flower.jpg")
    (tmp_path / "pairs.jsonl").write_text(f'{{"image": "flower.jpg", "text": "ok"}}\n{shallow_deep}\n{deep}\n')
    files, skipped = sources.discover([tmp_path])  # routing and pair references read these records too
    assert not skipped
    by_name = _parse_all(files)
    assert set(by_name) == {"text.jsonl", "head.jsonl", "pairs.jsonl"}
    expected = {"text.jsonl": ("hello world", ["line 1"]), "head.jsonl": ("still read", ["line 1"]),
                "pairs.jsonl": ("ok", ["line 2", "line 3"])}
    for name, (good, deep_lines) in expected.items():
        assert [r.payload for r in by_name[name] if r.error is None] == [good], name
        errors = [(r.record, r.error) for r in by_name[name] if r.error]
        assert errors == [(line, "JSON nested too deeply") for line in deep_lines], name


def test_a_bad_first_record_does_not_turn_a_pairs_file_into_text(tmp_path):
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 90)).save(tmp_path / "flower.jpg")
    (tmp_path / "pairs.jsonl").write_text("\n".join([
        '{"image": "/etc/passwd", "text": "abs"}',
        '{"image": "../../../../etc/hostname", "text": "x"}',
        '{"image": "flower.jpg", "text": "ok"}',
        '{"audio": "/dev/zero", "text": "y"}',
    ]) + "\n")
    # a text corpus whose records carry image metadata that names no file beside it stays text
    (tmp_path / "web.jsonl").write_text('{"text": "A web page.", "image": "https://x.org/a.png"}\n')
    files, _ = sources.discover([tmp_path])
    kinds = {Path(f.path).name: f.modality for f in files}
    assert kinds == {"pairs.jsonl": "image", "flower.jpg": sources.REFERENCED, "web.jsonl": "text"}
    by_name = _parse_all(files)
    pairs = by_name["pairs.jsonl"]
    assert [r.record for r in pairs] == ["line 1", "line 2", "line 3", "line 4"]  # every record accounted for
    assert pairs[0].error == "image path must be relative to the pairs file's folder: /etc/passwd"
    assert pairs[1].error == "image path leaves the pairs file's folder: ../../../../etc/hostname"
    assert pairs[3].error is not None and "one kind of media" in pairs[3].error
    flower = pairs[2]
    assert (flower.modality, flower.payload, flower.error) == ("image", "ok", None)
    assert flower.blob == (tmp_path / "flower.jpg").read_bytes()
    # the flower is one sample, with its caption; no caption became a text sample of its own
    samples = [r for recs in by_name.values() for r in recs if r.error is None]
    assert [(r.modality, r.payload) for r in samples] == [("image", "ok"), ("text", "A web page.")]


# -- split reading: a big .jsonl as byte ranges gives the whole file's records, ids included -------

def _whole_and_split(path, split_bytes: int):
    from tokenloom.datasets import sources as src

    whole = list(src.parse_file(str(path), "text", path.read_bytes()))
    ranges = src.byte_ranges(path.stat().st_size, split_bytes)
    counts = [src.count_newlines(str(path), a, b) for a, b in ranges]
    before = src.range_plan(ranges, counts)
    split = [r for (a, b), n in zip(ranges, before, strict=True) for r in src.parse_text_range(str(path), a, b, n)]
    return whole, split


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.one_of(
    st.builds(lambda t: json.dumps({"text": t}, ensure_ascii=False), st.text(min_size=0, max_size=40)),
    st.sampled_from(["", "   ", "{not json", '{"text": 3}', "[1, 2]", '{"text": "é😀 ünïcode"}']),
), min_size=0, max_size=30), end=st.sampled_from(["", "\n", "\n\n"]), split_bytes=st.integers(1, 64))
def test_any_split_of_a_jsonl_gives_the_whole_files_records(tmp_path_factory, lines, end, split_bytes):
    """Every line is read by exactly one range (the one it begins in), with its line number as its
    id, whatever the range size: one byte, mid-character, on a newline or past the end."""
    path = tmp_path_factory.mktemp("split") / "corpus.jsonl"
    path.write_bytes(("\n".join(lines) + end).encode())
    whole, split = _whole_and_split(path, split_bytes)
    assert split == whole


def test_a_big_jsonl_is_split_only_when_it_is_text_above_the_size(tmp_path):
    from tokenloom.datasets import sources as src

    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(2000)))
    size = corpus.stat().st_size
    assert src.can_split(str(corpus), size, 4096) and not src.can_split(str(corpus), size, size)
    assert not src.can_split(str(corpus), size, 0)  # 0: never
    binary = tmp_path / "png.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 10000)
    assert not src.can_split(str(binary), binary.stat().st_size, 4096)  # one quarantine record, as a whole file
    doc = tmp_path / "book.txt"
    doc.write_text("word " * 5000)
    assert not src.can_split(str(doc), doc.stat().st_size, 4096)  # a .txt is one document
    whole, split = _whole_and_split(corpus, 4096)
    assert split == whole and len(whole) == 2000 and whole[-1].record == "line 2000"
