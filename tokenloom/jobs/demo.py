"""The demo: sample data -> tokenizers -> ingestion -> catalog -> training -> generation, on one recipe.

Everything comes from `samples/` (offline: stdlib docstrings, scikit-image's photos, eSpeak NG
speech, synthetic video clips, with odd and broken files of each modality) and the recipe (`configs/demo.toml`, or
`configs/tiny.toml` for the tests). The media tokenizers are reused from the home when one was
trained with the same recipe, else trained briefly; an interrupted demo continues its tokenizer
training from the run folder of that recipe.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from tokenloom.jobs import catalog as catalog_jobs
from tokenloom.jobs import tokenizer as tokenizer_jobs
from tokenloom.jobs.config import RunConfig
from tokenloom.jobs.home import Home
from tokenloom.jobs.ingest import ingest
from tokenloom.jobs.report import report
from tokenloom.jobs.train import train
from tokenloom.tokenizers import bundle as bundles
from tokenloom.tokenizers.registry import neural_tokenizer


def write_data(home: Home, cfg: RunConfig) -> dict[str, str]:
    """The demo's sample corpus under `home/corpus`: text, images, audio and video (idempotent)."""
    from tokenloom.samples.audio import write_sample_audio
    from tokenloom.samples.images import write_sample_images
    from tokenloom.samples.text import write_sample_corpus
    from tokenloom.samples.video import write_sample_videos

    d = cfg.demo
    corpus = write_sample_corpus(home.corpus, max_bytes=d.corpus_bytes)
    images = write_sample_images(corpus / "images", variants=d.image_variants)
    audio = write_sample_audio(corpus / "audio", utterances=d.utterances)
    videos = write_sample_videos(corpus / "videos", clips=d.videos)
    return {"corpus": str(corpus), "images": str(images), "audio": str(audio), "videos": str(videos)}


def _sample_media(kind: str, cfg: RunConfig) -> tuple[list, list]:
    """(training, held-out) arrays the demo trains a media tokenizer of `kind` on."""
    if kind == "visual":
        from tokenloom.samples.images import sample_photos

        return list(sample_photos("train").values()), list(sample_photos("heldout").values())
    from tokenloom.samples.audio import sound_clips, speech_clips

    train_clips = [wav for wav, _ in speech_clips("train", cfg.demo.speech_train_clips)] + sound_clips()
    return train_clips, [wav for wav, _ in speech_clips("heldout", cfg.demo.speech_heldout_clips)]


def media_bundle(home: Home, kind: str, cfg: RunConfig, progress: bool) -> dict:
    """The newest bundle of `kind` trained with this recipe, or a brief new training on sample data."""
    recipe = json.loads(json.dumps(asdict(getattr(cfg, neural_tokenizer(kind).section))))
    found = bundles.by_recipe(home.bundles, kind, recipe)
    if found is not None:
        return {"bundle_id": found.id, "reused": True, "heldout": found.config.get("heldout", {})}
    # one run folder per recipe: an interrupted demo continues its tokenizer training
    run_name = f"demo-{kind}-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    resume = (home.runs / run_name / "checkpoint.pt").is_file()
    trained, _ = tokenizer_jobs.train(home, kind, [], cfg, run_name=run_name, resume=resume, progress=progress,
                                      arrays=_sample_media(kind, cfg))
    return {"bundle_id": trained.bundle.id, "reused": False, "heldout": trained.summary["heldout"]}


def demo(home: Home, cfg: RunConfig, progress: bool = True) -> dict:
    from tokenloom.platform.ingest import shutdown_ray

    cfg.ingest.ray.progress_bars = progress
    t0 = time.perf_counter()
    data = write_data(home, cfg)
    text_bundle = tokenizer_jobs.train_text(home, [data["corpus"]], cfg)
    media = {kind: media_bundle(home, kind, cfg, progress) for kind in ("visual", "audio")}
    result = ingest(home, [data["corpus"]], cfg.demo.dataset, cfg,
                    {"text": text_bundle.id, **{kind: m["bundle_id"] for kind, m in media.items()}})
    shutdown_ray()
    snapshot_id, trained = train(home, result.dataset, cfg, progress=progress, run_name="demo")
    generations = demo_generations(home, trained.run_dir)
    page = report(home, cfg, result.dataset, home.root / "report", runs=[trained.run_dir])
    m = cfg.model
    return {
        "dataset": result.dataset, "snapshot_id": snapshot_id, "job_id": result.job_id,
        "already_committed": result.already_committed, "samples": result.samples, "tokens": result.tokens,
        "quarantined": result.quarantined, "quarantine_reasons": result.quarantine_reasons,
        "filtered": result.filtered, "filter_counts": result.filter_counts,
        "duplicates": result.duplicates, "duplicate_counts": result.duplicate_counts,
        "text_tokenizer": text_bundle.id,
        **{f"{kind}_{key}": value for kind, doc in media.items()
           for key, value in (("tokenizer", doc["bundle_id"]), ("reused", doc["reused"]), ("heldout", doc["heldout"]))},
        "modalities": catalog_jobs.stats(home, cfg, result.dataset)["stats"]["modalities"],
        "steps": trained.steps, "loss_first": trained.first_loss, "loss_last": trained.last_loss,
        "train_tokens_per_second": trained.tokens_per_second, "parameters": trained.parameters,
        "active_parameters": trained.active_parameters,
        "model": f"{m.n_layers} layers x dim {m.dim}, {m.moe.n_experts} experts top-{m.moe.top_k} + "
                 f"{m.moe.n_shared_experts} shared",
        "modality_loss": trained.modality_loss, "val_loss": trained.val_loss, "routing": trained.routing, "model_dir": trained.model_dir,
        "home": str(home.root), "run_dir": trained.run_dir, "checkpoint": trained.checkpoint,
        "loss_plot": trained.loss_plot, "generations": generations, "report": page["report"],
        "seconds": time.perf_counter() - t0,
    }


def demo_generations(home: Home, run_dir: str) -> dict:
    """The trained model, looked at: a caption for a held-out photo, an image from that photo's
    caption, speech from a held-out transcript, written to `<run>/generations/` (quality is poor
    at demo size; the point is that every path runs on the model's own tokenizers)."""
    from PIL import Image

    from tokenloom.jobs.generate import Generator, generate
    from tokenloom.samples.audio import speech_clips
    from tokenloom.samples.images import PHOTOS, sample_photos

    out = Path(run_dir) / "generations"
    out.mkdir(parents=True, exist_ok=True)
    name, pixels = next(iter(sample_photos("heldout").items()))
    photo = out / f"heldout-{name}.png"
    Image.fromarray(pixels).save(photo)
    caption = PHOTOS[name][1]
    transcript = speech_clips("heldout", 1)[0][1]
    gen = Generator.load(home, Path(run_dir))
    common = {"temperature": 0.8, "top_k": 50, "seed": 0, "generator": gen}
    made = {
        "caption": generate(home, Path(run_dir), "text", image=photo, max_new_tokens=40, out=out / "caption.txt",
                            **common),
        "image": generate(home, Path(run_dir), "image", prompt=caption, out=out / "from-caption.png", **common),
        "speech": generate(home, Path(run_dir), "audio", prompt=transcript, seconds=1.5, out=out / "speech.wav",
                           **common),
    }
    doc = {"photo": str(photo), "caption_prompt": caption, "transcript_prompt": transcript,
           **{k: {key: v[key] for key in ("out", "text", "positions", "seconds", "logprob_mean") if key in v}
              for k, v in made.items()}}
    (out / "generations.json").write_text(json.dumps(doc, indent=2))
    return doc
