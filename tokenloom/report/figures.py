"""Plotly figures of a dataset and of training runs, from plain dicts (what the catalog summary and
a run's metrics.jsonl hold). Each function returns a figure's HTML `<div>` without plotly.js: the
page inlines the library once (`page.render`), so the report opens from disk with no network.

Why Plotly: interactive (hover the exact figure, zoom a loss curve, toggle a run) yet a static
file; its JS is a Python package's file, not a CDN download.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from tokenloom.contract import MODALITIES

LAYOUT = {"margin": {"l": 50, "r": 20, "t": 40, "b": 40}, "height": 320, "template": "plotly_white"}


def _div(fig: go.Figure, div_id: str) -> str:
    fig.update_layout(**LAYOUT)
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def token_mix(stats: dict, div_id: str = "token-mix") -> str:
    """Tokens per modality, the samples holding each in the hover text (a sample counts under each
    modality it holds: every sample has text segments)."""
    per = stats.get("modalities", {})
    names = [m for m in MODALITIES if m in per]
    fig = go.Figure(go.Bar(x=names, y=[per[m]["tokens"] for m in names],
                           text=[f"{per[m]['samples']:,} samples" for m in names], textposition="auto"))
    fig.update_layout(title="tokens per modality", yaxis={"title": "tokens", "type": "log"})
    return _div(fig, div_id)


def length_histogram(counts: Sequence[int], edges: Sequence[int], div_id: str = "lengths") -> str:
    """Samples per length bin (tokens; bins from the catalog's fixed edges)."""
    labels = [f"{edges[i]}-{edges[i + 1] - 1}" if i + 1 < len(edges) else f">={edges[i]}" for i in range(len(counts))]
    last = max((i for i, c in enumerate(counts) if c), default=0) + 1
    fig = go.Figure(go.Bar(x=labels[:last], y=list(counts)[:last]))
    fig.update_layout(title="sample length (tokens)", xaxis={"title": "tokens"}, yaxis={"title": "samples"})
    return _div(fig, div_id)


def reasons(counts: dict[str, int], title: str, div_id: str) -> str:
    """A horizontal bar per reason (quarantine, filter or duplicate kind)."""
    items = sorted(counts.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h"))
    fig.update_layout(title=title, xaxis={"title": "records"}, height=max(220, 40 + 26 * len(items)))
    return _div(fig, div_id)


def run_curves(runs: dict[str, list[dict]], key: str, title: str, div_id: str, log_y: bool = False) -> str | None:
    """One line per run (and per modality for `loss`) of a metrics key over steps; None when no
    run logged it."""
    fig = go.Figure()
    for name, records in runs.items():
        train = [r for r in records if "loss" in r and "eval" not in r]
        keys = [f"loss_{m}" for m in MODALITIES] if key == "loss_by_modality" else [key]
        for k in keys:
            points = [(r["step"], r[k]) for r in train if r.get(k) is not None]
            if points:
                label = name if len(keys) == 1 else f"{name}: {k.removeprefix('loss_')}"
                fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines",
                                         name=label))
        if key == "loss_by_modality":  # held-out evaluations, as markers
            for m in MODALITIES:
                evals = [(r["steps_done"], r[f"val_loss_{m}"]) for r in records
                         if r.get("eval") == "held-out" and r.get(f"val_loss_{m}") is not None]
                if evals:
                    fig.add_trace(go.Scatter(x=[e[0] for e in evals], y=[e[1] for e in evals], mode="markers",
                                             marker={"size": 9, "symbol": "diamond"}, name=f"{name}: held-out {m}"))
    if not fig.data:
        return None
    fig.update_layout(title=title, xaxis={"title": "step"}, yaxis={"type": "log" if log_y else "linear"})
    return _div(fig, div_id)


def routing_balance(records: list[dict], div_id: str) -> str | None:
    """The last logged max-load violation per layer and modality (load / mean load - 1: 0 is perfectly
    balanced) as a heatmap; None for a run without routing metrics (a dense model)."""
    last = next((r for r in reversed(records) if any(k.endswith(".max_violation") for k in r)), None)
    if last is None:
        return None
    cells = {}
    for k, v in last.items():
        if k.endswith(".max_violation") and k.startswith("l"):
            layer, modality = k.split(".")[:2]
            cells[(int(layer[1:]), modality)] = v
    layers = sorted({layer for layer, _ in cells})
    modalities = [m for m in (*MODALITIES, "all") if any(mm == m for _, mm in cells)]
    z = [[cells.get((layer, m)) for m in modalities] for layer in layers]
    fig = go.Figure(go.Heatmap(z=z, x=modalities, y=[f"layer {i}" for i in layers], colorscale="Viridis",
                               colorbar={"title": "max load / mean - 1"}))
    fig.update_layout(title=f"expert load balance per layer and modality (step {last['step']})")
    return _div(fig, div_id)


def spectrogram_png(wav_path) -> bytes:
    """A small log-mel spectrogram of a WAV file as PNG bytes (torchaudio's transform, matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import soundfile as sf
    import torch
    import torchaudio

    wav, rate = sf.read(str(wav_path), dtype="float32", always_2d=True)
    mel = torchaudio.transforms.MelSpectrogram(rate, n_fft=512, hop_length=160, n_mels=64)(torch.from_numpy(wav[:, 0]))
    fig, ax = plt.subplots(figsize=(4.0, 1.6), dpi=90)
    ax.imshow((mel + 1e-6).log10().numpy(), origin="lower", aspect="auto", cmap="magma")
    ax.set_axis_off()
    fig.tight_layout(pad=0)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
