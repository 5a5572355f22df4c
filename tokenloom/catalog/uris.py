"""URIs and paths: one place that turns a warehouse location into (filesystem, path) and back."""

from __future__ import annotations

from pyarrow import fs as pafs


def filesystem_and_path(uri: str) -> tuple[pafs.FileSystem, str]:
    """`file:///x`, `s3://b/k`, ... or a plain local path -> a pyarrow filesystem and its path."""
    return pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)


def to_uri(location: str, path: str) -> str:
    """The URI of `path` (as a filesystem returned it) under the scheme of `location`."""
    if "://" not in location:
        return path
    scheme = location.split("://", 1)[0] + "://"
    return path if path.startswith(scheme) else scheme + path
