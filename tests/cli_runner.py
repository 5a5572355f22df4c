"""Run the `tokenloom` command in this process (click's runner): the same parsing, errors and
output as a subprocess, without paying a new interpreter's torch import per call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


def launch_ranks(args: list[str], world: int, logs: Path, name: str, timeout: float = 300, **env: str) -> dict:
    """`tokenloom ARGS` as `world` processes of one torch.distributed group (what DeepSpeed's launcher
    sets up: MASTER_*, RANK, LOCAL_RANK, WORLD_SIZE; one thread each); rank 0's --json document."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, files = [], []
    for rank in range(world):
        environ = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1", **env)
        out, err = logs / f"{name}.{rank}.out", logs / f"{name}.{rank}.err"
        files.append((out, err))
        with out.open("w") as o, err.open("w") as e:
            procs.append(subprocess.Popen([sys.executable, "-m", "tokenloom.cli", *args], env=environ,
                                          stdout=o, stderr=e))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, code in enumerate(codes):
        assert code == 0, f"{name}: rank {rank} of {world} exited with {code}:\n{files[rank][1].read_text()[-3000:]}"
    return json.loads(files[0][0].read_text())
