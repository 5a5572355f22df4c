#!/usr/bin/env bash
# The RVQ audio tokenizer on a GPU machine, in under 5 minutes: tests/test_audio.py, then encode
# throughput (seconds of audio per second, bf16 and fp32, batch of 16 x 10 s) and a 2-minute
# training run with its throughput and held-out SI-SDR. Output goes to $OUT (default bench/out/gpu).
#
#   bash bench/gpu_audio.sh            # PYTHON=/path/to/python to choose the interpreter
source "$(dirname "$0")/gpu_common.sh"
timeout 120 "$PY" -m pytest tests/test_audio.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT_DIR/audio-tests.txt" \
  || status=1
timeout 240 "$PY" - "$OUT_DIR" <<'PY' 2>&1 | tee "$OUT_DIR/audio-bench.txt" || status=1
import json, sys, time
from pathlib import Path
import torch
from tokenloom.samples.audio import sound_clips, speech_clips
from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig, train_audio

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
cfg = AudioTokenizerConfig(max_minutes=2.0, batch_size=64, eval_every_s=60.0, checkpoint_every_s=1e9)
train = [w for w, _ in speech_clips("train")] + sound_clips()
held = [w for w, _ in speech_clips("heldout")]
torch.cuda.reset_peak_memory_stats()
r = train_audio(train, held, cfg, out / "audio-bundles", out / "audio-train", progress=False, device="cuda")
peak = torch.cuda.max_memory_allocated() / 2**20
print(f"training 2 min, batch 64, bf16: {r.steps} steps, {r.seconds_of_audio_per_second:.0f} s audio/s, "
      f"held-out SI-SDR {r.heldout['si_sdr']:.2f} dB, peak {peak:.0f} MB", flush=True)
(out / "audio.json").write_text(json.dumps({"encode": rows, "steps": r.steps, "heldout": r.heldout, "peak_mb": peak},
                                           indent=2, default=str))
PY
exit $status
