#!/usr/bin/env bash
# FlashMask on a GPU machine, in one go and in under 8 minutes:
#   1. correctness: the Triton kernel compiled on the GPU (bf16/fp16, head dims 64 and 128, plus fp32)
#      against the dense reference, then the rest of tests/kernels;
#   2. speed: effective TFLOP/s of the Triton kernel (forward, forward+backward) against FlexAttention
#      (compiled) and flash-attn (where it can express the mask) or SDPA with a dense mask, at 8K and
#      32K, for causal document, sliding window 512 and the multimodal document.
# Everything it prints is also written under $OUT (default bench/out/gpu). Each stage has its own
# time limit, so a hang in one still leaves the others' output. Exit status: non-zero if a stage failed.
#
#   bash bench/gpu_flashmask.sh            # PYTHON=/path/to/python to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/out/gpu}"
mkdir -p "$OUT_DIR"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
start=$(date +%s)

{
  echo "== environment ($(date -u))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null \
    || echo "flash-attn not installed: SDPA with a dense mask is the non-Flex peer"
  "$PY" -c "import hypothesis" 2>/dev/null || echo "hypothesis not installed: property tests will error at collection"
} 2>&1 | tee "$OUT_DIR/env.txt"

# -o addopts= drops the repo's --timeout flag, in case pytest-timeout is absent here.
echo "== GPU kernel tests" | tee "$OUT_DIR/tests_gpu.txt"
timeout 120 "$PY" -m pytest tests/kernels/test_flashmask_triton.py -q -o addopts= -p no:cacheprovider -rs 2>&1 \
  | tee -a "$OUT_DIR/tests_gpu.txt"
gpu_tests=${PIPESTATUS[0]}

echo "== other kernel tests (CPU path, builders, tiles)" | tee "$OUT_DIR/tests_cpu.txt"
timeout 90 "$PY" -m pytest tests/kernels -q -o addopts= -p no:cacheprovider \
  --ignore=tests/kernels/test_flashmask_triton.py 2>&1 | tee -a "$OUT_DIR/tests_cpu.txt"
cpu_tests=${PIPESTATUS[0]}

echo "== benchmark" | tee "$OUT_DIR/bench.txt"
timeout 230 "$PY" bench/bench_flashmask.py --device cuda --json "$OUT_DIR/flashmask_gpu.json" 2>&1 \
  | tee -a "$OUT_DIR/bench.txt"
bench=${PIPESTATUS[0]}

echo "gpu_tests=$gpu_tests cpu_tests=$cpu_tests bench=$bench seconds=$(( $(date +%s) - start ))" \
  | tee "$OUT_DIR/summary.txt"
[ "$gpu_tests" -eq 0 ] && [ "$cpu_tests" -eq 0 ] && [ "$bench" -eq 0 ]
