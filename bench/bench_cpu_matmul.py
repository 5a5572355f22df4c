"""bf16 vs fp32 matmul on this CPU, in the layouts a transformer's forward and backward use.

Decides `train.bf16_autocast`'s default: autocast only pays where bf16 GEMMs are faster.
Prints milliseconds per matmul and the fp32/bf16 time ratio (> 1 means bf16 is faster).

    .venv/bin/python bench/bench_cpu_matmul.py
"""

from __future__ import annotations

import time

import torch


def _time(a: torch.Tensor, b: torch.Tensor, repeats: int = 5) -> float:
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    m, k, n = 2048, 256, 768  # tokens x model dim x 3*dim: a QKV projection of 8 x 256 tokens
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'layout':<28}{'fp32 ms':>10}{'bf16 ms':>10}{'fp32/bf16':>11}")
    for name, shape_a, shape_b, ta, tb in [
        ("forward  x @ W", (m, k), (k, n), False, False),
        ("forward  x @ W^T (Linear)", (m, k), (n, k), False, True),
        ("backward dY @ W (dgrad)", (m, n), (n, k), False, False),
        ("backward dY^T @ x (wgrad)", (n, m), (m, k), False, False),
        ("backward (x^T)^T layout", (k, m), (k, n), True, False),
    ]:
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(*shape_a, dtype=dtype), torch.randn(*shape_b, dtype=dtype)
            out.append(_time(a.t() if ta else a, b.t() if tb else b))
        print(f"{name:<28}{out[0]:>10.1f}{out[1]:>10.1f}{out[0] / out[1]:>11.2f}")


if __name__ == "__main__":
    main()
