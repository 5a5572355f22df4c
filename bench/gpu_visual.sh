#!/usr/bin/env bash
# The visual tokenizer on a GPU machine, in one go and in under 6 minutes:
#   1. correctness: tests/test_visual.py (CPU reference behaviour on the GPU machine's torch);
#   2. speed: encode images/s for the dual-path tokenizer and the CNN baseline at 128 and 256 px,
#      bf16 and fp32, with peak memory; then a 2-minute training run (batch 64, bf16 autocast)
#      with its throughput and held-out PSNR/usage.
# Output goes to $OUT (default bench/out/gpu). Exit status: non-zero if a stage failed.
#
#   bash bench/gpu_visual.sh            # PYTHON=/path/to/python to choose the interpreter
source "$(dirname "$0")/gpu_common.sh"
gpu_env visual
timeout 120 "$PY" -m pytest tests/test_visual.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT_DIR/visual-tests.txt" \
  || status=1
timeout 300 "$PY" bench/gpu_visual.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/visual-bench.txt" || status=1
exit $status
