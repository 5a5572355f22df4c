"""Sample text: docstrings of Python's standard library, gathered offline.

Every machine with Python has it, it is real English prose mixed with code, and no download
is needed. Modules are parsed with `ast` (never imported), read in sorted order, so the
corpus is the same on every run of the same Python. Output: `.jsonl` files of docstrings and
`.txt` files of whole module docstrings, plus, when asked, a folder of deliberately bad inputs
so a demo shows the quarantine at work.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path


def iter_stdlib_docstrings(stdlib: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield (qualified name, docstring) for modules, classes and functions, in a fixed order."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in {"test", "tests", "idle_test", "site-packages", "lib2to3"} for part in rel.parts):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node is not tree and isinstance(node, ast.Module):
                continue
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                yield name, doc


def write_sample_corpus(out_dir: Path, max_bytes: int = 3_000_000, with_bad_inputs: bool = True) -> Path:
    """Write the corpus under `out_dir` (idempotent) and return the folder to ingest."""
    out_dir = Path(out_dir)
    done = out_dir / ".complete.json"
    if done.exists() and json.loads(done.read_text()).get("max_bytes") == max_bytes:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    written, shard, lines = 0, 0, []
    module_docs: list[tuple[str, str]] = []

    def flush() -> None:
        nonlocal shard, lines
        if lines:
            (out_dir / f"stdlib-docstrings-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
            shard, lines = shard + 1, []

    for name, doc in iter_stdlib_docstrings():
        if written >= max_bytes:
            break
        if "." not in name and len(module_docs) < 40 and len(doc) > 400:
            module_docs.append((name, doc))
            written += len(doc)
            continue
        lines.append(json.dumps({"text": doc, "name": name}, ensure_ascii=False))
        written += len(doc)
        if len(lines) == 2000:
            flush()
    flush()
    for name, doc in module_docs:
        (out_dir / f"module-{name}.txt").write_text(doc + "\n")
    if with_bad_inputs:
        write_bad_inputs(out_dir / "bad")
    done.write_text(json.dumps({"max_bytes": max_bytes, "bytes": written}))
    return out_dir


def write_bad_inputs(bad_dir: Path) -> dict[str, int]:
    """Inputs every job must survive; returns how many quarantine records each should give."""
    bad_dir.mkdir(parents=True, exist_ok=True)
    (bad_dir / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))  # invalid UTF-8
    (bad_dir / "empty.txt").write_text("   \n\n")
    (bad_dir / "image-in-disguise.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (bad_dir / "mixed.jsonl").write_bytes(
        b'{"text": "A good line survives its bad neighbours."}\n'
        b'{"text": "unterminated\n'
        b'{"title": "no text field"}\n'
        b'{"text": ""}\n'
        b'[1, 2, 3]\n'
        b'{"text": "\xff\xfe broken bytes"}\n'
        b'{"text": "Another good line, counted once."}\n'
    )
    return {"latin1.txt": 1, "empty.txt": 1, "image-in-disguise.txt": 1, "mixed.jsonl": 5}


def write_source_corpus(out_dir: Path, max_bytes: int = 20_000_000, per_file: int = 2_000_000) -> Path:
    """A larger real-text corpus for benchmarks: standard-library source files, one record each.

    The standard library holds about 11 MB of source; past that the files are taken again in
    further passes (records named `pass-N/...`), so a benchmark can size its corpus freely.
    """
    out_dir = Path(out_dir)
    done = out_dir / ".complete.json"
    if done.exists() and json.loads(done.read_text()).get("max_bytes") == max_bytes:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]
    written, shard, size, lines, pass_no = 0, 0, 0, [], 0
    while written < max_bytes:
        for path in files:
            if written >= max_bytes:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            name = f"pass-{pass_no}/{path.relative_to(root)}"
            lines.append(json.dumps({"text": text, "name": name}, ensure_ascii=False))
            written += len(text)
            size += len(text)
            if size >= per_file:
                (out_dir / f"stdlib-src-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
                shard, size, lines = shard + 1, 0, []
        pass_no += 1
    if lines:
        (out_dir / f"stdlib-src-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
    done.write_text(json.dumps({"max_bytes": max_bytes, "bytes": written}))
    return out_dir
