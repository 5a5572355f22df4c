"""Raw inputs: find files, route them by modality, and parse them into records.

Parsing is a pure function from (path, bytes) to records, each either a good sample
(`payload` set) or a quarantine entry (`error` set, with the reason). It never raises on
bad content, so one broken file or line cannot stop a job, and the record index makes every
sample id stable: the same input gives the same ids on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenloom.datasets import audio, images, video

TEXT_SUFFIXES = {".txt": "text", ".jsonl": "text"}
ROUTES: dict[str, str] = {**TEXT_SUFFIXES, **{suffix: "image" for suffix in images.IMAGE_SUFFIXES},
                          **{suffix: "audio" for suffix in audio.AUDIO_SUFFIXES},
                          **{suffix: "video" for suffix in video.VIDEO_SUFFIXES}}
MEDIA_KEYS = ("image", "audio", "video")  # the field a pairs .jsonl record names its media file with
# audio and video are read by their pool (in blocks, or frames at a rate), never whole by a read task
READS_BYTES = {"text": True, "image": True, "audio": False, "video": False}
CAPTION = "caption"  # a caption sidecar: part of its image's sample, read by the image parser, no pool
REFERENCED = "referenced"  # an image named by a pairs .jsonl: read through that file, never on its own
UNPOOLED = (CAPTION, REFERENCED)  # sources that count for lineage (the job id) but feed no pool
MAX_IMAGE_BYTES = 256 * 1024 * 1024  # a pairs record naming a bigger file is quarantined unread
SNIFF_BYTES = 64 * 1024  # what discovery reads of a .jsonl to tell a pairs file from a text corpus

_MAGIC = {  # files that are not what their extension says
    b"\x89PNG": "PNG image",
    b"\xff\xd8\xff": "JPEG image",
    b"GIF8": "GIF image",
    b"PK\x03\x04": "ZIP archive",
    b"\x1f\x8b": "gzip archive",
    b"%PDF": "PDF document",
    b"RIFF": "RIFF (WAV/WebP) file",
    b"fLaC": "FLAC audio",
    b"OggS": "Ogg file",
    b"\x7fELF": "ELF binary",
}


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute
    modality: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Record:
    sample_id: str
    source: str
    record: str  # position inside the source ("line 12", "file")
    modality: str
    payload: str | None  # the text (for an image record: its caption, if any)
    error: str | None  # quarantine reason
    blob: bytes | None = None  # image records: the image file's bytes (decoded on the image pool)
    media: str | None = None  # audio and video records: the file their pool reads (never whole)


def sample_id(source: str, record: str) -> str:
    return hashlib.blake2b(f"{source}\0{record}".encode(), digest_size=12).hexdigest()


def discover(paths: Iterable[str | os.PathLike]) -> tuple[list[SourceFile], list[tuple[str, str]]]:
    """Expand files and folders into routed source files.

    Returns (sources, skipped) where skipped lists (path, reason) for files no pool takes.
    A path that does not exist raises FileNotFoundError: that is a user mistake, not data.
    """
    found: dict[str, SourceFile] = {}
    skipped: list[tuple[str, str]] = []
    for raw in paths:
        root = Path(raw).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"input path {str(raw)!r} does not exist")
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for file in files:
            if any(part.startswith(".") for part in file.relative_to(root).parts if root.is_dir()):
                continue
            modality = _route(file)
            if modality is None:
                skipped.append((str(file.absolute()), f"no tokenizer pool for suffix {file.suffix!r}"))
                continue
            _add(found, file, modality)
    # what image samples read besides their own file: caption sidecars, and the images a pairs
    # file names (those are then part of that file's samples, not samples of their own)
    for src in [s for s in found.values() if s.modality in MEDIA_KEYS]:
        if src.path.lower().endswith(".jsonl"):
            for target in pair_references(Path(src.path), src.modality):
                _add(found, target, REFERENCED, replace=True)
        else:
            sidecar = images.caption_sidecar(Path(src.path))
            if sidecar is not None:
                _add(found, sidecar, CAPTION, replace=True)
    return sorted(found.values(), key=lambda s: s.path), skipped


def _add(found: dict[str, SourceFile], file: Path, modality: str, replace: bool = False) -> None:
    key = str(file.resolve())
    if key in found and not replace:
        return
    st = file.stat()
    found[key] = SourceFile(key, modality, st.st_size, st.st_mtime_ns)


def _route(file: Path) -> str | None:
    suffix = file.suffix.lower()
    if suffix in images.CAPTION_SUFFIXES and _is_sidecar(file):
        return CAPTION
    if suffix == ".jsonl":
        return _pairs_kind(file) or ROUTES[suffix]
    return ROUTES.get(suffix)


def _is_sidecar(path: Path) -> bool:
    """A `.txt`/`.caption` beside an image or audio file of the same stem: its caption or transcript."""
    media = (*images.IMAGE_SUFFIXES, *audio.AUDIO_SUFFIXES, *video.VIDEO_SUFFIXES)
    return any(path.with_suffix(spelled).is_file() for suffix in media for spelled in (suffix, suffix.upper()))


def resolve_reference(folder: Path, name: object, kind: str = "image") -> tuple[Path | None, str | None]:
    """The media file a pairs record names: a relative path inside the pairs file's folder
    (no absolute paths, no escaping with `..` or links), an existing regular file (images: of
    bounded size, since they are read whole)."""
    if not isinstance(name, str) or not name.strip():
        return None, f"field '{kind}' is not a path"
    if Path(name).is_absolute():
        return None, f"{kind} path must be relative to the pairs file's folder: {name}"
    base = folder.resolve()
    target = (base / name).resolve()
    if not target.is_relative_to(base):
        return None, f"{kind} path leaves the pairs file's folder: {name}"
    if not target.is_file():
        return None, f"{kind} file not found: {name}"
    if kind == "image" and target.stat().st_size > MAX_IMAGE_BYTES:
        return None, f"image file larger than {MAX_IMAGE_BYTES >> 20} MiB: {name}"
    return target, None


def _load_record(line: bytes | str) -> tuple[object, str | None]:
    """One JSON record, or why it is none. JSON nested deeper than the interpreter's recursion
    limit raises RecursionError in `json`: that is a bad record like any other, not the end of
    the job."""
    try:
        return json.loads(line), None
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} at column {exc.colno}"
    except UnicodeDecodeError as exc:  # discovery passes raw bytes; the parsers decode first
        return None, f"invalid UTF-8 at byte {exc.start}"
    except RecursionError:
        return None, "JSON nested too deeply"


def _sniffed_records(path: Path) -> list[object]:
    """The records in the first SNIFF_BYTES of a .jsonl (a line the budget cuts off, and lines
    that are not JSON, are left out): discovery routes a file by these, without reading a whole
    corpus twice."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES + 1)
    except OSError:
        return []
    lines = head[:SNIFF_BYTES].split(b"\n")
    if len(head) > SNIFF_BYTES:
        lines.pop()  # may be cut off by the budget
    return [obj for obj, problem in (_load_record(line) for line in lines if line.strip()) if problem is None]


