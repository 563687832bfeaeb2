"""Runs the CPU benchmarks in sequence (encoder, attention, bucketing, batch_shapes, compiles, long_context,
precision, vs_mltransform, startup), then prints all their tables together. Exits 1 if any of them failed (compiles exits 1 on FAIL).

    python benchmarks/run_all.py [--quick] [--only encoder,bucketing]     (or: make bench)

Each runs as its own process, so one's memory and compiled functions do not leak into the next.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

BENCHMARKS = (
    "encoder",
    "attention",
    "bucketing",
    "batch_shapes",
    "compiles",
    "long_context",
    "precision",
    "vs_mltransform",
    "startup",
)


def run(name: str, args) -> tuple[int, str, float]:
    """Streams the benchmark's stdout while keeping it; stderr goes straight through."""
    command = [sys.executable, os.path.join(common.BENCH_DIR, f"{name}.py")]
    command += (["--results", args.results] if args.results else []) + (["--quick"] if args.quick else [])
    print(f"\n$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=common.REPO)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    return proc.wait(), "".join(lines), time.perf_counter() - started


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")

    outcomes = {name: run(name, args) for name in names}
    print("\n\n# All benchmarks" + (" (--quick)" if args.quick else "") + "\n")
    for name, (code, output, seconds) in outcomes.items():
        print(f"# {name}: {'ok' if code == 0 else f'exit {code}'} in {seconds:.0f} s\n")
        print(common.tables_in(output) + "\n")
    print(f"results in {os.path.relpath(common.results_dir(args), os.getcwd())}/")
    return int(any(code != 0 for code, _, _ in outcomes.values()))


if __name__ == "__main__":
    sys.exit(main())
