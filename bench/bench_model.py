"""Whole-model training speed of the unified MoE model, and the fraction of this CPU's matmul peak.

One training step = forward + backward + AdamW on real packed rows of a catalog snapshot (the
demo dataset: text, images, audio), the model at the demo size. Model FLOPs per step are
counted from the shapes (6 x the matmul parameters each token uses, the shared output head on
every predicted position, attention at each row's actual mask density), the same convention
as "model FLOPs utilisation": recomputation and masked work count for nothing. The peak is the
best of square fp32 and bf16 matmuls measured in the same process. Also prints where the step
time goes (torch.profiler, by operator).

    .venv/bin/python bench/bench_model.py --home .tokenloom
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def matmul_peak(dtype, n: int = 1024, repeats: int = 5) -> float:
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def step_flops(cfg, batch) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward)."""

    from tokenloom.kernels import dense_allowed_mask
    from tokenloom.model.unified import mask_indices

    B, P = batch["modality"].shape
    D, H, moe = cfg.dim, cfg.moe.expert_hidden, cfg.moe
    per_token_layer = 2 * (4 * D * D + D * moe.n_experts + 3 * D * H * (moe.top_k + moe.n_shared_experts))
    targets = int((batch["labels"][..., 0] != -100).sum())
    audio = int((batch["labels"][..., 1:] != -100).sum()) if batch["labels"].shape[-1] > 1 else 0
    visible = int(dense_allowed_mask(mask_indices(batch), causal=False, seq_q=P).sum())  # (query, key) pairs
    attention = 2 * 2 * visible * D  # QK^T and PV
    forward = cfg.n_layers * (B * P * per_token_layer + attention) + 2 * D * cfg.vocab_size * targets
    forward += 2 * D * (cfg.audio_ranges[1][1] - cfg.audio_ranges[1][0] if len(cfg.audio_ranges) > 1 else 0) * audio
    return 3.0 * forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", default=str(ROOT / ".tokenloom"))
    p.add_argument("--dataset", default="stdlib-docs")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    args = p.parse_args()

    import torch

    from tokenloom.datasets import TokenStream, shard_files
    from tokenloom.jobs.config import load_run_config
    from tokenloom.jobs.home import Home, open_catalog
    from tokenloom.model import UnifiedModel
    from tokenloom.trainer.fit import fit_to_vocabulary

    cfg = load_run_config("demo", args.set)
    home = Home(Path(args.home))
    catalog = open_catalog(home, cfg)
    summary = catalog.summary(args.dataset)
    vocab = home.manifest(summary["vocab_id"])
    fit_to_vocabulary(cfg.model, cfg.stream, vocab.size, [(r.start, r.stop) for r in vocab.audio])
    stream = TokenStream(shard_files(catalog, args.dataset), cfg.stream)
    rows = stream.batches(cfg.train.micro_batch_size)
    torch.manual_seed(0)
    model = UnifiedModel(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{k: torch.from_numpy(v) for k, v in next(rows).items()} for _ in range(args.steps + 1)]

    def step(batch, bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()

    peaks = {False: matmul_peak(torch.float32), True: matmul_peak(torch.bfloat16)}
    print(f"model: dim {cfg.model.dim}, {cfg.model.n_layers} layers, {cfg.model.moe.n_experts} experts top-"
          f"{cfg.model.moe.top_k} + {cfg.model.moe.n_shared_experts} shared, {sum(p.numel() for p in model.parameters()):,} "
          f"parameters; rows {cfg.train.micro_batch_size} x {cfg.stream.seq_len}; torch threads {torch.get_num_threads()}")
    print(f"matmul peak (1024^3): fp32 {peaks[False] / 1e9:.1f} GFLOP/s, bf16 {peaks[True] / 1e9:.1f} GFLOP/s")
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches[1:])
    flops = sum(step_flops(cfg.model, b) for b in batches[1:])
    speed = {}
    for bf16 in (False, True, False, True):  # interleaved; the second of each counts
        step(batches[0], bf16)  # warm-up
        t0 = time.perf_counter()
        for b in batches[1:]:
            step(b, bf16)
        speed[bf16] = time.perf_counter() - t0
    for bf16, seconds in speed.items():
        name = "bf16 autocast" if bf16 else "fp32"
        print(f"training {name:<13}: {tokens / seconds:>8,.0f} tokens/s, {flops / seconds / 1e9:6.2f} model GFLOP/s = "
              f"{flops / seconds / peaks[bf16]:.1%} of the {'bf16' if bf16 else 'fp32'} matmul peak "
              f"({seconds / args.steps:.2f} s/step)")
    print(f"bf16 autocast / fp32 speed: {speed[False] / speed[True]:.2f}x")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batches[1], True)
    print("one bf16 step by operator:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