def _pairs_kind(path: Path) -> str | None:
    """"image" or "audio" when a .jsonl is a pairs file for that pool: some record within the
    sniff budget (SNIFF_BYTES, not the whole file) names an existing media file beside it. Any
    such record counts, not only the first, so bad references at its head cannot turn a pairs
    file into a text corpus; the parser quarantines them record by record. The kind is the media
    key most of its records name (ties: image); records naming the other kind are quarantined.
    A text corpus whose records carry `image`/`audio` metadata (URLs, ids) that names no file
    beside it stays text."""
    named = dict.fromkeys(MEDIA_KEYS, 0)
    references_a_file = False
    for record in _sniffed_records(path):
        if not isinstance(record, dict):
            continue
        for key in MEDIA_KEYS:
            if key in record:
                named[key] += 1
                references_a_file = (references_a_file
                                     or resolve_reference(path.parent, record[key], key)[0] is not None)
    if not references_a_file:
        return None
    return max(MEDIA_KEYS, key=named.__getitem__)  # max keeps the first of equals: image wins ties


def pair_references(path: Path, kind: str) -> list[Path]:
    """The `kind` ("image" or "audio") files a pairs .jsonl of that kind names: exactly those its
    parser reads, so each is ingested once, through its record. Bad references, and records
    naming the other kind, are quarantined by the parser, record by record; the files they name
    stay samples of their own."""
    out = []
    for raw in path.read_bytes().split(b"\n"):
        obj, _ = _load_record(raw) if raw.strip() else (None, None)
        if isinstance(obj, dict) and kind in obj and not any(k in obj for k in MEDIA_KEYS if k != kind):
            target, _ = resolve_reference(path.parent, obj[kind], kind)
            if target is not None:
                out.append(target)
    return out


def readers_of(files: Iterable[SourceFile], paths: Iterable[str]) -> set[str]:
    """The pooled files whose samples read any of `paths` besides themselves: the image or audio
    file of a caption/transcript sidecar (same folder and stem, present or gone), and the pairs
    files naming a referenced media file. When such a path changes, appears or disappears, these
    are the samples to rebuild."""
    wanted = set(paths)
    if not wanted:
        return set()
    out: set[str] = set()
    stems = {(str(Path(p).parent), Path(p).stem) for p in wanted if Path(p).suffix.lower() in images.CAPTION_SUFFIXES}
    for f in files:
        if f.modality not in MEDIA_KEYS:
            continue
        path = Path(f.path)
        if path.suffix.lower() == ".jsonl":
            if any(str(t) in wanted for t in pair_references(path, f.modality)):
                out.add(f.path)
        elif (str(path.parent), path.stem) in stems:
            out.add(f.path)
    return out


