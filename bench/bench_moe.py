"""TokenLoom's MoE layer, grouped and loop experts, against `deepspeed.moe.layer.MoE`, in one run.

Every layer gets the same model dim D, E routed experts of SwiGLU hidden size H, top-k K and
batch of tokens, and one training step each: forward, loss = sum(y * fixed random) + the layer's
own aux loss, backward through the input, the router and every expert. Lines, per configuration:

- ours with grouped experts (`model.moe.impl="grouped"`, the default) and with the per-expert loop
  (`impl="loop"`, its plain twin), both n_shared=0 (DeepSpeed has no shared expert), against
  DeepSpeed with drop_tokens=False (no token is dropped, like ours): the headline ratios;
- DeepSpeed at its defaults, capacity_factor=1 and drop_tokens=True (it skips tokens over capacity);
- ours grouped with the default shared expert (more work: one dense SwiGLU over every token on top);
- with --bf16, ours grouped, ours loop and DeepSpeed no-drop again under CPU bf16 autocast.

Ratios are peer time / our time (above 1: ours is faster), each of the best (fastest) step of
its line; the median is printed beside it.

How it measures, and why:
- The variants run interleaved (A B C D A B C D ...) in one process after --warmup rounds, so a
  neighbour's load falls on all of them; best-of-N because the shared machine only ever adds time.
- Threads: default 1. On the shared 2-core machine a second OpenMP thread that loses its core
  stalls every op at a barrier, which measures the neighbour rather than the layer.
- The CPU is printed (model name; avx512_bf16 and amx_bf16 flags; whether oneDNN takes bf16
  matmuls): without oneDNN bf16 support, ATen multiplies bf16 matrices in its own loops, and the
  bf16 lines measure those more than the layers.
- DeepSpeed needs no process group for ep_size=1 in this version, but a real DeepSpeed run has
  one, so the script creates a 1-process gloo group and the expert-parallel groups
  (`set_deepspeed_parallelism`) as the engine would.
- Inputs are random, so the routers are near balance; a skewed router would raise DeepSpeed's
  no-drop capacity (the largest expert load, to which every expert is padded) and slow it down,
  and leave ours as is. The "pad" column is DeepSpeed's capacity times E over the routed tokens.
- DeepSpeed keeps its other defaults: for K=2 its top2gating samples the second expert with
  Gumbel noise, for K>2 it uses topkgating; both add its GShard balance loss to the loss.

Before timing, our layer's output and gradients (both impls) are checked against a naive
per-token reference.

Run:  .venv/bin/python bench/bench_moe.py [--repeats 5] [--bf16] [--bf16-repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenloom.model import MoEConfig
from tokenloom.model.moe import MoE, SwiGLU


@dataclass(frozen=True)
class Size:
    dim: int
    n_experts: int
    top_k: int
    expert_hidden: int
    tokens: int
    seq: int = 512

    def __str__(self) -> str:
        return (f"D={self.dim} E={self.n_experts} K={self.top_k} H={self.expert_hidden} "
                f"tokens={self.tokens}")


SIZES = {
    "default": Size(256, 16, 2, 128, 4096),  # the model config's defaults
    "large": Size(512, 64, 4, 256, 4096),
}


def ours(size: Size, impl: str, n_shared: int = 0) -> MoE:
    return MoE(size.dim, MoEConfig(n_experts=size.n_experts, top_k=size.top_k, expert_hidden=size.expert_hidden,
                                   n_shared_experts=n_shared, impl=impl))


def cpu_description() -> str:
    """lscpu's model name, the bf16 flags, and whether oneDNN (not ATen's loops) takes bf16 matmuls."""
    name, flags = "unknown", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                name = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.CalledProcessError):
        text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        for line in text.splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    marks = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx512_bf16", "amx_bf16"))
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return (f"CPU: {name}, {os.cpu_count()} CPUs; {marks}; torch capability {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16 matmuls by {'oneDNN' if onednn else 'ATen loops (no oneDNN bf16)'}")


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, routing included: top-k on sigmoid(router x) + bias, weights = the chosen
    scores renormalised, output = sum of weight * expert(x) + the shared expert."""
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(moe.router @ token)
        chosen = sorted(range(moe.n_experts), key=lambda e: -float(scores[e].detach() + moe.expert_bias[e]))[:moe.top_k]
        out = moe.shared(token) if moe.shared is not None else torch.zeros_like(token)
        for e in chosen:
            gate, up = (token @ moe.experts.gate_up[e]).chunk(2)
            out = out + scores[e] / sum(scores[c] for c in chosen) * ((F.silu(gate) * up) @ moe.experts.down[e])
        rows.append(out)
    return torch.stack(rows).view_as(x)


