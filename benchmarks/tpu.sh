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
NAME=tpu
JAX_EXTRA="jax[tpu]==0.10.2"
# shellcheck source=benchmarks/accelerator.sh
source "$(dirname "$0")/accelerator.sh"
install_if_asked "${1:-}"

{ nproc; "$PY" -c 'import jax; print("jax.devices():", jax.devices())'; } 2>&1 | tee "$LOG"
require_backend
HOST_CPUS=$(nproc)

step 180 benchmarks/attention.py --backends native,flash --lengths 128,512,2048,8192,16384,32768 \
  --dtypes float32,bfloat16 --repeats 5 --time-per-case 2 --timeout 40
step 80 benchmarks/encoder.py --dtype float32 --st-device cpu --torch-threads "$HOST_CPUS"
step 80 benchmarks/encoder.py --dtype bfloat16 --st-device cpu --torch-threads "$HOST_CPUS"
step 120 benchmarks/vs_mltransform.py --torch-threads "$HOST_CPUS"
step 40 benchmarks/startup.py
step 30 benchmarks/compiles.py --real
step 40 benchmarks/long_context.py --timeout 30
step 30 benchmarks/chunk_sweep.py
finish
