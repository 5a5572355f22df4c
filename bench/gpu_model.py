"""The unified MoE model on a GPU: a short bf16 training run with throughput and peak memory.

Rows are synthetic but in the real layout (text, 16 x 16 images, audio frames of 8 levels with
transcripts, packed by the real stream from shards written here), so the masks, groups and
heads are the ones training sees. Checks first that the model's FlashMask attention on the GPU
(Triton kernel in bf16) matches the dense path on the same batch, then trains.

    python bench/gpu_model.py --steps 60 --out bench/out/gpu
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def synthetic_shard(path: Path, samples: int, levels: int, seed: int = 0):
    """A shard of text, 16 x 16 images with captions and audio with transcripts, laid out by
    `tokenizers.sequence` over a manifest of 7,984 text ids, 4,096 visual codes and `levels`
    RVQ levels of 1,024: (shard file, vocabulary size, audio ranges)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenloom.catalog.schema import SEGMENT_TYPE
    from tokenloom.datasets import ShardFile
    from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart
    from tokenloom.tokenizers.vocab import VocabManifest

    rng = np.random.default_rng(seed)
    vocab = VocabManifest.build(7984, visual_size=4096, audio_levels=levels, audio_codebook=1024)
    layout = SampleLayout(vocab)
    # learnable structure: text from a bank of phrases, images and audio from banks of code patterns
    phrases = [rng.integers(0, vocab.text.size, int(rng.integers(4, 12))) for _ in range(64)]
    images = [rng.integers(0, vocab.visual.size, (16, 16)) for _ in range(32)]
    sounds = [rng.integers(0, 1024, (400, levels)) for _ in range(32)]

    def words(n):
        return TextPart(np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), n // 4 + 1)])[:n])

    rows = []
    for k in range(samples):
        kind = k % 3
        if kind == 0:
            rows.append(layout.assemble([words(int(rng.integers(98, 798)))]))
        elif kind == 1:
            rows.append(layout.assemble([ImagePart(images[int(rng.integers(len(images)))]),
                                         words(int(rng.integers(5, 40)))]))
        else:
            sound = sounds[int(rng.integers(len(sounds)))][: int(rng.integers(50, 300))]
            rows.append(layout.assemble([AudioPart(sound), words(int(rng.integers(5, 40)))]))
    pq.write_table(pa.table({"tokens": pa.array([t.tolist() for t, _ in rows], pa.list_(pa.int32())),
                             "segments": pa.array([s for _, s in rows], pa.list_(SEGMENT_TYPE))}), path)
    return ShardFile(str(path), samples), vocab.size, tuple((r.start, r.stop) for r in vocab.audio)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="bench/out/gpu")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (tiled path instead of Triton)")
    args = p.parse_args()

    import torch

    from tokenloom.datasets import StreamConfig, TokenStream
    from tokenloom.kernels import flashmask_attention
    from tokenloom.model import ModelConfig, MoEConfig, UnifiedModel
    from tokenloom.model.unified import mask_indices

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    shard, vocab, ranges = synthetic_shard(out / "model-shard.parquet", 3000, 8)
    stream = TokenStream([shard], StreamConfig(seq_len=args.seq, group_size=8, audio_window=64))
    rows = stream.batches(args.batch)
    cfg = ModelConfig(vocab_size=vocab, audio_ranges=ranges, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                      moe=MoEConfig(n_experts=args.experts, top_k=args.top_k, expert_hidden=args.dim // 2), mtp=True)
    torch.manual_seed(0)
    model = UnifiedModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=on_gpu)

    def batch():
        return {k: torch.from_numpy(v).to(device) for k, v in next(rows).items()}

    # correctness: Triton FlashMask vs the dense path on a real batch's mask
    b = batch()
    idx = mask_indices(b)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    q, k, v = (torch.randn(args.batch, args.seq, cfg.n_heads, 64, device=device, dtype=dtype) for _ in range(3))
    tri = flashmask_attention(q, k, v, idx, causal=False, backend="triton" if on_gpu else "torch").float()
    ref = flashmask_attention(q, k, v, idx, causal=False, backend="dense").float()
    err = float((tri - ref).abs().max())
    report = {"triton_vs_dense_max_abs_err": err, "config": {"dim": cfg.dim, "n_layers": cfg.n_layers,
              "n_experts": cfg.moe.n_experts, "top_k": cfg.moe.top_k, "expert_hidden": cfg.moe.expert_hidden},
              "seq": args.seq, "batch": args.batch}
    print(f"triton vs dense attention on the batch's mask: max |diff| {err:.3e}", flush=True)

    losses, tokens, t_train = [], 0, 0.0
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        b = batch()
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            loss, parts = model.loss(b, indices=mask_indices(b))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.update_router_bias(model.routing_loads())
        sync()
        if step >= 3:  # after warm-up
            t_train += time.perf_counter() - t0
            tokens += int((b["labels"] != -100).sum())
        losses.append(float(loss))
        if step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.3f} " + " ".join(
                f"{k} {float(v):.3f}" for k, v in parts.items() if k.startswith("loss_")), flush=True)
    report.update({"losses": losses, "tokens_per_second": tokens / max(t_train, 1e-9),
                   "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "loss_decreased": bool(np.mean(losses[-5:]) < losses[0])})
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=2))
    (out / "model-report.json").write_text(json.dumps(report, indent=2))
    if err > 5e-2 or not report["loss_decreased"]:
        raise SystemExit("check failed")


if __name__ == "__main__":
    main()
