"""Elastic training evidence: do sub-models of an elastically trained model lose less?

Models are trained for the same steps on the same training split of a catalog snapshot (same
seed, init and data order): one plain, the others with elastic depth/width/sparsity sampling
(`model.elastic.enabled=true`) in the variants of `VARIANTS` (`--variants`). Each is then
evaluated on the held-out split (`stream.holdout`) as the full model and as three cuts: 60% of
the layers (evenly spaced), 50% of the experts, and top-1 routing; a cut's cost is its loss
increase relative to its own full model. Aims: every elastic cut costs at most half what the
same cut costs the plain model (#7), and the elastic full model is within 3% of the plain one (#15).

The runs go through the command line (`tokenloom train`, `tokenloom model eval`), each in its
own process. Needs a home with the demo dataset (`make demo`, or `tokenloom demo --home DIR`).

    .venv/bin/python bench/bench_elastic.py --home .tokenloom --steps 600
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "tokenloom")


# the runs compared: each is `tokenloom train` with these overrides on top of the common ones
VARIANTS = {
    "plain": [],
    # elastic with the sandwich rule (the default) and lazy AdamW: the full model trained every step
    "elastic": ["model.elastic.enabled=true", "train.optimizer=lazy_adamw"],
    # elastic without it: a sub-model step trains only the sub-model (lazy AdamW leaves the rest alone)
    "elastic-no-sandwich": ["model.elastic.enabled=true", "model.elastic.sandwich=false", "train.optimizer=lazy_adamw"],
    # the first elastic runs (#7): torch AdamW, which moves skipped layers on zero gradients
    "elastic-adamw": ["model.elastic.enabled=true", "model.elastic.sandwich=false"],
}


def _cli(*args: str) -> dict:
    out = subprocess.run([CLI, *args, "--json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"tokenloom {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", default=str(ROOT / ".tokenloom"))
    p.add_argument("--dataset", default="stdlib-docs")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--set", action="append", default=[], help="extra config override key=value (repeatable)")
    p.add_argument("--variants", default="plain,elastic,elastic-no-sandwich",
                   help=f"comma-separated runs among {', '.join(VARIANTS)} (plain is the reference)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "elastic"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    common = [f"model.n_layers={args.layers}", f"stream.holdout={args.holdout}", "train.warmup_steps=30",
              *args.set]
    n_layers = args.layers
    keep = max(1, round(0.6 * n_layers))
    layers = sorted({round(i * (n_layers - 1) / max(1, keep - 1)) for i in range(keep)})
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    if "plain" not in variants:
        raise SystemExit("--variants must include plain (the reference)")
    runs = {}
    for name, extra in variants.items():
        print(f"training {name} ({args.steps} steps) ...", flush=True)
        trained = _cli("train", "--dataset", args.dataset, "--home", args.home, "--steps", str(args.steps),
                       *common, *extra)
        runs[name] = trained
        (out / f"{name}_train.json").write_text(json.dumps(trained, indent=2))
    experts = _cli("model", "export", runs["plain"]["run_dir"], "--out", str(out / "probe"))["n_experts"]
    cuts = {
        "full": [],
        f"{len(layers)}/{n_layers} layers": ["--layers", ",".join(map(str, layers))],
        f"{experts // 2}/{experts} experts": ["--experts", f"0-{experts // 2 - 1}"],
        "top-1": ["--top-k", "1"],
    }
    table: dict[str, dict[str, dict]] = {}
    for name, trained in runs.items():
        table[name] = {}
        for cut, flags in cuts.items():
            table[name][cut] = _cli("model", "eval", trained["run_dir"], "--dataset", args.dataset, "--home",
                                    args.home, "--batches", str(args.eval_batches), *flags,
                                    f"stream.holdout={args.holdout}", "stream.split=val", *args.set)
    (out / "results.json").write_text(json.dumps(table, indent=2))

    print(f"\nvalidation loss (held-out {args.holdout:.0%} of {args.dataset}, {table['plain']['full']['tokens']:,.0f} "
          f"tokens), {args.steps} training steps each; +% is a cut's loss over its own full model's")
    plain_full = table["plain"]["full"]["loss"]
    for name in runs:
        if name == "plain":
            continue
        full = table[name]["full"]["loss"]
        print(f"\n{name}: full model {full:.3f} against plain {plain_full:.3f}: {100 * (full / plain_full - 1):+.1f}% "
              f"(aim <= +3%)")
        print(f"{'sub-model':<18}{'plain':>9}{name:>22}{'plain +%':>10}{'elastic +%':>12}{'ratio':>8}  aim <= 0.5")
        ok = True
        for cut in cuts:
            p_loss, e_loss = table["plain"][cut]["loss"], table[name][cut]["loss"]
            p_inc = p_loss / plain_full - 1
            e_inc = e_loss / full - 1
            ratio = e_inc / p_inc if cut != "full" and p_inc > 0 else float("nan")
            if cut != "full":
                ok &= ratio <= 0.5
            print(f"{cut:<18}{p_loss:>9.3f}{e_loss:>22.3f}{100 * p_inc:>9.1f}%{100 * e_inc:>11.1f}%{ratio:>8.2f}")
        print(f"cuts aim met: {ok}; full-model aim met: {full / plain_full - 1 <= 0.03}")
    for name in runs:
        ml = runs[name]["modality_loss"]
        print(f"{name}: final training loss per modality {json.dumps({k: round(v, 3) for k, v in ml.items() if v})}, "
              f"{runs[name]['tokens_per_second']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
