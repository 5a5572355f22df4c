#!/usr/bin/env bash
# Generation on a GPU machine, in one go and in under 4 minutes:
#   1. correctness: tests/test_generate.py (cached decoding equals a full forward, log-probabilities,
#      layouts, limits) on the GPU machine's torch;
#   2. speed: bench/bench_generate.py in bf16 on the GPU at batch 1 (with the recompute peer) and
#      batch 32 (cached only), context 512, 64 new tokens, plus an image and an audio clip.
# Output goes to $OUT (default bench/out/gpu). Exit status: non-zero if a stage failed.
#
#   bash bench/gpu_generate.sh          # PYTHON=/path/to/python to choose the interpreter
source "$(dirname "$0")/gpu_common.sh"
gpu_env generate
timeout 90 "$PY" -m pytest tests/test_generate.py -q -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT_DIR/generate-tests.txt" || status=1
for batch in 1 32; do
  extra=""
  [ "$batch" -gt 1 ] && extra="--skip-recompute"
  timeout 100 "$PY" bench/bench_generate.py --device cuda --dtype bfloat16 --batch "$batch" --context 512 --new 64 \
    --dim 512 --layers 8 $extra 2>&1 | tee "$OUT_DIR/generate-b$batch.txt" || status=1
done
exit $status