def _sniff_binary(data: bytes) -> str | None:
    for magic, what in _MAGIC.items():
        if data.startswith(magic):
            return f"content is a {what}, not text"
    if b"\x00" in data[:8192]:
        return "content is binary (NUL bytes), not text"
    return None


def _decode(data: bytes) -> tuple[str | None, str | None]:
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"


def parse_text_file(path: str, data: bytes) -> Iterator[Record]:
    """`.txt`: one document per file. `.jsonl`: one document per line, from its `text` field."""
    problem = _sniff_binary(data)
    if problem:
        yield Record(sample_id(path, "file"), path, "file", "text", None, problem)
        return
    if path.lower().endswith(".jsonl"):
        yield from _parse_jsonl(path, data)
        return
    text, problem = _decode(data)
    if text is not None and not text.strip():
        problem = "empty document"
    yield Record(sample_id(path, "file"), path, "file", "text", text if problem is None else None, problem)


def _parse_jsonl(path: str, data: bytes, first_line: int = 1) -> Iterator[Record]:
    """A .jsonl text corpus, or the lines of one byte range of it (`read_range`), numbered from
    `first_line`: a line's record id is its line number in the whole file, however it was split."""
    for number, raw_line in enumerate(data.split(b"\n"), start=first_line):
        if not raw_line.strip():
            continue  # blank lines separate nothing; they are not documents
        where = f"line {number}"
        sid = sample_id(path, where)
        line, problem = _decode(raw_line)
        if problem:
            yield Record(sid, path, where, "text", None, problem)
            continue
        obj, problem = _load_record(line)
        if problem:
            yield Record(sid, path, where, "text", None, problem)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            yield Record(sid, path, where, "text", None, "record has no string field 'text'")
        elif not obj["text"].strip():
            yield Record(sid, path, where, "text", None, "empty document")
        else:
            yield Record(sid, path, where, "text", obj["text"], None)


def _image_record(sid: str, path: str, where: str, data: bytes, caption: str | None) -> Record:
    """An image sample; its bytes are decoded (and bad ones quarantined) on the image pool,
    where the work belongs, not in the read tasks."""
    if not data:
        return Record(sid, path, where, "image", None, "empty file")
    return Record(sid, path, where, "image", caption, None, data)


def parse_image_file(path: str, data: bytes) -> Iterator[Record]:
    """An image file (with its caption sidecar, if any) or a .jsonl of image-text pairs.

    Pairs: one JSON object per line, `{"image": "<path, relative to the .jsonl's folder>",
    "text": "<caption>"}`; a line without an image is a text-only sample of the same file.
    """
    if path.lower().endswith(".jsonl"):
        yield from _parse_pairs(path, data, "image")
        return
    caption, problem = None, None
    sidecar = images.caption_sidecar(Path(path))
    if sidecar is not None:
        caption, problem = images.read_caption(sidecar)
    if problem:
        yield Record(sample_id(path, "file"), path, "file", "image", None, f"{problem}: {sidecar.name}")
        return
    yield _image_record(sample_id(path, "file"), path, "file", data, caption)


def _parse_pairs(path: str, data: bytes, kind: str) -> Iterator[Record]:
    """Records of a pairs .jsonl routed to the `kind` pool ("image" or "audio")."""
    folder = Path(path).parent
    for number, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        where = f"line {number}"
        sid = sample_id(path, where)
        line, problem = _decode(raw_line)
        obj = None
        if problem is None:
            obj, problem = _load_record(line)
        if problem is None and not isinstance(obj, dict):
            problem = "record is not a JSON object"
        if problem is None and any(k in obj for k in MEDIA_KEYS if k != kind):
            problem = f"a pairs file holds one kind of media, and this one's is {kind}"
        if problem:
            yield Record(sid, path, where, kind, None, problem)
            continue
        caption = obj.get("text") if obj.get("text") is not None else obj.get("caption")
        if caption is not None and not isinstance(caption, str):
            yield Record(sid, path, where, kind, None, "field 'text' is not a string")
            continue
        caption = caption.strip() if caption else None
        if kind not in obj:
            if caption:
                yield Record(sid, path, where, "text", caption, None)
            else:
                yield Record(sid, path, where, kind, None, f"record has no {kind} and no text")
            continue
        target, problem = resolve_reference(folder, obj[kind], kind)
        if problem:
            yield Record(sid, path, where, kind, None, problem)
            continue
        if kind in ("audio", "video"):
            yield Record(sid, path, where, kind, caption, None, media=str(target))
            continue
        try:
            blob = target.read_bytes()
        except OSError as exc:
            yield Record(sid, path, where, "image", None, f"image file unreadable: {exc.strerror or exc}")
            continue
        yield _image_record(sid, path, where, blob, caption)


