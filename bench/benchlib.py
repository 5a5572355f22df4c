"""Helpers the benchmarks share: the CPU's name (every figure names its CPU) and best-of timing."""

from __future__ import annotations

import platform
import time


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def best_of(fn, repeats: int = 3) -> float:
    """The shortest of `repeats` wall-clock timings of `fn()`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
