# Sourced by bench/gpu_*.sh: repository root, output folder, interpreter, and an environment report.
#   OUT_DIR   where results go ($OUT, default bench/out/gpu)
#   PY        the interpreter ($PYTHON, else .venv/bin/python, else python3)
#   status    0; a script sets it to 1 when a stage fails and exits with it
#   gpu_env NAME   writes GPU, driver and torch versions to $OUT_DIR/NAME-env.txt
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-bench/out/gpu}"
mkdir -p "$OUT_DIR"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

gpu_env() {
  {
    echo "== environment ($(date -u))"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  } 2>&1 | tee "$OUT_DIR/$1-env.txt"
}
