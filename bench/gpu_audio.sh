#!/usr/bin/env bash
# The RVQ audio tokenizer on a GPU machine, in under 10 minutes: tests/test_audio.py, then encode
# throughput (seconds of audio per second, bf16 and fp32, batch of 16 x 10 s) and three 4-minute
# training recipes side by side (bench_audio.py: held-out SI-SDR per level on speech and music).
# Output goes to $OUT (default bench/out/gpu).
#
#   bash bench/gpu_audio.sh            # PYTHON=/path/to/python to choose the interpreter
source "$(dirname "$0")/gpu_common.sh"
timeout 120 "$PY" -m pytest tests/test_audio.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT_DIR/audio-tests.txt" \
  || status=1
timeout 240 "$PY" - "$OUT_DIR" <<'PY' 2>&1 | tee "$OUT_DIR/audio-bench.txt" || status=1
import json, sys, time
from pathlib import Path
import torch
from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig

out = Path(sys.argv[1])
model = AudioTokenizer(AudioTokenizerConfig()).cuda()
model.init_codebook(torch.randn(8, 1, 16000, device="cuda") * 0.1)
model.eval()
x = torch.randn(16, 1, 160000, device="cuda") * 0.1
rows = []
for dtype in (torch.bfloat16, torch.float32):
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        model.encode(x); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(5):
            model.encode(x)
        torch.cuda.synchronize()
    rate = 16 * 10 * 5 / (time.perf_counter() - t)
    rows.append({"dtype": str(dtype), "audio_seconds_per_second": rate})
    print(f"encode {dtype}: {rate:,.0f} s of audio per second", flush=True)
(out / "audio.json").write_text(json.dumps({"encode": rows}, indent=2, default=str))
PY
# the recipes of bench/RESULTS.md (#18) at a GPU's batch, side by side on the one GPU: the plain
# recipe, the balanced one, the balanced one with the STFT discriminator (full width, all three
# scales, whole segments: the GPU affords what the CPU run narrowed) and the frequency-domain codec
# (arch=stft with the compressed spectral loss), held out on speech in an unseen voice and on unseen music
timeout 540 "$PY" bench/bench_audio.py --minutes 4 --parallel 4 --threads 4 --out "$OUT_DIR/audio-recipes" \
  --variants "base:batch_size=64:bf16_autocast=true,bal:batch_size=64:bf16_autocast=true:balancer=true:l1_weight=0.005:sisdr_weight=1,gan:batch_size=64:bf16_autocast=true:balancer=true:l1_weight=0.005:sisdr_weight=1:adversarial_weight=1:feature_weight=1:disc_channels=32:disc_seconds=1.0,stft:batch_size=64:bf16_autocast=true:arch=stft:spec_weight=1" \
  2>&1 | grep -v WARNING | tee "$OUT_DIR/audio-recipes.txt" || status=1
exit $status
