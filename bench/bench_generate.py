"""Decoding speed: KV-cache decoding vs recomputing the whole prefix for every new token.

The peer is what generation costs without a cache: one full forward (the training path, the
FlashMask intervals of the whole sequence) per generated token. Both decode the same greedy
text continuation after a prompt of `--context` positions with the same model (demo size by
default, random weights: speed does not depend on them), so the tokens must agree; the script
checks that and prints tokens/s of each and the ratio. `--batch` decodes several rows in
lockstep. Also prints one image row group and one audio frame step of the cached decoder.

    .venv/bin/python bench/bench_generate.py --context 512 --new 32
    .venv/bin/python bench/bench_generate.py --device cuda --dtype bfloat16 --batch 32   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_name  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--skip-recompute", action="store_true", help="cached decoding only (large batches on a GPU)")
    args = p.parse_args()

    import numpy as np
    import torch

    from tokenloom.contract import ATTENTION_IDS
    from tokenloom.model import ModelConfig, MoEConfig, UnifiedModel
    from tokenloom.model.generate import Chunk, Cursor, Request, SamplingConfig, TokenSpace, generate
    from tokenloom.model.unified import mask_indices

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    text, visual, audio = (16, 4016), (4016, 5040), ((5040, 5296), (5296, 5552))
    cfg = ModelConfig(vocab_size=5552, audio_ranges=audio, dim=args.dim, n_layers=args.layers, n_heads=4,
                      max_seq_len=args.context + args.new + 300, moe=MoEConfig(n_experts=16, top_k=2, expert_hidden=128))
    model = UnifiedModel(cfg).to(device=device, dtype=dtype).eval()
    specials = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<boi>": 3, "<eoi>": 4, "<boa>": 5, "<eoa>": 6, "<row>": 7}
    space = TokenSpace(text, visual, audio, specials)
    rng = np.random.default_rng(0)
    n = args.context
    ids = np.full((n, 2), -1)
    ids[:, 0] = np.r_[1, rng.integers(*text, n - 1)]
    t = np.arange(n)
    prompt = Chunk.from_columns(ids, np.zeros(n), np.stack([t, t, t], 1), np.zeros(n), np.zeros(n), np.zeros(n),
                                args.batch)
    greedy = SamplingConfig(temperature=0)
    request = Request("text", max_new_tokens=args.new, stop=())

    def cached():
        return generate(model, space, prompt, Cursor.after(prompt), request, greedy)

    @torch.no_grad()
    def recompute():
        seq = prompt.ids.to(device)
        out = []
        for _ in range(args.new):
            P = seq.shape[1]
            tt = torch.arange(P, device=device)
            batch = {"ids": seq, "coords": tt[None, :, None].expand(args.batch, P, 3),
                     "modality": torch.zeros(args.batch, P, dtype=torch.long, device=device),
                     "segment_ids": torch.zeros(args.batch, P, dtype=torch.long, device=device),
                     "doc_ids": torch.zeros(args.batch, P, dtype=torch.long, device=device),
                     "attention": torch.full((args.batch, P), ATTENTION_IDS["causal"], device=device),
                     "window": torch.zeros(args.batch, P, dtype=torch.long, device=device)}
            h, _ = model(batch, indices=mask_indices(batch))
            logits = model.head(h[:, -1]).float()
            allowed = torch.full_like(logits, float("-inf"))
            allowed[:, text[0]:text[1]] = 0
            allowed[:, specials["<eos>"]] = 0
            nxt = (logits + allowed).argmax(-1)
            out.append(nxt)
            seq = torch.cat([seq, torch.full((args.batch, 1, 2), -1, device=device)], 1)
            seq[:, -1, 0] = nxt
        return torch.stack(out, 1)

    def timed(fn):
        fn()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - t0

    made, t_cache = timed(cached)
    new = sum(len(r) for r in made.ids)
    where = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, {args.dtype}, model dim {args.dim} x {args.layers} layers, "
          f"16 experts top-2; context {args.context}, {args.new} new tokens, batch {args.batch}")
    print(f"KV cache:  {new / t_cache:8.1f} tokens/s ({t_cache:.2f} s)")
    if not args.skip_recompute:
        ref, t_full = timed(recompute)
        same = all(made.ids[b] == ref[b].tolist()[:len(made.ids[b])] for b in range(args.batch))
        print(f"recompute: {new / t_full:8.1f} tokens/s ({t_full:.2f} s); same tokens: {same}")
        print(f"ratio KV cache / recompute: {t_full / t_cache:.1f}x")
    image = Request("image", grid=(16, 16))
    _, t_img = timed(lambda: generate(model, space, prompt, Cursor.after(prompt), image, greedy))
    print(f"image 16x16 after the prompt: {t_img:.2f} s ({16 * 16 * args.batch / t_img:.0f} codes/s, one row of 16 per step)")
    speech = Request("audio", max_frames=50)
    made_a, t_aud = timed(lambda: generate(model, space, prompt, Cursor.after(prompt), speech, greedy))
    frames = sum(len(r["audio"]) for r in made_a.parts)
    print(f"audio after the prompt: {frames} frames in {t_aud:.2f} s ({frames / t_aud:.0f} frames/s, 2 levels each)")


if __name__ == "__main__":
    main()