def check_against_reference() -> float:
    """Our layer's output and gradients, both impls, equal the per-token loop's; returns the max abs difference."""
    diff = 0.0
    for impl in ("grouped", "loop"):
        torch.manual_seed(0)
        moe = MoE(32, MoEConfig(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, impl=impl))
        moe.expert_bias.uniform_(-0.05, 0.05)
        x = torch.randn(2, 12, 32, requires_grad=True)
        y, _ = moe(x)
        y_ref = reference_moe(moe, x)
        probe = torch.randn_like(y)
        params = [x, moe.router, moe.experts.gate_up, moe.experts.down, *moe.shared.parameters()]
        grads = torch.autograd.grad((y * probe).sum(), params)
        grads_ref = torch.autograd.grad((y_ref * probe).sum(), params)
        for got, want in zip((y, *grads), (y_ref, *grads_ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            diff = max(diff, float((got - want).detach().abs().max()))
    return diff


def init_deepspeed_group() -> None:
    """A 1-process gloo group, through DeepSpeed's own init (it skips MPI discovery given these)."""
    import deepspeed

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")


def deepspeed_moe(size: Size, drop_tokens: bool) -> torch.nn.Module:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    layer = DeepSpeedMoE(hidden_size=size.dim, expert=SwiGLU(size.dim, size.expert_hidden),
                         num_experts=size.n_experts, ep_size=1, k=size.top_k, capacity_factor=1.0,
                         drop_tokens=drop_tokens, use_residual=False)
    layer.set_deepspeed_parallelism()
    return layer


@dataclass
class Variant:
    name: str
    layer: torch.nn.Module
    bf16: bool = False
    peer: bool = False  # the DeepSpeed no-drop line of its precision, which the ratios divide
    capacity: int = 0  # DeepSpeed only: rows per expert in its dispatch buffer, last step
    times: list[float] = field(default_factory=list)


def run_step(variant: Variant, size: Size, x: torch.Tensor, probe: torch.Tensor) -> float:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if variant.bf16 else contextlib.nullcontext()
    variant.layer.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    with autocast:
        out = variant.layer(x)
    ((out[0].float() * probe).sum() + out[1]).backward()
    elapsed = time.perf_counter() - start
    if len(out) == 3:  # DeepSpeed returns (y, l_aux, exp_counts)
        gate = variant.layer.deepspeed_moe.gate
        variant.capacity = (max(math.ceil(size.tokens / size.n_experts * gate.capacity_factor * size.top_k),
                                gate.min_capacity) if gate.drop_tokens else int(out[2].max()))
    return elapsed


def interleave(variants: list[Variant], size: Size, rounds: int, warmup: int) -> None:
    torch.manual_seed(1)
    x = torch.randn(size.tokens // size.seq, size.seq, size.dim, requires_grad=True)
    probe = torch.randn_like(x)
    for round_ in range(warmup + rounds):
        for variant in variants:
            elapsed = run_step(variant, size, x, probe)
            if round_ >= warmup:
                variant.times.append(elapsed)


def bench_size(size: Size, repeats: int, warmup: int, bf16: bool, bf16_repeats: int) -> list[Variant]:
    torch.manual_seed(0)
    grouped, loop = ours(size, "grouped"), ours(size, "loop")
    loop.load_state_dict(grouped.state_dict())
    peer = deepspeed_moe(size, drop_tokens=False)
    variants = [
        Variant("ours, grouped (n_shared=0)", grouped),
        Variant("ours, loop (n_shared=0)", loop),
        Variant("DeepSpeed drop_tokens=False", peer, peer=True),
        Variant("DeepSpeed capacity_factor=1 (drops)", deepspeed_moe(size, drop_tokens=True)),
        Variant("ours, grouped + 1 shared expert", ours(size, "grouped", n_shared=1)),
    ]
    interleave(variants, size, repeats, warmup)
    if bf16:  # bf16 steps can take seconds on CPUs without bf16 matmuls: their own, shorter rounds
        low = [Variant("ours, grouped, bf16 autocast", grouped, bf16=True),
               Variant("ours, loop, bf16 autocast", loop, bf16=True),
               Variant("DeepSpeed drop_tokens=False, bf16 autocast", peer, bf16=True, peer=True)]
        interleave(low, size, bf16_repeats, 1)
        variants += low
    return variants


def print_table(size: Size, variants: list[Variant]) -> None:
    """ms per step (best and median), tokens/s (best), and the DeepSpeed no-drop line's best time of
    the same precision divided by this line's (so above 1 means faster than DeepSpeed)."""
    peer = {v.bf16: min(v.times) for v in variants if v.peer}
    print(f"\n{size}")
    print(f"{'layer':<44}{'best ms':>9}{'median ms':>11}{'tokens/s':>10}{'pad':>6}{'DS no-drop / this':>19}")
    for v in variants:
        best = min(v.times)
        pad = f"{v.capacity * size.n_experts / (size.tokens * size.top_k):.2f}" if v.capacity else ""
        print(f"{v.name:<44}{best * 1e3:>9.1f}{statistics.median(v.times) * 1e3:>11.1f}{size.tokens / best:>10.0f}"
              f"{pad:>6}{peer[v.bf16] / best:>19.2f}")
    by_name = {v.name: min(v.times) for v in variants}
    for precision, suffix in (("fp32", " (n_shared=0)"), ("bf16", ", bf16 autocast")):
        g, lp = by_name.get(f"ours, grouped{suffix}"), by_name.get(f"ours, loop{suffix}")
        if g is None:
            continue
        ds = peer[precision == "bf16"]
        print(f"headline {precision}: DeepSpeed no-drop / ours grouped {ds / g:.2f}, / ours loop {ds / lp:.2f}; "
              f"loop / grouped {lp / g:.2f} ({len(next(v for v in variants if v.bf16 == (precision == 'bf16')).times)} "
              "rounds, best of each)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="add bf16-autocast lines")
    parser.add_argument("--bf16-repeats", type=int, default=3, help="rounds of the bf16 lines (after one warm-up)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    import deepspeed

    print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, threads {torch.get_num_threads()}")
    print(cpu_description())
    print(f"correctness: ours (grouped and loop) vs naive per-token reference, max abs diff "
          f"{check_against_reference():.1e} (output and gradients within 1e-5)")
    init_deepspeed_group()
    for name in args.sizes:
        size = SIZES[name]
        print_table(size, bench_size(size, args.repeats, args.warmup, args.bf16, args.bf16_repeats))


if __name__ == "__main__":
    main()
