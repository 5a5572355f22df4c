"""Staged context extension (`[[train.stages]]`): a run whose rows grow 512 -> 2K -> 8K positions
at a constant number of positions per step, against the peer that trains every step at 512.

Both runs see the same positions per step (rows per micro-batch shrink as rows grow) for the same
steps, same seed and init; the staged run's RoPE base grows with its rows (10k -> 40k -> 160k).
Printed: the training loss at the end of each stage for both, tokens/s per stage and their ratio
(a longer row costs more attention per position), and the loss curves as a PNG with the stage
boundaries marked. Needs a home with a dataset (`tokenloom demo --config tiny --home DIR`).

    .venv/bin/python bench/bench_stages.py --home /tmp/bh --steps-per-stage 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "tokenloom")
STAGES = ((512, 10_000.0), (2048, 40_000.0), (8192, 160_000.0))


def _train(home: str, dataset: str, recipe: Path, run: str) -> dict:
    out = subprocess.run([CLI, "train", "--dataset", dataset, "--home", home, "--config", str(recipe), "--run", run,
                          "--json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"tokenloom train ({run}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def _recipe(path: Path, steps: int, rows: int, staged: bool, extra: str) -> Path:
    text = f"""
[model]
dim = 64
n_layers = 2
n_heads = 2
[stream]
seq_len = {STAGES[0][0]}
[train]
steps = {steps * len(STAGES)}
micro_batch_size = {rows}
warmup_steps = {max(1, steps // 4)}
log_every = 1
eval_batches = 0
{extra}
"""
    if staged:
        for seq_len, theta in STAGES:
            text += f"[[train.stages]]\nsteps = {steps}\nseq_len = {seq_len}\nrope_theta = {theta}\n"
    path.write_text(text)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", required=True)
    p.add_argument("--dataset", default="stdlib-docs")
    p.add_argument("--steps-per-stage", type=int, default=40)
    p.add_argument("--rows", type=int, default=16, help="rows of 512 per step (8K rows: rows * 512 / 8192)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "stages"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, staged in (("flat-512", False), ("staged", True)):
        print(f"training {name} ({args.steps_per_stage * len(STAGES)} steps) ...", flush=True)
        recipe = _recipe(out / f"{name}.toml", args.steps_per_stage, args.rows, staged, "")
        runs[name] = _train(args.home, args.dataset, recipe, f"bench-stages-{name}-{Path(out).name}")
    curves = {}
    for name, doc in runs.items():
        records = [json.loads(x) for x in (Path(doc["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [(r["step"], r["loss"], r["tokens_per_second"]) for r in records if "loss" in r]
    n = args.steps_per_stage
    def stage_seconds(rows: list, k: int) -> float:
        """A stage's share of the training time, from the cumulative tokens/s at its ends: positions
        per step are equal, so time to the end of step e is proportional to (e + 1) / rate(e)."""
        rate = {step: r for step, _, r in rows}
        end, start = (k + 1) * n - 1, k * n - 1
        return (end + 1) / rate[end] - ((start + 1) / rate[start] if start >= 0 else 0.0)

    print(f"\n{'row length':>10} {'flat-512 loss':>14} {'staged loss':>12} {'staged speed / flat':>20}")
    for k, (seq_len, _) in enumerate(STAGES):
        end = (k + 1) * n - 1
        last = {name: [r[1] for r in rows if end - 4 <= r[0] <= end] for name, rows in curves.items()}
        ratio = stage_seconds(curves["flat-512"], k) / stage_seconds(curves["staged"], k)
        print(f"{seq_len:>10} {sum(last['flat-512']) / 5:>14.3f} {sum(last['staged']) / 5:>12.3f} {ratio:>20.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in curves.items():
        ax.plot([r[0] for r in rows], [r[1] for r in rows], label=name, lw=1.2)
    for k, (seq_len, theta) in enumerate(STAGES):
        ax.axvline(k * n, color="grey", ls=":", lw=0.8)
        ax.text(k * n + 1, ax.get_ylim()[1], f"{seq_len} positions, RoPE {theta:,.0f}", va="top", fontsize=8)
    ax.set_xlabel("step (same positions per step in both runs)")
    ax.set_ylabel("training loss")
    ax.set_title("staged context extension 512 -> 2K -> 8K vs flat 512")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "stages.png", dpi=110)
    (out / "summary.json").write_text(json.dumps({k: {"run_dir": v["run_dir"], "losses": v["losses"]}
                                                  for k, v in runs.items()}, indent=2))
    print(f"\nloss curves: {out / 'stages.png'}")


if __name__ == "__main__":
    main()
