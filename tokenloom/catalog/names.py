"""Dataset and tag names: checked before they reach a path or a SQL statement."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")


def check_name(name: str, what: str = "dataset") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid {what} name {name!r}: use 1-128 letters, digits, '_' or '-', starting with a "
            "letter or digit (no '/', '..', spaces or control characters)"
        )
    return name
