"""FlashMask CPU path against its peers on this machine, in one run: time and peak memory, as ratios.

Peers, all given the same mask: SDPA with a dense boolean mask (forward and forward+backward),
FlexAttention eager and compiled (forward only: FlexAttention has no CPU backward). Masks: causal
document (8 documents), causal sliding window 512, and TokenLoom's multimodal document (2048-token
documents of text / image / text / image / text / audio with a 128 window).

How it measures, and why:
- Time: best of --repeats calls after one warm-up (the least disturbed by other jobs on a shared machine), mask already built (a model builds its mask
  once per step and reuses it across layers). FlashMask rebuilds its tile plan inside every call,
  so that cost is in its time.
- Peak memory: extra resident memory (VmHWM after a reset via /proc/self/clear_refs, minus VmRSS
  before) over building the method's mask form from the indices and one call. For these runs
  glibc is told (mallopt) to mmap every buffer of 64 KiB or more and the heap is trimmed first, so
  freed buffers leave the resident set and peaks do not hide in malloc's free lists. Timing runs
  with a 32 MiB threshold instead (glibc's steady state), because an mmap per tensor would tax
  the path with many small temporaries (FlashMask) far more than one big kernel (SDPA).
- Threads: default 1. On a 2-core machine shared with other jobs, a second OpenMP thread that
  loses its core makes every op wait at a barrier (an elementwise add went from 0.1 ms to 8 ms),
  which measures the neighbours rather than the kernels.
- FlexAttention gets its BlockMask from the same tile classification FlashMask uses (partial and
  full blocks, 128 x 128), so both skip the same tiles; create_block_mask would only add a slow
  S x S mask_mod evaluation on CPU.

Run:  .venv/bin/python bench/bench_flashmask.py [--seqs 2048 4096 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloom.kernels import (
    Segment,
    build_multimodal_mask,
    canonical_indices,
    causal_document_mask,
    classify_tiles,
    column_tile_bounds,
    dense_allowed_mask,
    flashmask_attention,
    sliding_window_mask,
    tile_fractions,
)
from tokenloom.kernels.tiles import FULL, PARTIAL

MASKS = ("causal_document", "sliding_window", "multimodal")
FLEX_BLOCK = 128


def multimodal_row(seq: int) -> list[Segment]:
    """2048-token documents: text 256, image 576 (24 x 24), text 320, image 256, text 128, audio 512."""
    layout = [("text", 256, None), ("image", 576, None), ("text", 320, None), ("image", 256, None),
              ("text", 128, None), ("audio", 512, 128)]
    segments, pos = [], 0
    for doc in range(seq // 2048):
        for modality, length, window in layout:
            segments.append(Segment(modality, pos, length, window=window, document=doc))
            pos += length
    return segments


def make_mask(name: str, seq: int) -> tuple[torch.Tensor, bool]:
    if name == "causal_document":
        return causal_document_mask([seq // 8] * 8), True
    if name == "sliding_window":
        return sliding_window_mask(seq, 512), True
    return build_multimodal_mask([multimodal_row(seq)], seq_len=seq), False


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


_LIBC = ctypes.CDLL("libc.so.6")
_M_MMAP_THRESHOLD = -3


def malloc_threshold(nbytes: int) -> None:
    """Buffers of at least nbytes are mmapped (and unmapped when freed); also disables glibc's auto-tuning."""
    if _LIBC.mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Extra resident memory at the peak of fn(), measured by the kernel's high-water mark."""
    malloc_threshold(64 * 1024)
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    result = fn()
    peak = _status("VmHWM")
    del result
    malloc_threshold(32 * 2**20)
    return max(peak - before, 0)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# The mask_mod reads the current mask's columns from here rather than from a closure, so that
# torch.compile sees one function for every mask and recompiles only when the length changes.
_FLEX_COLUMNS: dict[str, torch.Tensor] = {}


def _flex_mask_mod(b, h, q_idx, kv_idx):
    cols = _FLEX_COLUMNS
    lower = (q_idx >= cols["lts"][kv_idx]) & (q_idx < cols["lte"][kv_idx])
    upper = (q_idx >= cols["uts"][kv_idx]) & (q_idx < cols["ute"][kv_idx])
    return ~(lower | upper)


