"""Start-up of a whole `docbeam run` process: command → first batch with a cold compilation cache, then
warm (the same cache folder again), and where the time went; with --baseline-repo, the same runs of
another checkout's code side by side, in one run.

    python benchmarks/startup.py [--quick] [--docs N] [--baseline-repo PATH] [--repeats N] [--set key=value ...]

Each run is `python -m pipeline.driver.cli run --config configs/local.yaml --set output.path=<temp>` started
from the checkout's folder (its packages first on the path) with a fresh JAX_COMPILATION_CACHE_DIR for
the cold run, which the warm run then reuses. "Command → first batch" is the first timing record's
``started_at`` minus the moment the subprocess was started, so it can be measured on checkouts whose
summary.json has no start-up breakdown (before issue 12); the breakdown's parts come from summary.json's
``startup`` and ``stages`` where the checkout writes them. Cold and warm runs of both sides alternate,
so a busy machine slows both alike; with ``--repeats N`` the alternation runs N times (a fresh cache each
time) and each side keeps its fastest run per cache, as benchmarks/vs_mltransform.py does: one run's
command → first batch moves by ±0.2 s on this VM.

To measure against the code before the breakdown and the cuts:

    git worktree add --detach /tmp/startup-base 5c8f9a2
    python benchmarks/startup.py --baseline-repo /tmp/startup-base
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

KINDS = ("cold", "warm")


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--docs", type=int, help="first N documents of the sample corpus (default: all 400; --quick: 40)")
    p.add_argument("--baseline-repo", help="another checkout (e.g. a git worktree of 5c8f9a2) run the same way")
    p.add_argument("--config", default="configs/local.yaml", help="relative to each checkout (default: %(default)s)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra docbeam --set override for every run (repeatable)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternate the cold and warm runs of both sides N times; keep each one's fastest (default 1)",
    )
    args = p.parse_args(argv)
    args.docs = args.docs or (40 if args.quick else None)
    return args


def run_docbeam(repo: str, args, input_path: str | None, cache: str, out: str, log_path: str) -> dict:
    """One whole `docbeam run` process; what it took, from outside and from its own records."""
    overrides = [f"output.path={out}", *([f"input.path={input_path}"] if input_path else []), *args.set]
    command = [sys.executable, "-m", "docbeam", "run", "--config", os.path.join(repo, args.config)]
    command += [a for o in overrides for a in ("--set", o)]
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": cache,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": repo,
    }
    with open(log_path, "w") as log:
        launched = time.time()
        rc = subprocess.run(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        ended = time.time()
    if rc != 0:
        with open(log_path) as f:
            raise RuntimeError(f"{' '.join(command)} exited {rc}:\n{f.read()[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    timing = sorted(common.read_timing(out), key=lambda t: t["started_at"])
    starts = [datetime.datetime.fromisoformat(t["started_at"]).timestamp() for t in timing]
    first_done = starts[0] + timing[0]["total_ms"] / 1e3
    last_done = max(s + t["total_ms"] / 1e3 for s, t in zip(starts, timing))
    steady_tokens = sum(t["real_tokens"] for t in timing[1:])
    return {
        "command_s": round(ended - launched, 3),
        "to_first_batch_s": round(starts[0] - launched, 3),
        "to_first_batch_done_s": round(first_done - launched, 3),
        "first_batch_ms": timing[0]["total_ms"],
        "batches_that_compiled": sum(bool(t["compiled"]) for t in timing),
        "compile_cache_hits_in_batches": sum(t.get("compile_cache_hits", 0) for t in timing),
        "steady_state_s": round(last_done - first_done, 3),
        "steady_tokens_per_second": round(steady_tokens / (last_done - first_done), 1)
        if last_done > first_done
        else None,
        "batches": len(timing),
        "compiles": summary.get("compiles"),
        "wall_seconds": summary.get("wall_seconds"),
        "startup": summary.get("startup"),
        "stages": summary.get("stages"),
    }


def fastest(runs: list[dict]) -> dict:
    """The run with the shortest command → first batch, with every run's figure beside it."""
    best = min(runs, key=lambda run: run["to_first_batch_s"])
    return {**best, "to_first_batch_every_run_s": [run["to_first_batch_s"] for run in runs]}


