"""One PNG of an RL run, panels a reader checks in this order: is the reward rising and does pass@1
(no hints) follow, is the policy still exploring (entropy), how off-policy the updates were (clip
fraction, IcePop's masked share, mismatch KL, staleness), whether the rollout actors were kept
busy, and how fast the hints faded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tokenloom.trainer.metrics import pyplot


def _series(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def _smoothed(ax, xs: list, ys: list, label: str, window: int = 10) -> None:
    """The series, faint, and its moving average over `window` records."""
    import numpy as np

    (line,) = ax.plot(xs, ys, alpha=0.3, lw=0.8)
    if len(ys) >= window:
        ax.plot(xs[window - 1:], np.convolve(ys, np.ones(window) / window, mode="valid"), color=line.get_color(),
                label=f"{label} ({window}-step mean)")


def plot_rl(records: list[dict], staleness: Counter, out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    train = [r for r in records if "reward" in r]
    evals = [r for r in records if r.get("eval") == "pass@1"]
    fig, axes = plt.subplots(2, 4, figsize=(15, 6.5), dpi=110)
    ax = axes[0, 0]
    _smoothed(ax, *_series(train, "reward"), "reward")
    _smoothed(ax, *_series(train, "solved"), "solved share")
    ax.set_title("reward")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for key in sorted({k for r in evals for k in r if k.startswith("pass1/")}):
        ax.plot(*_series(evals, key), "o-", ms=3, label=key.split("/", 1)[1])
    ax.plot(*_series(evals, "pass1"), "k--", label="all")
    ax.set_title("pass@1 per bucket (greedy, no hints)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7)
    _smoothed(axes[0, 2], *_series(train, "entropy"), "entropy")
    axes[0, 2].set_title("entropy of response tokens (nats)")
    ax = axes[0, 3]
    ax.plot(*_series(train, "clip_fraction"), label="GSPO clip fraction")
    for key in sorted({k for r in train for k in r if k.startswith(("token_masked_fraction/", "sequence_masked"))}):
        ax.plot(*_series(train, key), label=f"IcePop {key}")
    ax.set_title("clipped and gated")
    ax.legend(fontsize=6)
    ax = axes[1, 0]
    for key in sorted({k for r in train for k in r if k.startswith("mismatch_kl/")}):
        ax.plot(*_series(train, key), label=key)
    ax.set_title("train/inference mismatch KL")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    lags = sorted(staleness)
    ax.bar([str(k) for k in lags], [staleness[k] for k in lags])
    ax.set_title("staleness of trained tokens (versions behind)")
    ax = axes[1, 2]
    ax.plot(*_series(train, "rollout_busy"))
    ax.set_ylim(0, 1.05)
    ax.set_title("rollout actors' busy fraction")
    ax = axes[1, 3]
    ax.plot(*_series(train, "hint_fraction"), label="hint share of the answer")
    ax.plot(*_series(train, "hinted_queries"), label="hinted queries")
    ax.set_title("adaptive hints")
    ax.legend(fontsize=7)
    for a in axes.flat:
        a.grid(alpha=0.3)
        a.set_xlabel("step")
    axes[1, 1].set_xlabel("versions behind")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
