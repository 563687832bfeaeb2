#!/usr/bin/env bash
# bash benchmarks/device_check.sh wheels DIR      # here, with the registry: the carried wheels into DIR
# bash benchmarks/device_check.sh run DIR [--small] [ARGS...]   # there, offline: install DIR, run the check
# The first light on a lent GPU machine as it stands (Python 3.12 with jax, flax, torch, transformers and
# sentence-transformers; no registry). `wheels` downloads benchmarks/device_wheels.txt for Python 3.11 (the CPU
# rehearsal) and 3.12 (the lease, with device_wheels_py312.txt) and builds docbeam's wheel: about 7 MiB of the
# 64 MiB a call may carry. `run` installs them with pip's network off into a folder of their own (--target: the
# image's Python is never modified) and runs benchmarks/device_check.py twice, its attention part and its encoder
# part (ATTENTION_BUDGET=240 and ENCODER_BUDGET=160 seconds, each under `timeout` 30 s later: under 8 minutes in
# all), into one device_check.json in $OUT if set, else benchmarks/results/device/. --small: tiny sizes, for the
# CPU rehearsal (tests/device_check_test.py). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
MAX_BYTES=$((64 * 1024 * 1024))
usage() { echo "usage: device_check.sh wheels DIR | run DIR [--small] [ARGS...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
what=$1 dir=$2
shift 2

case "$what" in
  wheels)
    mkdir -p "$dir"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --dest "$dir" \
      -r benchmarks/device_wheels.txt
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --dest "$dir" \
      -r benchmarks/device_wheels.txt -r benchmarks/device_wheels_py312.txt
    "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dir" .
    bytes=$(du -cb "$dir"/*.whl | tail -n 1 | cut -f1)
    echo "device_check.sh: $(ls "$dir"/*.whl | wc -l) wheels, $((bytes / 1024 / 1024)) MiB in $dir"
    if ((bytes > MAX_BYTES)); then
      echo "device_check.sh: $dir holds $bytes bytes, over the $MAX_BYTES a call may carry; trim" \
           "benchmarks/device_wheels.txt" >&2
      exit 1
    fi
    ;;
  run)
    results="${OUT:-benchmarks/results/device}"
    site="$(mktemp -d)/site"
    mkdir -p "$results"
    lists=(-r benchmarks/device_wheels.txt)
    if "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      lists+=(-r benchmarks/device_wheels_py312.txt)
    fi
    # pip's network off: a wheel missing from DIR fails here, not halfway through the lease.
    PIP_NO_INDEX=1 "$PYTHON" -m pip install --quiet --no-index --find-links "$dir" --no-deps --target "$site" \
      "${lists[@]}" "$dir"/docbeam-*.whl
    rm -f "$results/device_check.json"
    status=0
    # One process per part, each with its budget and a grace period before `timeout`; from the benchmarks
    # folder, so that `import docbeam` is the installed wheel, never this checkout.
    for part in attention:"${ATTENTION_BUDGET:-240}" encoder:"${ENCODER_BUDGET:-160}"; do
      PYTHONPATH="$site" HF_HUB_OFFLINE=1 timeout $((${part#*:} + 30)) "$PYTHON" benchmarks/device_check.py \
        --part "${part%:*}" --budget-s "${part#*:}" --out "$results/device_check.json" "$@" || status=1
    done
    exit $status
    ;;
  *) usage ;;
esac