def breakdown_rows(results: dict, columns: list[tuple[str, str]]) -> list[list]:
    """One row per figure, one column per (side, kind)."""

    def get(r, *path):
        for key in path:
            r = (r or {}).get(key) if isinstance(r, dict) else None
        return r

    cells = {c: results[c[0]][c[1]] for c in columns}
    rows = [
        ["command → first batch (s)", *[cells[c]["to_first_batch_s"] for c in columns]],
        ["command → first batch done (s)", *[cells[c]["to_first_batch_done_s"] for c in columns]],
        ["whole command (s)", *[cells[c]["command_s"] for c in columns]],
        ["batches that compiled", *[cells[c]["batches_that_compiled"] for c in columns]],
    ]
    for step in ("imports", "plan", "lock_and_checks", "graph"):
        rows.append([f"  driver: {step} (s)", *[get(cells[c], "startup", "steps_s", step) for c in columns]])
    for part in ("checkpoint", "probes"):
        rows.append([f"  encoder: {part} (s)", *[get(cells[c], "startup", "encoder_s", part) for c in columns]])
    shapes = sorted(
        {k for c in columns for k in (get(cells[c], "startup", "compiles_s") or {})},
        key=lambda k: int(k.split("x")[1].split(",")[0]),
    )
    for shape in shapes:
        rows.append([f"    compile {shape} (s)", *[get(cells[c], "startup", "compiles_s", shape) for c in columns]])
    rows.append(["steady state after the first batch (s)", *[cells[c]["steady_state_s"] for c in columns]])
    rows.append(["steady tokens/s", *[cells[c]["steady_tokens_per_second"] for c in columns]])
    stages = sorted(
        {k for c in columns for k in (get(cells[c], "stages", "share_of_wall") or {})},
        key=lambda s: (
            ("read", "tokenize", "encode", "pool", "commit", "other").index(s)
            if s in ("read", "tokenize", "encode", "pool", "commit", "other")
            else 99
        ),
    )
    for stage in stages:
        rows.append([f"share of wall: {stage}", *[get(cells[c], "stages", "share_of_wall", stage) for c in columns]])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine(with_jax=False)
    common.print_machine("startup: command → first batch, cold and warm compilation cache", info)
    sides = {"this": common.REPO}
    if args.baseline_repo:
        sides = {"baseline": os.path.abspath(args.baseline_repo), **sides}
    runs = {side: {kind: [] for kind in KINDS} for side in sides}
    with tempfile.TemporaryDirectory(prefix="docbeam-startup-") as tmp:
        input_path = None
        if args.docs:
            input_path = common.write_subset(common.read_documents(common.SAMPLE, args.docs), tmp)
        for repeat in range(args.repeats):
            for kind in KINDS:  # alternate the sides, so a busy machine slows both alike
                for side, repo in sides.items():
                    cache = os.path.join(tmp, f"jax-cache-{side}-{repeat}")  # fresh for "cold", reused by "warm"
                    out = os.path.join(tmp, f"out-{side}-{kind}-{repeat}")
                    print(f"{side} ({repo}), {kind} cache, run {repeat + 1} of {args.repeats} ...", flush=True)
                    run = run_docbeam(
                        repo, args, input_path, cache, out, os.path.join(tmp, f"{side}-{kind}-{repeat}.log")
                    )
                    runs[side][kind].append(run)
                    print(
                        f"  command → first batch {run['to_first_batch_s']:.1f} s, "
                        f"whole command {run['command_s']:.1f} s",
                        flush=True,
                    )
    results = {side: {kind: fastest(runs[side][kind]) for kind in KINDS} for side in sides}

    columns = [(side, kind) for kind in KINDS for side in sides]
    print(f"\n## Breakdown ({args.docs or 'all'} documents, {args.config})\n")
    print(common.table(["measure", *[f"{side} {kind}" for side, kind in columns]], breakdown_rows(results, columns)))
    ratios = {}
    if args.baseline_repo:
        print("\n## this ÷ baseline, command → first batch (targets: warm and cold ≤ 1/2, i.e. no growth)\n")
        rows = []
        for kind in KINDS:
            base, this = results["baseline"][kind], results["this"][kind]
            r = common.ratio(this["to_first_batch_s"], base["to_first_batch_s"])
            ratios[kind] = round(r, 3)
            rows.append(
                [
                    kind,
                    base["to_first_batch_s"],
                    this["to_first_batch_s"],
                    r,
                    ", ".join(map(str, base["to_first_batch_every_run_s"])),
                    ", ".join(map(str, this["to_first_batch_every_run_s"])),
                ]
            )
        print(common.table(["cache", "baseline s", "this s", "ratio", "baseline, every run", "this, every run"], rows))
    common.write_results(
        args,
        "startup",
        {"args": vars(args), "machine": info, "sides": sides, "results": results, "first_batch_ratio": ratios},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
