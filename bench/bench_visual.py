"""Visual tokenizer benchmark: dual-path vs the single-path CNN ablation (and quantizers).

Each variant trains in its own process on the same training photos (scikit-image's bundled
photographs minus the held-out ones) for the same wall-clock budget and thread count, at the
same parameter count (the CNN baseline gets extra bottleneck blocks, `matched_baseline`).
Variants run side by side (`--parallel 2`, one thread each on this 2-core machine) so both
see the same machine load. Afterwards, one at a time and with one thread, each bundle is
evaluated on the held-out crops (PSNR, SSIM, codebook usage, perplexity) and its encoding
speed is measured in images/s per core. Prints a table and ratios to the first variant.

    .venv/bin/python bench/bench_visual.py --minutes 15                      # the ablation
    .venv/bin/python bench/bench_visual.py --minutes 3 --variants dual-fsq,dual-vq,dual-lfq --parallel 1 --threads 2
    .venv/bin/python bench/bench_visual.py --minutes 3 --variants dual-vq,dual-vq:vq_cosine=true  # key=value tweaks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from side_by_side import run_variants  # noqa: E402


def variant_config(name: str, args):
    from tokenloom.jobs.config import apply_overrides
    from tokenloom.tokenizers.visual import VisualTokenizerConfig

    spec, *overrides = name.split(":")  # "dual-vq:vq_cosine=true:lr=0.001"
    arch, _, quantizer = spec.partition("-")
    cfg = VisualTokenizerConfig(arch=arch, quantizer=quantizer or "vq", max_minutes=args.minutes,
                                image_size=args.image_size, factor=args.factor, threads=args.threads,
                                eval_every_s=max(60.0, args.minutes * 60 / 5), checkpoint_every_s=120.0,
                                batch_size=args.batch_size)
    try:
        apply_overrides(cfg, overrides, "visual_tokenizer.")
    except ValueError as exc:
        raise SystemExit(f"variant {name!r}: {exc}") from None
    return cfg


def train_one(name: str, args) -> None:
    from tokenloom.samples.images import sample_photos
    from tokenloom.tokenizers.visual import matched_baseline, train_visual

    cfg = variant_config(name, args)
    extra = matched_baseline(cfg)[1] if cfg.arch == "cnn" else 0
    out = Path(args.out)
    result = train_visual(list(sample_photos("train").values()), list(sample_photos("heldout").values()), cfg,
                          out / "bundles", out / "runs" / name, extra_cnn_blocks=extra, progress=False)
    (out / f"{name}.json").write_text(json.dumps({
        "variant": name, "bundle": str(result.bundle.path), "steps": result.steps, "seconds": result.seconds,
        "train_images_per_second": result.images_per_second, "parameters": result.parameters,
        "heldout": result.heldout, "run_dir": result.run_dir,
    }, indent=2))


def encode_speed(model, size: int, batch: int = 16, repeats: int = 5) -> float:
    import torch

    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    model.encode(x)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        model.encode(x)
        best = min(best, time.perf_counter() - t)
    return batch / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--variants", default="dual-vq,cnn-vq")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "visual"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return train_one(args.worker, args)

    import torch

    from tokenloom.samples.images import sample_photos
    from tokenloom.tokenizers.visual import evaluate, load_visual
    from tokenloom.tokenizers.visual.train import heldout_crops, prepare

    variants = args.variants.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("minutes", "threads", "image_size", "factor", "batch_size", "out")]
    run_variants(__file__, variants, args.parallel, forwarded, args.minutes, args.threads)

    torch.set_num_threads(1)
    cfg0 = variant_config(variants[0], args)
    eval_set = heldout_crops(list(sample_photos("heldout").values()), cfg0.eval_crops, cfg0.image_size, cfg0.seed + 1)
    held = sample_photos("heldout")
    whole_set = [prepare(p, cfg0) for p in held.values()]  # whole photographs at the encode-time pixel budget
    rows = []
    for name in variants:
        doc = json.loads((out / f"{name}.json").read_text())
        model = load_visual(doc["bundle"])
        ev = evaluate(model, eval_set, grid_path=out / f"grid-{name}.png")
        whole = evaluate(model, whole_set, list(held), grid_path=out / f"whole-{name}.png")
        rows.append({**doc, "psnr": ev.psnr, "ssim": ev.ssim, "usage": ev.usage, "perplexity": ev.perplexity,
                     "num_codes": ev.num_codes, "encode_images_per_s_per_core": encode_speed(model, args.image_size),
                     "whole": {"psnr": whole.psnr, "ssim": whole.ssim, "usage": whole.usage, "codes": whole.codes,
                               "perplexity": whole.perplexity}})
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    base = rows[0]
    print(f"\nheld-out: {len(eval_set)} crops of {', '.join(held)} at {args.image_size}x"
          f"{args.image_size}, and the whole photographs at {' and '.join('x'.join(map(str, w.shape[1:])) for w in whole_set)}"
          f", factor {args.factor}; {args.minutes} min training, {args.threads} thread(s) each\n")
    print("| variant | params | steps | train img/s | PSNR dB | SSIM | usage | perplexity | whole photos: PSNR dB | "
          "SSIM | usage | encode img/s/core |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["whole"]
        print(f"| {r['variant']} | {r['parameters']:,} | {r['steps']} | {r['train_images_per_second']:.1f} | "
              f"{r['psnr']:.2f} | {r['ssim']:.3f} | {r['usage']:.1%} of {r['num_codes']} | {r['perplexity']:.0f} | "
              f"{w['psnr']:.2f} | {w['ssim']:.3f} | {w['usage']:.1%} ({w['codes']} codes) | "
              f"{r['encode_images_per_s_per_core']:.1f} |")
    for r in rows[1:]:
        print(f"{base['variant']} vs {r['variant']}: PSNR {base['psnr'] - r['psnr']:+.2f} dB, "
              f"SSIM {base['ssim'] - r['ssim']:+.3f}, usage {base['usage'] - r['usage']:+.1%}, encode speed "
              f"{base['encode_images_per_s_per_core'] / r['encode_images_per_s_per_core']:.2f}x")
    print(f"\ngrids and metrics: {out}")


if __name__ == "__main__":
    main()
