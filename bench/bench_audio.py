"""RVQ audio tokenizer benchmark: train variants for the same budget, then held-out quality per
level count on speech and on music, and encoding speed.

Training: eSpeak NG speech (240 sentences, 6 voices, varied rate and pitch; `speech_clips`),
synthetic music (`music_clips("train")`: plucked-string and organ melodies over chords with a
snare) plus tones, chords and noise, 16 kHz, random 1 s segments. Held out: 16 sentences never
trained on, spoken by a voice never trained on, and 6 music clips from seeds never trained on
(keys, tempi, melodies). Reported per variant and per held-out set: SI-SDR and multi-scale mel
distance decoding from the first k = 1, 2, 4, 8 levels, codebook usage per level; encoding speed
as a multiple of real time with one thread (model.encode of the held-out speech in one call),
beside torchaudio's log-mel spectrogram of the same audio.

Variants run side by side (`--parallel 2`, one thread each) so they see the same machine load;
a variant is "name" or "name:key=value:key=value" (audio_tokenizer keys), e.g.

    .venv/bin/python bench/bench_audio.py --minutes 15 \\
        --variants "base,bal:balancer=true,gan:balancer=true:adversarial_weight=1:feature_weight=1"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import best_of  # noqa: E402
from side_by_side import run_variants  # noqa: E402


def variant_config(name: str, args):
    from tokenloom.jobs.config import apply_overrides
    from tokenloom.tokenizers.audio import AudioTokenizerConfig

    _, *overrides = name.split(":")
    cfg = AudioTokenizerConfig(max_minutes=args.minutes, threads=args.threads,
                               eval_every_s=max(60.0, args.minutes * 60 / 5))
    try:
        apply_overrides(cfg, overrides, "audio_tokenizer.")
    except ValueError as exc:
        raise SystemExit(f"variant {name!r}: {exc}") from None
    return cfg


def audio_sets():
    from tokenloom.samples.audio import music_clips, sound_clips, speech_clips

    train = [w for w, _ in speech_clips("train")] + music_clips("train") + sound_clips()
    held = {"speech": [w for w, _ in speech_clips("heldout")], "music": music_clips("heldout")}
    return train, held


def train_one(name: str, args) -> None:
    from tokenloom.tokenizers.audio import train_audio

    cfg = variant_config(name, args)
    train, held = audio_sets()
    out = Path(args.out)
    tag = name.split(":")[0]
    result = train_audio(train, held["speech"] + held["music"], cfg, out / "bundles", out / "runs" / tag,
                         progress=False)
    (out / f"{tag}.json").write_text(json.dumps({
        "variant": name, "bundle": str(result.bundle.path), "steps": result.steps, "seconds": result.seconds,
        "parameters": result.parameters, "run_dir": result.run_dir}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--variants", default="base")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "audio"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return train_one(args.worker, args)

    import torch
    import torchaudio

    from tokenloom.tokenizers.audio import evaluate, load_audio
    from tokenloom.tokenizers.audio.train import heldout_clips

    variants = args.variants.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k in ("minutes", "threads", "out")]
    run_variants(__file__, variants, args.parallel, forwarded, args.minutes, args.threads)

    torch.set_num_threads(1)
    _, held = audio_sets()
    clips = {k: heldout_clips(v, 30.0) for k, v in held.items()}
    speech = torch.cat(clips["speech"], dim=-1)[None]
    seconds = speech.shape[-1] / 16000
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)
    logmel = seconds / best_of(lambda: torch.log(mel(speech[0, 0]) + 1e-5))
    rows = []
    for name in variants:
        tag = name.split(":")[0]
        doc = json.loads((out / f"{tag}.json").read_text())
        model = load_audio(doc["bundle"])
        evals = {k: evaluate(model, v, out / "eval" / tag / k) for k, v in clips.items()}
        model.encode(speech[..., :16000])
        speed = seconds / best_of(lambda m=model: m.encode(speech))
        rows.append({**doc, "by_set": {k: {"by_levels": e.by_levels, "usage": e.usage} for k, e in evals.items()},
                     "encode_x_realtime_1_thread": speed, "logmel_x_realtime_1_thread": logmel})
    (out / "results.json").write_text(json.dumps(rows, indent=2, default=str))
    print(f"\nheld-out: speech {seconds:.0f} s (an unseen voice, unseen sentences), music "
          f"{sum(c.shape[-1] for c in clips['music']) / 16000:.0f} s (unseen seeds); {args.minutes} min training, "
          f"{args.threads} thread(s) each\n")
    levels = list(rows[0]["by_set"]["speech"]["by_levels"])
    print("| variant | params | steps | " + " | ".join(f"speech k={k}" for k in levels) + " | "
          + " | ".join(f"music k={k}" for k in levels) + " | mel speech / music | encode x real time |")
    print("|---" * (5 + 2 * len(levels)) + "|")
    for r in rows:
        sp, mu = r["by_set"]["speech"]["by_levels"], r["by_set"]["music"]["by_levels"]
        print(f"| {r['variant']} | {r['parameters']:,} | {r['steps']} | "
              + " | ".join(f"{sp[k]['si_sdr']:.2f}" for k in levels) + " | "
              + " | ".join(f"{mu[k]['si_sdr']:.2f}" for k in levels)
              + f" | {sp[levels[-1]]['mel']:.3f} / {mu[levels[-1]]['mel']:.3f} | {r['encode_x_realtime_1_thread']:.0f}x |")
    print("\nSI-SDR in dB decoding the first k levels; codebook usage per level (speech): "
          + "; ".join(f"{r['variant'].split(':')[0]} "
                      + ", ".join(f"{u:.0%}" for u in r["by_set"]["speech"]["usage"]) for r in rows))
    print(f"log-mel spectrogram of the same speech: {logmel:.0f}x real time, 1 thread")
    print(f"spectrograms and WAVs: {out / 'eval'}")


if __name__ == "__main__":
    main()
