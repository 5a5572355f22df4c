"""Process-group set-up for DeepSpeed on CPU (gloo) or GPU (nccl).

A single process started without a launcher gets the environment a launcher would have
set (rank 0 of 1, a free local port), so `tokenloom train` works the same alone and under
`deepspeed`/`torchrun`. DeepSpeed JIT-compiles a shared-memory op the first time its comm
layer starts; `prebuild_ops` does that once, up front, because two ranks compiling it at the
same time can abort.

Every process then loads the op (torch checks it is up to date with ninja, ~1 s) under torch's
lock, a file in the op's build folder that exists while a process holds it. A process killed while
holding it (kill -9 or the OOM killer at a rank's start) leaves the file behind, and every later
load waits for it to go: the next run, the resumed one included, hangs without a word. So our
processes load the op one at a time under an flock of their own, which the kernel releases when
its holder dies; under it, a torch lock of the op is one that no process of ours holds, and it is
removed (with a warning naming it). A process outside TokenLoom building the same op into the same
cache at that moment (or one on another machine sharing the cache over NFS, where an flock is
the machine's own) would lose its lock: give it its own TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch

log = logging.getLogger(__name__)


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
        prebuild_ops()  # loaded here, under our lock: DeepSpeed's comm layer finds it loaded
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return rank, world


def prebuild_ops() -> None:
    """Compile DeepSpeed's CPU shared-memory comm op into the extension cache (once), and load it,
    one process at a time (see the module docstring). Nothing where the accelerator has no such op
    (DeepSpeed's comm layer skips it there too)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    with _ops_lock(builder.name):
        build_shm_op()


@contextmanager
def _ops_lock(op: str) -> Iterator[None]:
    """Hold our flock on the extension cache and remove the torch lock of `op` that no process of
    ours holds. The op's build folder is torch's: $TORCH_EXTENSIONS_DIR/<op> when that is set, else
    <torch's default cache>/<python and accelerator tag>/<op>. Where the cache cannot be locked (a
    read-only home, a filesystem without flock), the op is loaded as DeepSpeed would, with a
    warning."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")  # (torch tests it against None: "" counts as set)
    root = chosen if chosen is not None else get_default_build_root()
    locks = os.path.join(glob.escape(root), *((op,) if chosen is not None else ("*", op)), "lock")
    try:
        os.makedirs(root, exist_ok=True)
        handle = open(os.path.join(root, "tokenloom-ops.flock"), "a")  # noqa: SIM115 (held across the yield)
        fcntl.flock(handle, fcntl.LOCK_EX)
    except OSError as exc:
        log.warning("cannot lock the extension cache %s (%s): loading DeepSpeed's %s op without our lock", root,
                    exc, op)
        yield
        return
    try:
        for stale in glob.glob(locks):
            log.warning("removing %s, left by a process killed while it loaded DeepSpeed's %s op", stale, op)
            with suppress(FileNotFoundError):
                os.remove(stale)
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def use_bf16(precision: str, device: torch.device) -> bool:
    """bf16 autocast for `train.precision`: "bf16" always, "fp32" never, "auto" on GPUs with bf16.

    On CPUs "auto" means fp32, by measurement (bench/bench_model.py): even on an AMX Xeon, where
    a 1024^3 bf16 matmul runs 5x faster than fp32, MoE training at the demo size ran at 0.5x in
    bf16, since every step brings new expert-slice shapes and oneDNN builds a bf16 kernel per
    shape, and the weight casts cost about what the small matmuls save; on an AVX2-only EPYC bf16
    matmuls were 10-100x slower outright."""
    if precision == "bf16":
        return True
    return precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()


def shutdown_distributed() -> int:
    """Leave the process group cleanly at the end of a multi-process command; returns this rank.

    Every rank waits for the others first: a rank that exits while another still talks to it can
    abort with "terminate called without an active exception"."""
    if not torch.distributed.is_initialized():
        return int(os.environ.get("RANK", "0"))
    rank = torch.distributed.get_rank()
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
        destroy_process_group()
    return rank


def destroy_process_group() -> None:
    """Destroy the process group through DeepSpeed, which also drops the groups it cached (data,
    sequence, expert parallel): after torch's own `destroy_process_group` a later engine in the
    same process would reach for a dead group ("Group ... is not registered")."""
    if torch.distributed.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    prebuild_ops()
