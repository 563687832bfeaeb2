"""``attention.backend: auto`` beside every fixed backend on this CPU: whole jobs over held-out documents, and
attention alone at long-document lengths (512 to 16k tokens).

    python benchmarks/attention_auto.py [--quick] [--docs 400] [--lengths 512,1024,2048,4096,8192,16384]

Jobs: configs/local.yaml's job (MiniLM, buckets 128 and 256, packed) over ``--docs`` held-out documents once per
fixed backend and twice with ``auto`` (a cold measurement cache, then the cached choice), in turns; each gives its
encoder time (the batches' summed compute) and wall time, and auto its measuring seconds (the plan's).
Lengths: MiniLM's attention shape (12 heads x 32) at each length, at the rows one chip gets at 8,192 tokens a batch
(packed: two windows a row), float32. Each fixed backend is timed in turns with the others; ``auto`` measures (as a
job does, attention/measure.py) and its figure is the time of the backend it chose, from the same turns, plus what
measuring cost once. The check: auto's time is within the best fixed backend's plus its measuring time (and, once
cached, within the noise of the best fixed one). Native's scores past a quarter of free memory are not run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

FIXED = ("native", "chunked", "flash")  # jobs: flash on a CPU runs its kernel: auto (docbeam's chunked, first)
# attention alone: the fixed choices a CPU offers (flash's first CPU kernel is chunked itself, so its other one)
KERNELS = ("native", "chunked", "flash[tokamax_chunked]")
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 1024)
TOKENS_PER_BATCH = 8192


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--docs", type=int, help="held-out documents per job (default 400; --quick 40)")
    p.add_argument("--lengths", help=f"comma-separated (default {','.join(map(str, LENGTHS))})")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per length, in turns (default %(default)s)")
    args = p.parse_args(argv)
    args.docs = args.docs or (40 if args.quick else 400)
    args.lengths = (
        [int(x) for x in args.lengths.split(",")] if args.lengths else list(QUICK_LENGTHS if args.quick else LENGTHS)
    )
    return args


def jobs(args, cache_home: str) -> list[dict]:
    """Each fixed backend's job and auto's twice, over the same held-out documents."""
    from docbeam.attention import measure
    from docbeam.models.checkpoint import resolve_dir

    source = common.heldout_corpus(args.docs, resolve_dir(common.DEFAULT_MODEL))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, backend in enumerate((*FIXED, "auto", "auto")):
            measure._MEASURED.clear()  # each job as its own process would: the second auto reads the disk cache
            extra = (f"attention.backend={backend}",) + (("attention.fallback=native",) if backend == "flash" else ())
            s = common.run_local_job(common.DEFAULT_MODEL, source, os.path.join(tmp, str(i)), extra)
            plan = s["attention_plan"]
            measured = [line["measurement"] for line in plan.values() if line.get("measurement")]
            rows.append(
                {
                    "backend": backend + (" (cached)" if measured and all(m["cached"] for m in measured) else ""),
                    "ran": s["attention_backends"],
                    "chose": {b: line["backend"] for b, line in plan.items()},
                    "wall_s": s["wall_seconds"],
                    "encoder_s": round(sum(t["compute_ms"] for t in common.read_timing(s["output"])) / 1e3, 3),
                    "measure_s": round(sum(m["measure_s"] for m in measured), 3),
                    "tokens_per_s": s["tokens_per_second"],
                }
            )
    return rows


def lengths(args, cache_home: str) -> list[dict]:
    """Attention alone per length: the fixed backends timed in turns, and what auto chose and paid to measure."""
    import jax

    from docbeam.attention import measure
    from docbeam.attention.candidates import bind
    from docbeam.attention.interface import AttentionCase
    from docbeam.attention.on_chip import Inputs, free_memory_bytes, native_scores_bytes
    from docbeam.attention.settings import AttentionConfig
    from docbeam.models.mesh import MeshShape
    from docbeam.pipeline.stages.measurement_cache import MeasurementCache

    spec = AttentionConfig(backend="auto", candidates=KERNELS[1:])
    out = []
    for length in args.lengths:
        case = AttentionCase("cpu", "float32", length, 12, 32, segments=True)
        rows = max(1, TOKENS_PER_BATCH // length)
        inputs = Inputs.probe(case, rows)
        fixed = {}
        for name in KERNELS:
            if name == "native" and native_scores_bytes(case, rows) > 0.25 * (free_memory_bytes() or 0):
                continue
            call = inputs.compiled(bind(spec, name))
            jax.block_until_ready(call())
            fixed[name] = call
        times = {name: [] for name in fixed}
        for round_ in range(args.rounds):
            for name in fixed if round_ % 2 == 0 else reversed(list(fixed)):
                t0 = time.perf_counter()
                jax.block_until_ready(fixed[name]())
                times[name].append(time.perf_counter() - t0)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        measure._MEASURED.clear()
        m = measure.measured(spec, (case,), rows, MeshShape(1, 1), MeasurementCache(cache_home))
        best = min(medians, key=medians.get)
        auto_ms = medians[m.chosen]
        out.append(
            {
                "length": length,
                "rows": rows,
                **{f"{name}_ms": round(v, 3) for name, v in medians.items()},
                "auto_chose": m.chosen,
                "auto_ms": round(auto_ms, 3),
                "auto_measure_s": round(m.measure_s, 2),
                "best_fixed": best,
                "auto_vs_best": round(auto_ms / medians[best], 3),
                "native": "timed" if "native" in fixed else "not run: its scores exceed a quarter of free memory",
            }
        )
        print(f"  {length}: {out[-1]}", flush=True)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    common.bootstrap()
    info = common.machine()
    common.print_machine("auto beside every fixed backend", info)
    with tempfile.TemporaryDirectory() as cache_home:
        os.environ["XDG_CACHE_HOME"] = cache_home  # a cold measurement cache for this run
        job_rows = jobs(args, cache_home)
        best_fixed = min((r for r in job_rows if r["backend"] in FIXED), key=lambda r: r["encoder_s"])
        print(
            common.table(
                [
                    "backend",
                    "ran (batches)",
                    "encoder s",
                    "measuring s",
                    "wall s",
                    "tokens/s",
                    "vs best fixed (encoder)",
                ],
                [
                    [
                        r["backend"],
                        " ".join(f"{k}:{v}" for k, v in r["ran"].items()),
                        r["encoder_s"],
                        r["measure_s"],
                        r["wall_s"],
                        r["tokens_per_s"],
                        f"{r['encoder_s'] / best_fixed['encoder_s']:.2f}x",
                    ]
                    for r in job_rows
                ],
            )
        )
        length_rows = lengths(args, os.path.join(cache_home, "lengths"))
    print(
        common.table(
            [
                "tokens",
                "rows",
                *[f"{n} ms" for n in KERNELS],
                "auto chose",
                "auto ms",
                "measuring s",
                "auto / best fixed",
            ],
            [
                [
                    r["length"],
                    r["rows"],
                    *[r.get(f"{n}_ms", "not run") for n in KERNELS],
                    r["auto_chose"],
                    r["auto_ms"],
                    r["auto_measure_s"],
                    f"{r['auto_vs_best']:.2f}x",
                ]
                for r in length_rows
            ],
        )
    )
    common.write_results(
        args,
        "attention_auto",
        {
            "machine": info,
            "docs": args.docs,
            "jobs": job_rows,
            "lengths": length_rows,
            "tokens_per_batch": TOKENS_PER_BATCH,
        },
    )


if __name__ == "__main__":
    main()