def flex_block_mask(canonical: torch.Tensor, seq: int):
    """A FlexAttention BlockMask whose partial and full blocks are FlashMask's tile classes (batch 1, shared heads)."""
    from torch.nn.attention.flex_attention import BlockMask

    classes = classify_tiles(column_tile_bounds(canonical, seq_q=seq, block_k=FLEX_BLOCK), seq_q=seq, block_q=FLEX_BLOCK)

    def blocks(value):
        hit = classes == value
        counts = hit.sum(-1).to(torch.int32)
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, order

    for name, column in zip(("lts", "lte", "uts", "ute"), canonical[0, 0].unbind(-1), strict=True):
        _FLEX_COLUMNS[name] = column.contiguous()
    partial_n, partial_i = blocks(PARTIAL)
    full_n, full_i = blocks(FULL)
    return BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=_flex_mask_mod, seq_lengths=(seq, seq))


def bench_case(name: str, seq: int, args, flex_compiled) -> dict:
    idx, causal = make_mask(name, seq)
    canonical = canonical_indices(idx, causal=causal, seq_q=seq)
    classes = classify_tiles(column_tile_bounds(canonical, seq_q=seq, block_k=128), seq_q=seq, block_q=128)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=gen)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    qf, kf, vf = (x.detach() for x in (qh, kh, vh))  # FlexAttention refuses inputs that need grad on CPU
    row = {"mask": name, "seq": seq, **{f"tiles_{key}": val for key, val in tile_fractions(classes).items()}}
    row["mask_bytes_dense"] = seq * seq
    row["mask_bytes_flashmask"] = idx.numel() * idx.element_size()

    def backward(out):
        out.backward(grad if out.shape == grad.shape else grad.transpose(1, 2))
        for x in (q, k, v):
            x.grad = None
        return out

    dense = dense_allowed_mask(idx, causal=causal, seq_q=seq)
    methods = {
        "flashmask": (lambda: None, lambda _: flashmask_attention(q, k, v, idx, causal=causal), True),
        "sdpa_dense": (lambda: dense_allowed_mask(idx, causal=causal, seq_q=seq),
                       lambda m: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m), True),
    }
    from torch.nn.attention.flex_attention import flex_attention

    if seq <= args.flex_eager_max:
        methods["flex_eager"] = (lambda: flex_block_mask(canonical, seq), lambda bm: flex_attention(qf, kf, vf, block_mask=bm), False)
    if flex_compiled is not None:
        methods["flex_compiled"] = (lambda: flex_block_mask(canonical, seq), lambda bm: flex_compiled(qf, kf, vf, block_mask=bm), False)

    with torch.no_grad():
        reference = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense).transpose(1, 2)
        row["max_abs_diff_vs_sdpa"] = float((flashmask_attention(q, k, v, idx, causal=causal) - reference).abs().max())
    del dense, reference
    for method, (prepare, run, has_backward) in methods.items():
        prepared = prepare()
        with torch.no_grad():
            row[f"{method}_fwd_s"] = best_seconds(lambda run=run, p=prepared: run(p), args.repeats)
        del prepared
        with torch.no_grad():
            row[f"{method}_fwd_peak"] = peak_extra_bytes(lambda prepare=prepare, run=run: run(prepare()))
        if has_backward and not args.forward_only:
            prepared = prepare()
            row[f"{method}_fwdbwd_s"] = best_seconds(lambda run=run, p=prepared: backward(run(p)), args.repeats)
            del prepared
            row[f"{method}_fwdbwd_peak"] = peak_extra_bytes(lambda prepare=prepare, run=run: backward(run(prepare())))
        print(f"    {method}: fwd {row[f'{method}_fwd_s'] * 1e3:.0f} ms", flush=True)
    return row


def useful_flops(canonical: torch.Tensor, seq_q: int, query_heads: int) -> float:
    """Forward FLOPs over allowed (query, key) pairs only (4 * D per pair, times D outside), the usual
    'effective' count for sparse attention; the backward is counted as 2.5 times the forward."""
    lts, lte, uts, ute = canonical.long().unbind(-1)
    overlap = (torch.minimum(lte, ute) - torch.maximum(lts, uts)).clamp(min=0)
    masked = (lte - lts).clamp(min=0) + (ute - uts).clamp(min=0) - overlap
    allowed = float((seq_q - masked).sum()) * query_heads / canonical.shape[1]
    return 4.0 * allowed


