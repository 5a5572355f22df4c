#!/usr/bin/env bash
# The unified MoE model on a GPU machine, in one go and in under 6 minutes:
#   1. correctness: tests/test_model.py and tests/test_moe.py on the GPU machine's torch, then the
#      Triton FlashMask kernel against the dense path on a real packed batch's mask;
#   2. speed: a short bf16 training run (dim 512, 8 layers, 64 experts top-4, 8 x 2048 positions)
#      with tokens/s and peak memory.
# Output goes to $OUT (default bench/out/gpu). Exit status: non-zero if a stage failed.
#
#   bash bench/gpu_model.sh            # PYTHON=/path/to/python to choose the interpreter
source "$(dirname "$0")/gpu_common.sh"
gpu_env model
timeout 150 "$PY" -m pytest tests/test_model.py tests/test_moe.py -q -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT_DIR/model-tests.txt" || status=1
timeout 240 "$PY" bench/gpu_model.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/model-bench.txt" || status=1
exit $status
