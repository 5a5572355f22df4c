"""Visual tokenizer on a GPU: encode throughput (dual-path vs the CNN baseline, bf16 and fp32)
and a short training run, with peak memory. Run by bench/gpu_visual.sh; prints a table and
writes JSON under --out."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def encode_rate(model, size: int, batch: int, dtype, repeats: int = 10) -> float:
    x = torch.rand(batch, 3, size, size, device="cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        model.encode(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            model.encode(x)
        torch.cuda.synchronize()
    return batch * repeats / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/gpu")
    p.add_argument("--train-minutes", type=float, default=2.0)
    args = p.parse_args()
    from tokenloom.samples.images import sample_photos
    from tokenloom.tokenizers.visual import (
        VisualTokenizer,
        VisualTokenizerConfig,
        matched_baseline,
        train_visual,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = VisualTokenizerConfig()
    rows = []
    for name, model in [("dual", VisualTokenizer(cfg)), ("cnn", VisualTokenizer(*matched_baseline(cfg)))]:
        model = model.cuda()
        model.init_codebook(torch.rand(8, 3, 128, 128, device="cuda"))
        model.eval()
        for size, batch in [(128, 256), (256, 64)]:
            for dtype in (torch.bfloat16, torch.float32):
                torch.cuda.reset_peak_memory_stats()
                rate = encode_rate(model, size, batch, dtype)
                rows.append({"arch": name, "size": size, "batch": batch, "dtype": str(dtype).split(".")[-1],
                             "images_per_s": rate, "peak_mb": torch.cuda.max_memory_allocated() / 2**20})
                print(f"encode {name:4s} {size}x{size} batch {batch:3d} {rows[-1]['dtype']:8s} "
                      f"{rate:10.0f} images/s  peak {rows[-1]['peak_mb']:.0f} MB", flush=True)
    torch.cuda.reset_peak_memory_stats()
    train_cfg = VisualTokenizerConfig(max_minutes=args.train_minutes, batch_size=64, eval_every_s=30.0,
                                      checkpoint_every_s=1e9)
    result = train_visual(list(sample_photos("train").values()), list(sample_photos("heldout").values()),
                          train_cfg, out / "bundles", out / "visual-train", progress=False, device="cuda")
    training = {"steps": result.steps, "seconds": result.seconds, "images_per_s": result.images_per_second,
                "heldout": result.heldout, "peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    print(f"training {args.train_minutes} min, batch 64, bf16: {result.steps} steps, "
          f"{result.images_per_second:.0f} images/s, held-out PSNR {result.heldout['psnr']:.2f} dB, "
          f"usage {result.heldout['usage']:.1%}, peak {training['peak_mb']:.0f} MB", flush=True)
    (out / "visual.json").write_text(json.dumps({"encode": rows, "training": training}, indent=2))


if __name__ == "__main__":
    main()
