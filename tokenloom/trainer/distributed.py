"""Process-group set-up for DeepSpeed on CPU (gloo) or GPU (nccl).

A single process started without a launcher gets the environment a launcher would have
set (rank 0 of 1, a free local port), so `tokenloom train` works the same alone and under
`deepspeed`/`torchrun`. DeepSpeed JIT-compiles a shared-memory op the first time its comm
layer starts; `prebuild_ops` does that once, up front, because two ranks compiling it at the
same time can abort.
"""

from __future__ import annotations

import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_env() -> tuple[int, int, int]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def init_distributed() -> tuple[int, int]:
    """Start (or join) the process group; returns (rank, world_size)."""
    import deepspeed

    rank, _, world = ensure_env()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return rank, world


def prebuild_ops() -> None:
    """Compile DeepSpeed's CPU shared-memory comm op into the extension cache, once."""
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


if __name__ == "__main__":
    prebuild_ops()
