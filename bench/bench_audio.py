"""RVQ audio tokenizer benchmark: train for a budget, then held-out quality per level count
and encoding speed.

Training: eSpeak NG speech (240 sentences, 6 voices, varied rate and pitch; `speech_clips`)
plus tones, chords and noise, 16 kHz, random 1 s segments. Held out: 16 sentences never
trained on, spoken by a voice never trained on. Reported: SI-SDR and multi-scale mel distance
decoding from the first k = 1, 2, 4, 8 levels, bitrate, codebook usage per level; encoding
speed as a multiple of real time with one thread, beside the cost of torchaudio computing a
log-mel spectrogram of the same audio (a front-end every speech model pays; the ratio says how
many such passes the encoder costs).

    .venv/bin/python bench/bench_audio.py --minutes 15
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "audio"))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--set", action="append", default=[], help="audio_tokenizer key=value (repeatable)")
    args = p.parse_args()

    import torch
    import torchaudio

    from tokenloom.jobs.config import apply_overrides
    from tokenloom.samples.audio import sound_clips, speech_clips
    from tokenloom.tokenizers.audio import AudioTokenizerConfig, evaluate, load_audio, train_audio
    from tokenloom.tokenizers.audio.train import heldout_clips

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    train = [w for w, _ in speech_clips("train")] + sound_clips()
    held = [w for w, _ in speech_clips("heldout")]
    print(f"synthesized {sum(len(w) for w in train) / 16000:.0f} s of training audio and "
          f"{sum(len(w) for w in held) / 16000:.0f} s held out in {time.perf_counter() - t:.0f} s", flush=True)
    cfg = AudioTokenizerConfig(max_minutes=args.minutes, threads=args.threads,
                               eval_every_s=max(60.0, args.minutes * 60 / 5))
    try:
        apply_overrides(cfg, args.set, "audio_tokenizer.")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    result = train_audio(train, held, cfg, out / "bundles", out / "run", resume=args.resume, progress=True)

    torch.set_num_threads(1)
    model = load_audio(result.bundle.path)
    clips = heldout_clips(held, 30.0)
    ev = evaluate(model, clips, out / "eval")
    seconds = sum(c.shape[-1] for c in clips) / 16000
    x = torch.cat([c for c in clips], dim=-1)[None]
    model.encode(x[..., :16000])
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        model.encode(x)
        best = min(best, time.perf_counter() - t)
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)
    best_mel = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        torch.log(mel(x[0, 0]) + 1e-5)
        best_mel = min(best_mel, time.perf_counter() - t)
    rows = {"variant": "rvq-8x1024-50fps", "steps": result.steps, "train_seconds": result.seconds,
            "parameters": result.parameters, "heldout_seconds": seconds, "by_levels": ev.by_levels,
            "usage": ev.usage, "encode_x_realtime_1_thread": seconds / best,
            "logmel_x_realtime_1_thread": seconds / best_mel}
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{result.steps} steps in {result.seconds:.0f} s ({result.parameters:,} parameters); held-out: "
          f"{len(clips)} clips, {seconds:.0f} s of an unseen voice and unseen sentences\n")
    print("| levels k | bitrate kbit/s | SI-SDR dB | mel distance |")
    print("|---|---|---|---|")
    for k, v in ev.by_levels.items():
        print(f"| {k} | {v['bitrate'] / 1000:.1f} | {v['si_sdr']:.2f} | {v['mel']:.3f} |")
    print(f"\ncodebook usage per level: {', '.join(f'{u:.0%}' for u in ev.usage)}")
    print(f"encoding, 1 thread: {rows['encode_x_realtime_1_thread']:.0f}x real time "
          f"(log-mel spectrogram: {rows['logmel_x_realtime_1_thread']:.0f}x; the encoder costs "
          f"{rows['logmel_x_realtime_1_thread'] / rows['encode_x_realtime_1_thread']:.1f} log-mel passes)")
    print(f"spectrograms and WAVs: {out / 'eval'}")


if __name__ == "__main__":
    main()
