"""RL post-training methods at the same wall-clock budget from the same SFT start (#17).

Each variant is `tokenloom rl MODEL` with the shared settings below plus its own overrides, once per
seed (the seed picks the training queries, the held-out queries and the sampler; every variant sees
the same ones for a seed). All run for `--minutes` of rollouts and training (`rl.max_minutes`:
evaluations are not charged, hint probes are), `--parallel` at a time with `--threads` each and
rollouts in the process (`--rollout-actors 0`), so concurrent runs see the same machine load;
`--rollout-actors K --parallel 1` runs them on Ray actors instead and reports the actors' busy share.

Variants (default: all five):
  misc   GSPO's sequence ratio (clip 1 - 3e-4 / 1 + 4e-4) with IcePop's token and sequence gates, U-RB
  grpo   a ratio per token clipped to [0.8, 1.2], no gates (GRPO without its KL term, as DAPO/verl run it), U-RB
  sync   misc with the synchronous buffer (a batch's queries are generated to the end, then trained)
  april  misc with the APRIL-style buffer (train on whichever responses finish first)
  hints  misc with adaptive hints (AHRL) on buckets whose starting pass rate is below 0.5

Reported per variant (mean and spread over seeds): greedy pass@1 without hints on the hard bucket
(and each bucket) at the start and at the end, steps done, steps per minute, sampled reward and
entropy over the last 20 steps, clip fraction, IcePop's masked share, mean trained response length;
and the hard bucket's pass@1 against steps and against minutes (a PNG).

    TOKENLOOM_HOME=/tmp/rl .venv/bin/python bench/bench_rl.py --model sort-sft100 --minutes 3 \\
        --seeds 0,1,2 --parallel 2 --threads 1 --hard "5 digits"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENLOOM = str(Path(sys.executable).with_name("tokenloom"))

VARIANTS = {
    "misc": [],
    "grpo": ["rl.misc.ratio=token", "rl.misc.clip_low=0.2", "rl.misc.clip_high=0.2", "rl.misc.token_gate=false",
             "rl.misc.sequence_gate=false"],
    "sync": ["--buffer", "sync"],
    "april": ["--buffer", "april"],
    "hints": ["--hints", "rl.hint.p_init=0.5", "rl.hint.samples=16"],
}
SHARED = ["rl.lr=1e-4", "rl.batch_queries=8", "rl.group_size=8", "rl.updates_per_batch=2", "rl.buckets=1,2",
          "rl.eval_buckets=0,1,2", "rl.eval_every=40", "rl.eval_queries=64", "rl.checkpoint_every=0",
          "rl.steps=100000"]


def run_name(variant: str, seed: int, tag: str) -> str:
    return f"{tag}-{variant}-s{seed}"


def launch(model: str, variant: str, seed: int, args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    cmd = [TOKENLOOM, "rl", model, "--config", args.config, "--run", run_name(variant, seed, args.tag), "--json",
           "--rollout-actors", str(args.rollout_actors), "--max-minutes", str(args.minutes), *SHARED, f"rl.seed={seed}",
           *VARIANTS[variant], *args.extra]
    log = open(Path(args.out) / f"{run_name(variant, seed, args.tag)}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def run_all(jobs: list[tuple[str, int]], args) -> None:
    pending, running = list(jobs), []
    started = time.time()
    while pending or running:
        while pending and len(running) < args.parallel:
            variant, seed = pending.pop(0)
            running.append((variant, seed, launch(args.model, variant, seed, args)))
        time.sleep(2)
        for job in list(running):
            variant, seed, proc = job
            if proc.poll() is not None:
                running.remove(job)
                status = "done" if proc.returncode == 0 else f"FAILED ({proc.returncode}, see its .log)"
                print(f"[{(time.time() - started) / 60:5.1f} min] {variant} seed {seed}: {status}; "
                      f"{len(pending)} waiting, {len(running)} running", flush=True)


def summarize(home: Path, variant: str, seed: int, args) -> dict | None:
    path = home / "runs" / run_name(variant, seed, args.tag) / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    evals = [r for r in records if r.get("eval") == "pass@1"]
    if not steps or not evals:
        return None
    seconds = np.cumsum([r["rollout_seconds"] + r["train_seconds"] for r in steps])
    minute_at = {r["step"] + 1: s / 60 for r, s in zip(steps, seconds, strict=True)}
    minute_at[0] = 0.0
    hard = f"pass1/{args.hard}"
    tail = steps[-20:]

    def mean(key: str, rows=tail) -> float:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        return float(np.mean(vals)) if vals else float("nan")

    return {
        "steps": len(steps), "minutes": float(seconds[-1] / 60), "steps_per_min": len(steps) / (seconds[-1] / 60),
        "start": {k: v for k, v in evals[0].items() if k.startswith("pass1")},
        "end": {k: v for k, v in evals[-1].items() if k.startswith("pass1")},
        "curve": [(e["step"], minute_at.get(e["step"], float("nan")), e.get(hard, float("nan"))) for e in evals],
        "reward_first": mean("reward", steps[:20]), "reward_last": mean("reward"),
        "entropy_first": mean("entropy", steps[:20]), "entropy_last": mean("entropy"),
        "clip_fraction": mean("clip_fraction", steps), "masked": mean("token_masked_fraction/text", steps),
        "response_tokens": mean("response_tokens", steps), "hint_fraction": mean("hint_fraction", steps),
        "busy": mean("rollout_busy", steps), "rounds": mean("rounds", steps),
    }


def fmt(values: list[float], digits: int = 2) -> str:
    vals = [v for v in values if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{np.mean(vals):.{digits}f} +- {np.std(vals, ddof=1):.{digits}f}"


def report(results: dict[str, list[dict]], args) -> str:
    hard = f"pass1/{args.hard}"
    buckets = sorted({k for runs in results.values() for r in runs for k in r["end"] if k not in ("pass1", hard)})
    lines = [f"| variant | seeds | hard ({args.hard}) start | hard end | hard end - start | "
             + " | ".join(f"{b.removeprefix('pass1/')} end" for b in buckets)
             + " | steps | steps/min | reward first -> last 20 | entropy last 20 | clip fraction | IcePop masked | "
               "trained tokens | rounds/step | actors busy |",
             "|---|---|---|---|---|" + "---|" * len(buckets) + "---|---|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        if not runs:
            continue
        gain = [r["end"].get(hard, np.nan) - r["start"].get(hard, np.nan) for r in runs]
        lines.append(
            f"| {variant} | {len(runs)} | {fmt([r['start'].get(hard, np.nan) for r in runs])} | "
            f"{fmt([r['end'].get(hard, np.nan) for r in runs])} | {fmt(gain)} | "
            + " | ".join(fmt([r["end"].get(b, np.nan) for r in runs]) for b in buckets)
            + f" | {fmt([r['steps'] for r in runs], 0)} | {fmt([r['steps_per_min'] for r in runs], 1)} | "
              f"{fmt([r['reward_first'] for r in runs])} -> {fmt([r['reward_last'] for r in runs])} | "
              f"{fmt([r['entropy_last'] for r in runs], 3)} | {fmt([r['clip_fraction'] for r in runs], 3)} | "
              f"{fmt([100 * r['masked'] for r in runs], 3)}% | {fmt([r['response_tokens'] for r in runs], 2)} | "
              f"{fmt([r['rounds'] for r in runs], 2)} | "
              f"{fmt([r['busy'] for r in runs]) if args.rollout_actors else '-'} |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], args, out: Path) -> Path | None:
    from tokenloom.trainer.metrics import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, runs in results.items():
        if not runs:
            continue
        colour = None
        for i, r in enumerate(runs):
            steps, minutes, values = zip(*r["curve"], strict=True)
            (line,) = axes[0].plot(steps, values, color=colour, alpha=0.35, lw=0.8)
            colour = line.get_color()
            axes[1].plot(minutes, values, color=colour, alpha=0.35, lw=0.8)
            if i == 0:
                axes[0].plot([], [], color=colour, label=variant)
        # the mean over seeds at the evaluation steps every seed reached
        common = sorted(set.intersection(*({s for s, _, _ in r["curve"]} for r in runs)))
        if common:
            mean = [np.mean([dict((s, v) for s, _, v in r["curve"])[c] for r in runs]) for c in common]
            axes[0].plot(common, mean, color=colour, lw=2)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("minutes of rollouts and training")
    for ax in axes:
        ax.set_ylabel(f"greedy pass@1, {args.hard}, no hints")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{args.model}: {args.minutes} min per run, seeds {args.seeds} (thin: a seed, thick: the mean)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the SFT start: a run name or model folder under TOKENLOOM_HOME")
    ap.add_argument("--config", default="rl")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rollout-actors", type=int, default=0,
                    help="Ray rollout actors per run (0: in the run's process; >0 measures the actors' busy share)")
    ap.add_argument("--hard", default="5 digits", help="the bucket whose pass@1 is the headline")
    ap.add_argument("--tag", default="cmp", help="run names are TAG-VARIANT-sSEED")
    ap.add_argument("--out", default="/tmp/bench_rl", help="logs and the summary JSON")
    ap.add_argument("--figure", default=str(ROOT / "bench" / "figures" / "rl_compare.png"))
    ap.add_argument("--report-only", action="store_true", help="summarize runs that already exist")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    home = Path(os.environ.get("TOKENLOOM_HOME", ROOT / ".tokenloom"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if not args.report_only:
        # seed-major order: the runs of one seed go together, so a cut-short bench still compares variants
        jobs = [(v, s) for s in seeds for v in variants
                if not (home / "runs" / run_name(v, s, args.tag) / "model").is_dir()]
        print(f"{len(jobs)} runs of {args.minutes} min, {args.parallel} at a time, {args.threads} thread(s) each; "
              f"CPU: {cpu_name()}", flush=True)
        run_all(jobs, args)
    results = {v: [r for s in seeds if (r := summarize(home, v, s, args)) is not None] for v in variants}
    (Path(args.out) / f"{args.tag}.json").write_text(json.dumps(results, indent=1))
    print(report(results, args))
    figure = plot(results, args, Path(args.figure))
    if figure:
        print(f"figure: {figure}")


if __name__ == "__main__":
    main()
