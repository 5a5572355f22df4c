"""Run metrics: a JSON-lines log, a loss-curve PNG per modality and an expert-load heatmap, written by rank 0.

The log holds a record per logging window (training losses, under "loss*") and one per held-out
evaluation ("eval": "held-out", losses and target counts under "val_*"), so a reader of the
training curve never mixes the two.

A resumed run continues its run folder's log: records from steps before the resume point are kept
and the rest (what the interrupted run logged after its last checkpoint) are dropped, so the log of
a resumed run reads like the log of one that was never interrupted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, resume_at: int | None = None):
        """A fresh log, or (`resume_at`: the step a resumed run starts at) the existing one's records
        before that step."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        if resume_at is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed run can be cut short
                    continue
                if record.get("step", resume_at) < resume_at:
                    self.records.append(record)
        self._file = self.path.open("w")
        for record in self.records:
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def peak_memory(device) -> dict[str, float]:
    """Peak memory in MiB: the process's max RSS (since it started) and, on a GPU, the allocator's
    peak since the last call (so each logging window reports its own)."""
    import resource

    import torch

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if getattr(device, "type", device) == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_loss(records: list[dict], out: Path) -> Path | None:
    """Loss against step (total and per modality) as a PNG; None when matplotlib is unavailable."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=120)
    colors = {}
    for key, label in (("loss", "total"), ("loss_text", "text"), ("loss_image", "image"), ("loss_audio", "audio")):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
        if pts:
            (line,) = ax.plot(*zip(*pts, strict=True), lw=1.2 if key == "loss" else 0.9, label=label)
            colors[key] = line.get_color()
    # held-out evaluations (records with "eval"), as markers in the colour of the training curve
    for key, label in (("loss", "total"), ("loss_text", "text"), ("loss_image", "image"), ("loss_audio", "audio")):
        pts = [(r["step"], r[f"val_{key}"]) for r in records if r.get("eval") and r.get(f"val_{key}") is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o", ms=4, color=colors.get(key), label=f"{label} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token): training, held-out")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_routing(loads, out: Path, title: str = "expert load / mean load (1 = balanced)") -> Path | None:
    """Heatmap of each expert's share of the load, one row per (layer, modality), from loads [layers, 4, E]."""
    plt = pyplot()
    if plt is None:
        return None
    import numpy as np

    loads = np.asarray(loads, dtype=np.float64)
    rows, labels = [], []
    for layer in range(loads.shape[0]):
        for m, name in enumerate(("text", "image", "audio")):
            total = loads[layer, m].sum()
            if total > 0:
                rows.append(loads[layer, m] / total)
                labels.append(f"layer {layer} {name}")
    if not rows:
        return None
    grid = np.stack(rows) * loads.shape[2]  # 1.0 = a perfectly even share
    fig, ax = plt.subplots(figsize=(max(5, 0.3 * loads.shape[2] + 2), 0.3 * len(rows) + 1.5), dpi=120)
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("expert")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
