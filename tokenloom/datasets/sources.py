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

TEXT_SUFFIXES = {".txt": "text", ".jsonl": "text"}
ROUTES: dict[str, str] = dict(TEXT_SUFFIXES)  # suffix -> modality pool; new tokenizers add entries

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
    payload: str | None  # the text, for text records
    error: str | None  # quarantine reason


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
            modality = ROUTES.get(file.suffix.lower())
            if modality is None:
                skipped.append((str(file.absolute()), f"no tokenizer pool for suffix {file.suffix!r}"))
                continue
            st = file.stat()
            key = str(file.resolve())
            found[key] = SourceFile(key, modality, st.st_size, st.st_mtime_ns)
    return sorted(found.values(), key=lambda s: s.path), skipped


def manifest_hash(sources: Iterable[SourceFile]) -> str:
    """Hash of which inputs a job read (path, size, mtime): part of its lineage and id."""
    digest = hashlib.sha256()
    for src in sorted(sources, key=lambda s: s.path):
        digest.update(f"{src.path}\0{src.size}\0{src.mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


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


def _parse_jsonl(path: str, data: bytes) -> Iterator[Record]:
    for number, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue  # blank lines separate nothing; they are not documents
        where = f"line {number}"
        sid = sample_id(path, where)
        line, problem = _decode(raw_line)
        if problem:
            yield Record(sid, path, where, "text", None, problem)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Record(sid, path, where, "text", None, f"malformed JSON: {exc.msg} at column {exc.colno}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            yield Record(sid, path, where, "text", None, "record has no string field 'text'")
        elif not obj["text"].strip():
            yield Record(sid, path, where, "text", None, "empty document")
        else:
            yield Record(sid, path, where, "text", obj["text"], None)


PARSERS = {"text": parse_text_file}


def parse_file(path: str, modality: str, data: bytes) -> Iterator[Record]:
    parser = PARSERS.get(modality)
    if parser is None:
        raise ValueError(f"no parser for modality {modality!r}; known: {sorted(PARSERS)}")
    yield from parser(path, data)
