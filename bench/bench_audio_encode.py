"""Audio tokenizer encoding speed: windowed encoding against one pass, one thread (#18).

The RVQ encoder's first stage runs 16 channels at the full 16 kHz rate: over a long clip in one
pass each activation is tens of MB, and the element-wise ops (ELU, residual adds, bias) run at
memory speed. `audio_tokenizer.encode_window_seconds` encodes window by window with the
receptive field (`context_frames`) on each side, so each activation stays in cache and the
latents equal the one-pass ones to float rounding. Peer in the same script: the same model with
`encode_window_seconds = 0` (one pass, the encoder as it was). Also timed: `encode_long` over
30 s blocks, the path ingestion takes (`chunk_seconds`).

    .venv/bin/python bench/bench_audio_encode.py [--bundle PATH] [--channels 16] [--repeats 5]

Without `--bundle` the model is untrained (the same cost) with its codebooks initialized by
k-means on the held-out speech. Prints x real time per window size, the ratio to one pass, the
largest latent difference and the share of frames whose codes equal the one-pass codes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import best_of, cpu_name  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=None, help="a trained audio tokenizer bundle (default: untrained)")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--windows", default="1,2,4,8,16", help="window lengths in seconds")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from tokenloom.samples.audio import speech_clips
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, encode_long, load_audio

    torch.set_num_threads(1)
    torch.manual_seed(0)
    speech = torch.from_numpy(np.concatenate([w for w, _ in speech_clips("heldout")]).astype(np.float32))[None, None]
    seconds = speech.shape[-1] / 16_000
    if args.bundle:
        model = load_audio(args.bundle).eval()
    else:
        model = AudioTokenizer(AudioTokenizerConfig(channels=args.channels))
        model.init_codebook(speech[..., : 16_000 * 40].reshape(4, 1, -1))
        model.eval()
    base_cfg = model.cfg

    def with_window(w: float) -> None:
        model.cfg = replace(base_cfg, encode_window_seconds=w)

    with torch.inference_mode():
        with_window(0.0)
        model.encode(speech[..., :16_000])
        ref_latents, ref_codes = model.latents(speech), model.encode(speech)
        one_pass = best_of(lambda: model.encode(speech), args.repeats)
        rows = [("one pass (peer)", seconds / one_pass, 1.0, 0.0, 1.0)]
        for w in (float(x) for x in args.windows.split(",")):
            with_window(w)
            t = best_of(lambda: model.encode(speech), args.repeats)
            diff = float((model.latents(speech) - ref_latents).abs().max())
            same = float((model.encode(speech) == ref_codes).all(-1).float().mean())
            rows.append((f"windows of {w:g} s", seconds / t, one_pass / t, diff, same))
        with_window(base_cfg.encode_window_seconds)
        samples = speech[0, 0].numpy()
        block = int(base_cfg.chunk_seconds * 16_000)

        def long():
            return encode_long(model, (samples[i:i + block] for i in range(0, len(samples), block)))

        t = best_of(long, args.repeats)
        same = float((long() == ref_codes[0].numpy()).all(-1).mean())
        rows.append((f"encode_long, {base_cfg.chunk_seconds:g} s blocks, {base_cfg.encode_window_seconds:g} s windows",
                     seconds / t, one_pass / t, float("nan"), same))

    print(f"\nCPU: {cpu_name()}; torch {torch.__version__}; 1 thread; {seconds:.0f} s of held-out speech; "
          f"channels {base_cfg.channels}, {base_cfg.levels} levels; context {model.context_frames} frames per side; "
          f"{'bundle ' + args.bundle if args.bundle else 'untrained weights'}\n")
    print("| encoding | x real time | vs one pass | max latent difference | frames with equal codes |")
    print("|---|---|---|---|---|")
    for name, speed, ratio, diff, same in rows:
        diff_s = "-" if np.isnan(diff) else f"{diff:.1e}"
        print(f"| {name} | {speed:.1f} | {ratio:.2f}x | {diff_s} | {same:.2%} |")


if __name__ == "__main__":
    main()
