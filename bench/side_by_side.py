"""Run a benchmark's training variants side by side: each variant is `script --worker NAME
...forwarded arguments` in its own process, at most `parallel` at a time, so variants that run
together see the same machine load. Shared by bench_audio.py and bench_visual.py."""

from __future__ import annotations

import subprocess
import sys
import time


def run_variants(script: str, variants: list[str], parallel: int, forwarded: list[str], minutes: float,
                 threads: int) -> None:
    """Run every variant to the end; stop at the first that fails."""
    pending, running = list(variants), []
    print(f"training {variants} for {minutes} min each, {parallel} at a time, {threads} thread(s) each", flush=True)
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            running.append((name, subprocess.Popen([sys.executable, script, "--worker", name, *forwarded])))
        time.sleep(2)
        for name, process in list(running):
            if process.poll() is not None:
                running.remove((name, process))
                if process.returncode:
                    for _, other in running:
                        other.kill()
                    raise SystemExit(f"variant {name} failed with status {process.returncode}")