def bench_gpu_case(name: str, seq: int, args, flex_compiled) -> dict:
    from triton.testing import do_bench

    device = args.device  # "cuda"; another device only for a dry run of this code
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    idx, causal = make_mask(name, seq)
    idx = idx.to(device)
    canonical = canonical_indices(idx, causal=causal, seq_q=seq)
    shape = (args.batch, seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    flops = useful_flops(canonical, seq, args.heads) * args.head_dim * args.batch
    classes = classify_tiles(column_tile_bounds(canonical, seq_q=seq, block_k=128), seq_q=seq, block_q=128)
    row = {"mask": name, "seq": seq, "tflop_fwd": flops / 1e12,
           **{f"tiles_{key}": val for key, val in tile_fractions(classes.cpu()).items()}}

    methods = {"flashmask_triton": lambda: flashmask_attention(q, k, v, idx, causal=causal)}
    if flex_compiled is not None:
        block_mask = flex_block_mask(canonical, seq)
        methods["flex_compiled"] = lambda: flex_compiled(qh, kh, vh, block_mask=block_mask).transpose(1, 2)
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        flash_attn_func = flash_attn_varlen_func = None
    if flash_attn_func is not None and name == "sliding_window":
        methods["flash_attn"] = lambda: flash_attn_func(q, k, v, causal=True, window_size=(511, 0))
    if flash_attn_varlen_func is not None and name == "causal_document" and args.batch == 1:
        doc = seq // 8
        cu = torch.arange(0, seq + 1, doc, device=device, dtype=torch.int32)
        methods["flash_attn"] = lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, doc, doc, causal=True)[None]
    dense = dense_allowed_mask(idx, causal=causal, seq_q=seq)
    methods["sdpa_dense"] = lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=dense).transpose(1, 2)

    with torch.no_grad():
        reference = methods["flex_compiled" if flex_compiled is not None else "sdpa_dense"]()
        row["max_abs_diff_vs_peer"] = float((methods["flashmask_triton"]() - reference).abs().max())
    del reference
    for method, fwd in methods.items():
        try:
            with torch.no_grad():
                ms_fwd = do_bench(fwd, warmup=10, rep=50)
            ms_all = do_bench(lambda fwd=fwd: fwd().backward(grad), warmup=10, rep=50, grad_to_none=[q, k, v])
            for x in (q, k, v):
                x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd().backward(grad)
            torch.cuda.synchronize()
            row[f"{method}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as exc:  # a peer that cannot run a case is reported, not fatal
            row[f"{method}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"    {method}: failed: {row[f'{method}_error']}", flush=True)
            continue
        row[f"{method}_fwd_ms"], row[f"{method}_fwdbwd_ms"] = ms_fwd, ms_all
        row[f"{method}_fwd_tflops"] = flops / ms_fwd / 1e9
        row[f"{method}_fwdbwd_tflops"] = 3.5 * flops / ms_all / 1e9
        print(f"    {method}: fwd {ms_fwd:.2f} ms ({row[f'{method}_fwd_tflops']:.0f} TFLOP/s), fwd+bwd {ms_all:.2f} ms "
              f"({row[f'{method}_fwdbwd_tflops']:.0f} TFLOP/s), peak {row[f'{method}_peak_mb']:.0f} MB", flush=True)
    return row


def report_gpu(rows: list[dict]) -> str:
    peers = ("flex_compiled", "flash_attn", "sdpa_dense")
    lines = [
        "Effective TFLOP/s (allowed pairs only); ratios are peer time / FlashMask-Triton time (above 1: FlashMask faster).",
        "",
        "| seq | mask | tiles skipped | FlashMask fwd TFLOP/s | fwd+bwd TFLOP/s | "
        + " | ".join(f"vs {p} fwd | vs {p} fwd+bwd" for p in peers) + " | max abs diff vs Flex (or SDPA) |",
        "|---|---|---|---|---|" + "---|---|" * len(peers) + "---|",
    ]
    for r in rows:
        cells = []
        for p in peers:
            for what in ("fwd", "fwdbwd"):
                mine, theirs = r.get(f"flashmask_triton_{what}_ms"), r.get(f"{p}_{what}_ms")
                cells.append(f"{theirs / mine:.2f}x" if mine and theirs else "n/a")
        lines.append(f"| {r['seq']} | {r['mask']} | {r['tiles_skipped']:.0%} | "
                     f"{r.get('flashmask_triton_fwd_tflops', math.nan):.0f} | {r.get('flashmask_triton_fwdbwd_tflops', math.nan):.0f} | "
                     + " | ".join(cells) + f" | {r['max_abs_diff_vs_peer']:.1e} |")
    return "\n".join(lines)


def ratio(row: dict, peer: str, what: str) -> str:
    mine, theirs = row.get(f"flashmask_{what}"), row.get(f"{peer}_{what}")
    if mine is None or theirs is None:
        return "n/a"
    if what.endswith("_peak"):
        return f"{theirs / max(mine, 1):.1f}x"
    return f"{theirs / mine:.2f}x"


def report(rows: list[dict]) -> str:
    lines = [
        "Ratios are peer / FlashMask: above 1 means FlashMask is faster or uses less memory.",
        "",
        "| seq | mask | tiles skipped | FlashMask fwd ms | fwd+bwd ms | SDPA-dense fwd | SDPA-dense fwd+bwd | "
        "Flex eager fwd | Flex compiled fwd | peak mem SDPA fwd | peak mem SDPA fwd+bwd | peak mem Flex compiled fwd | "
        "FlashMask peak fwd+bwd MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['mask']} | {r['tiles_skipped']:.0%} | {r['flashmask_fwd_s'] * 1e3:.0f} | "
            f"{r.get('flashmask_fwdbwd_s', math.nan) * 1e3:.0f} | {ratio(r, 'sdpa_dense', 'fwd_s')} | "
            f"{ratio(r, 'sdpa_dense', 'fwdbwd_s')} | {ratio(r, 'flex_eager', 'fwd_s')} | {ratio(r, 'flex_compiled', 'fwd_s')} | "
            f"{ratio(r, 'sdpa_dense', 'fwd_peak')} | {ratio(r, 'sdpa_dense', 'fwdbwd_peak')} | "
            f"{ratio(r, 'flex_compiled', 'fwd_peak')} | {r.get('flashmask_fwdbwd_peak', 0) / 2**20:.0f} |"
        )
    lines += ["", "| seq | mask | dense bool mask bytes | FlashMask index bytes | ratio | max abs diff vs SDPA |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['mask']} | {r['mask_bytes_dense']:,} | {r['mask_bytes_flashmask']:,} | "
                     f"{r['mask_bytes_dense'] / r['mask_bytes_flashmask']:.0f}x | {r['max_abs_diff_vs_sdpa']:.1e} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the tiled path vs SDPA and Flex; cuda: the Triton kernel's TFLOP/s vs its peers")
    parser.add_argument("--seqs", type=int, nargs="+", help="default 2048 4096 8192 (cpu), 8192 32768 (cuda)")
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, help="default 4 (cpu), 16 (cuda)")
    parser.add_argument("--head-dim", type=int, help="default 64 (cpu), 128 (cuda)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--flex-eager-max", type=int, default=4096, help="longest seq for eager Flex (it is O(S^2))")
    parser.add_argument("--no-flex-compile", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--json", help="also write the raw rows here")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.seqs = args.seqs or ([8192, 32768] if gpu else [2048, 4096, 8192])
    args.heads = args.heads or (16 if gpu else 4)
    args.head_dim = args.head_dim or (128 if gpu else 64)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        malloc_threshold(32 * 2**20)
        torch.set_num_threads(args.threads)
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    flex_compiled = None
    if not args.no_flex_compile:
        from torch.nn.attention.flex_attention import flex_attention

        flex_compiled = torch.compile(flex_attention, dynamic=False)
    cases = [(s, m) for s in args.seqs for m in args.masks]
    print(f"torch {torch.__version__}, threads {args.threads}, B={args.batch} H={args.heads} D={args.head_dim}, "
          f"repeats {args.repeats}", flush=True)
    rows = []
    case = bench_gpu_case if args.device == "cuda" else bench_case
    for i, (seq, name) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] seq {seq} {name}", flush=True)
        rows.append(case(name, seq, args, flex_compiled))
        if args.json:  # after every case, so a run cut short by a time limit still leaves its rows
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(report_gpu(rows) if args.device == "cuda" else report(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
