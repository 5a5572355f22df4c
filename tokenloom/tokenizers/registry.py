"""The neural tokenizers by kind, behind one signature (mosaicml/streaming's registry style).

The visual and the audio tokenizer are trained, evaluated and described the same way: arrays
in, a bundle out; a bundle and arrays in, metrics out. Jobs and the command line call
`NEURAL_TOKENIZERS[kind]` and never branch on the kind, so a new media tokenizer (video) is one
more entry here, not a new copy of every job.

    train(train_items, heldout_items, cfg, store, run_dir, resume=, progress=) -> TrainedBundle
    evaluate(bundle_path, items, names, out_dir, **options) -> dict (bundle_id + metrics)

Items are decoded arrays: (H, W, 3) uint8 RGB images or 16 kHz mono float32 audio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenloom.tokenizers.bundle import BundleInfo


@dataclass
class TrainedBundle:
    """What one tokenizer training made: its bundle and a JSON-ready summary."""

    bundle: BundleInfo
    summary: dict  # steps, seconds, throughput, held-out metrics, run_dir, parameters, kind-specific facts


@dataclass(frozen=True)
class NeuralTokenizer:
    kind: str  # bundle kind
    media: str  # the modality of its inputs (datasets.media.READERS key)
    section: str  # its config section in the run config
    train: Callable[..., TrainedBundle]
    evaluate: Callable[..., dict]
    options: tuple[str, ...] = ()  # evaluation options it accepts


def _train_visual(train_items: list[np.ndarray], heldout_items: list[np.ndarray], cfg, store: Path, run_dir: Path,
                  resume: bool = False, progress: bool = True) -> TrainedBundle:
    from tokenloom.tokenizers.visual import matched_baseline, train_visual

    cfg.validate()
    extra = matched_baseline(cfg)[1] if cfg.arch == "cnn" else 0  # the same-size single-path ablation
    r = train_visual(train_items, heldout_items, cfg, store, run_dir, extra_cnn_blocks=extra, resume=resume,
                     progress=progress)
    return TrainedBundle(r.bundle, {"num_codes": r.bundle.config["num_codes"], "parameters": r.parameters,
                                    "steps": r.steps, "seconds": round(r.seconds, 1),
                                    "images_per_second": round(r.images_per_second, 2), "heldout": r.heldout,
                                    "run_dir": r.run_dir})


def _evaluate_visual(bundle_path: Path, items: list[np.ndarray], names: list[str], out_dir: Path) -> dict:
    from tokenloom.tokenizers.visual import evaluate, load_visual, prepare

    model = load_visual(bundle_path)
    result = evaluate(model, [prepare(p, model.cfg) for p in items], names=names, grid_path=Path(out_dir) / "grid.png")
    return {"bundle_id": model.bundle_id, **result.to_dict()}


def _train_audio(train_items: list[np.ndarray], heldout_items: list[np.ndarray], cfg, store: Path, run_dir: Path,
                 resume: bool = False, progress: bool = True) -> TrainedBundle:
    from tokenloom.tokenizers.audio import train_audio

    cfg.validate()
    r = train_audio(train_items, heldout_items, cfg, store, run_dir, resume=resume, progress=progress)
    c = r.bundle.config
    return TrainedBundle(r.bundle, {"levels": c["levels"], "codebook_size": c["codebook_size"],
                                    "frame_rate": c["frame_rate"], "parameters": r.parameters, "steps": r.steps,
                                    "seconds": round(r.seconds, 1),
                                    "audio_seconds_per_second": round(r.seconds_of_audio_per_second, 2),
                                    "heldout": r.heldout, "run_dir": r.run_dir})


def _evaluate_audio(bundle_path: Path, items: list[np.ndarray], names: list[str], out_dir: Path,
                    levels: int | None = None) -> dict:
    import torch

    from tokenloom.tokenizers.audio import evaluate, load_audio

    model = load_audio(bundle_path)
    if levels is not None and not 1 <= levels <= model.levels:
        raise ValueError(f"--levels must be 1..{model.levels} for this bundle, got {levels}")
    result = evaluate(model, [torch.from_numpy(a)[None] for a in items], out_dir, names=names, levels=levels)
    shown = levels or model.levels
    return {"bundle_id": model.bundle_id, **result.to_dict(), "levels": shown,
            "si_sdr": result.by_levels[shown]["si_sdr"], "mel": result.by_levels[shown]["mel"],
            "bitrate": model.cfg.bitrate(shown)}


NEURAL_TOKENIZERS: dict[str, NeuralTokenizer] = {
    "visual": NeuralTokenizer("visual", "image", "visual_tokenizer", _train_visual, _evaluate_visual),
    "audio": NeuralTokenizer("audio", "audio", "audio_tokenizer", _train_audio, _evaluate_audio, ("levels",)),
}


def neural_tokenizer(kind: str) -> NeuralTokenizer:
    if kind not in NEURAL_TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; known: {', '.join(NEURAL_TOKENIZERS)}")
    return NEURAL_TOKENIZERS[kind]
