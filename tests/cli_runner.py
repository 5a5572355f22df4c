"""Run the `tokenloom` command in this process (click's runner): the same parsing, errors and
output as a subprocess, without paying a new interpreter's torch import per call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from tokenloom.cli import app, expand_multi_path_options


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        assert self.returncode == 0, self.stderr[-3000:]
        return json.loads(self.stdout)


def run(*args: str, home: Path | str | None = None) -> Result:
    argv = expand_multi_path_options([str(a) for a in args] + (["--home", str(home)] if home else []))
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    return Result(result.exit_code, result.stdout, result.stderr)