def parse_audio_file(path: str, data: bytes) -> Iterator[Record]:
    """An audio file (with its transcript sidecar, if any) or a .jsonl of audio-text pairs
    (`{"audio": "<relative path>", "text": "<transcript>"}`). The audio itself is read by the
    audio pool, in blocks; `data` is the bytes of a pairs file (unused for audio files)."""
    yield from _parse_by_path(path, data, "audio", "transcript")


def parse_video_file(path: str, data: bytes) -> Iterator[Record]:
    """A video file (with its caption sidecar, if any) or a .jsonl of video-text pairs
    (`{"video": "<relative path>", "text": "<caption>"}`). The video is decoded by its pool
    (`datasets/video.py`); `data` is the bytes of a pairs file (unused for video files)."""
    yield from _parse_by_path(path, data, "video", "caption")


def _parse_by_path(path: str, data: bytes, kind: str, text_name: str) -> Iterator[Record]:
    if path.lower().endswith(".jsonl"):
        yield from _parse_pairs(path, data, kind)
        return
    text, problem = None, None
    sidecar = images.caption_sidecar(Path(path))
    if sidecar is not None:
        text, problem = images.read_caption(sidecar)
    if problem:
        yield Record(sample_id(path, "file"), path, "file", kind, None,
                     f"{problem.replace('caption', text_name)}: {sidecar.name}")
        return
    yield Record(sample_id(path, "file"), path, "file", kind, text, None, media=path)


# -- split reading: one big JSON-lines corpus as byte ranges aligned to its lines ------------------
#
# A range [start, stop) owns the lines that *begin* inside it: its reader skips the tail of a line
# begun before `start` (the previous range's) and reads past `stop` to the end of its last line.
# So every line belongs to exactly one range, whatever the range size. Line numbers (the record
# ids) need the newlines before the range: `count_newlines` counts each range (in parallel, in
# the job), and `range_plan` turns the counts into each range's first line number.


def can_split(path: str, size: int, split_bytes: int) -> bool:
    """Whether a text-pool file is read as ranges: a .jsonl corpus above `split_bytes` (0: never)
    whose head is text. A `.txt` file is one document, so it is never split; a binary file is one
    quarantine record, read as a whole file as before."""
    if not split_bytes or size <= split_bytes or not path.lower().endswith(".jsonl"):
        return False
    with open(path, "rb") as f:
        return _sniff_binary(f.read(8192)) is None


def byte_ranges(size: int, split_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of at most `split_bytes` covering a file of `size` bytes."""
    return [(start, min(start + split_bytes, size)) for start in range(0, size, split_bytes)]


def count_newlines(path: str, start: int, stop: int, chunk: int = 16 << 20) -> int:
    """Newlines among bytes [start, stop) of `path`, read `chunk` bytes at a time."""
    count = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            data = f.read(min(chunk, left))
            if not data:
                break
            count += data.count(b"\n")
            left -= len(data)
    return count


def range_plan(ranges: list[tuple[int, int]], newlines: list[int]) -> list[int]:
    """Per range, the newlines before it (prefix sums of each range's count)."""
    before, out = 0, []
    for count in newlines:
        out.append(before)
        before += count
    if len(out) != len(ranges):
        raise ValueError(f"{len(newlines)} newline counts for {len(ranges)} ranges")
    return out


def read_range(path: str, start: int, stop: int, newlines_before: int) -> tuple[bytes, int]:
    """The lines that begin in [start, stop), whole, and the line number of the first of them."""
    with open(path, "rb") as f:
        first_line = newlines_before + 1
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":  # mid-line: that line is the previous range's
                tail = f.readline()
                first_line += tail.endswith(b"\n")
        first = f.tell()
        if first >= stop:
            return b"", first_line  # no line begins in this range
        data = f.read(stop - first)
        if data and not data.endswith(b"\n"):
            data += f.readline()
    return data, first_line


def parse_text_range(path: str, start: int, stop: int, newlines_before: int) -> Iterator[Record]:
    """The records of one range of a .jsonl corpus: the same records, with the same ids, as the
    whole file's parse gives for those lines."""
    data, first_line = read_range(path, start, stop, newlines_before)
    yield from _parse_jsonl(path, data, first_line)


PARSERS = {"text": parse_text_file, "image": parse_image_file, "audio": parse_audio_file, "video": parse_video_file}


def parse_file(path: str, modality: str, data: bytes) -> Iterator[Record]:
    parser = PARSERS.get(modality)
    if parser is None:
        raise ValueError(f"no parser for modality {modality!r}; known: {sorted(PARSERS)}")
    yield from parser(path, data)
