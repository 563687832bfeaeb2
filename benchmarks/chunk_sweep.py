"""``chunked``'s query_chunk × key_chunk per sequence length (at --grid-heads-per-step), then other
heads_per_step values at the best pair: time and peak memory of each, and native's at the same length, each
case in its own process (as attention.py runs them).

    python benchmarks/chunk_sweep.py [--quick] [--lengths 512,2048,8192] [--dtype float32]
    python benchmarks/chunk_sweep.py --local-window 64,64 --heads 12 --head-dim 64 --lengths 8192 [--dtype D]

The fastest pair per length whose memory stays within ``--max-memory-share`` of native's is what
``attention.chunk_sizes.TUNED_CHUNKS`` should hold; the script prints that table. Batch 1, 12 heads × head_dim 32
(MiniLM) unless told otherwise. With ``--local-window LEFT,RIGHT`` it sweeps a local (sliding-window) layer
instead: query chunk × heads per step, the key chunk left to the layer (a query chunk's reachable keys), timed in
turns in one process; the sizes ``attention.chunk_sizes.LOCAL_*`` hold (one pair for every length) stay unless a
pair's geometric-mean time over the lengths beats theirs by more than ``--keep-within``.
"""

from __future__ import annotations

import sys

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import attention as attention_bench
from benchmarks import common

GB = 1e9
# Chunk sizes tried per length: powers of two from length/16 (and --min-chunk) up to the length, at most
# 4096: a 4096 × 4096 block of f32 scores for 12 heads is 0.8 GB, an eighth of native's memory at 8192.
SIZES = (128, 256, 512, 1024, 2048, 4096)
# A local layer's query chunks and heads per step tried (its key chunk follows from the window).
LOCAL_QUERY_CHUNKS = (32, 64, 128, 256)
LOCAL_HEADS_PER_STEP = (0, 1, 4)


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--min-chunk", type=int, default=256, help="smallest chunk tried (default %(default)s)")
    p.add_argument(
        "--grid-heads-per-step",
        type=int,
        default=1,
        help="heads_per_step for the query_chunk x key_chunk grid (default %(default)s: one head "
        "per matmul, measured fastest on XLA:CPU in chunk_sweep-before.json)",
    )
    p.add_argument("--other-heads-per-step", default="0,2,4", help="tried at the best pair (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after a warm call, best kept")
    p.add_argument("--time-per-case", type=float, default=6.0, help="seconds of timed calls per case")
    p.add_argument(
        "--max-memory-share",
        type=float,
        default=1 / 8,
        help="a pair qualifies if its peak memory is at most this share of native's (default 1/8)...",
    )
    p.add_argument(
        "--memory-floor-mb",
        type=float,
        default=64.0,
        help="...or at most this much: at short lengths all of it is small (default %(default)s)",
    )
    p.add_argument("--local-window", help="LEFT,RIGHT: sweep a local layer with this window instead")
    p.add_argument(
        "--keep-within",
        type=float,
        default=0.05,
        help="local sweep: the current sizes stay unless another pair is this much faster (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=9, help="local sweep: rounds of timed calls in turns")
    p.add_argument("--name", default="chunk_sweep", help="results file name (default %(default)s)")
    args = p.parse_args(argv)
    args.lengths = (256,) if args.quick else tuple(int(x) for x in args.lengths.split(","))
    args.local_window = tuple(int(x) for x in args.local_window.split(",")) if args.local_window else None
    return args


def run(args, backend: str, options: dict, length: int) -> dict:
    case = {
        "variant": {"label": backend, "backend": backend, "options": options},
        "dtype": args.dtype,
        "length": length,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "repeats": args.repeats,
        "time_per_case": args.time_per_case,
        "mem_cap_bytes": 16 * GB,
    }
    row = {
        "backend": backend,
        "options": options,
        "length": length,
        **attention_bench.run_in_subprocess(case, timeout=300, cap_bytes=17 * GB),
    }
    ms = (
        f"{row['best_s'] * 1e3:9.1f} ms, {row['peak_rss_bytes'] / 1e6:7.1f} MB"
        if row["status"] == "ok"
        else row["status"]
    )
    print(f"  T={length:<6} {backend:8} {options}  {ms}", flush=True)
    return row


def best(rows: list[dict], memory_limit: float) -> dict | None:
    ok = [r for r in rows if r["status"] == "ok" and r["peak_rss_bytes"] <= memory_limit]
    return min(ok, key=lambda r: r["best_s"]) if ok else None


def time_local_pairs(args, length: int, current: tuple[int, int]) -> list[dict]:
    """Every (query chunk, heads per step) pair of a local layer at ``length``, compiled in this process and
    timed in turns (medians of ``--rounds``): the pairs are within a few percent of each other, less than these
    VMs drift between subprocesses run one after another. Memory is not compared: every pair holds one query
    chunk's window."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from docbeam import attention

    backend = attention.get("chunked")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (args.batch, length, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(args.dtype) for key in keys)
    inputs = (q, k, v, jnp.full((args.batch,), length, jnp.int32))
    calls = {}
    for pair in ((qc, h) for qc in LOCAL_QUERY_CHUNKS for h in LOCAL_HEADS_PER_STEP):
        attend = backend.bind(backend.parse_options({"query_chunk": pair[0], "heads_per_step": pair[1]}))
        fn = lambda q, k, v, n, attend=attend: attend(  # noqa: E731
            q, k, v, kv_lengths_B=n, scale=args.head_dim**-0.5, local_window=args.local_window
        )
        calls[pair] = jax.jit(fn).lower(*inputs).compile()
    reference = np.asarray(calls[current](*inputs), np.float32)
    slowest = max(t[0] for t in common.times_in_turns(calls, inputs, rounds=1).values())
    per_round = max(1, int(args.time_per_case / args.rounds / slowest))
    times = common.times_in_turns(calls, inputs, args.rounds, per_round)
    rows = []
    for pair, c in calls.items():
        error = float(np.abs(np.asarray(c(*inputs), np.float32) - reference).max())
        median = float(np.median(times[pair]))
        rows.append({"length": length, "query_chunk": pair[0], "heads_per_step": pair[1], "median_s": median,
                     "times_s": times[pair], "max_abs_diff_to_current": error})  # fmt: skip
        print(f"  T={length:<6} {pair}  {median * 1e3:8.2f} ms  max |diff| {error:.3g}", flush=True)
    return rows


def choose_local(results: list[dict], current: tuple[int, int], keep_within: float) -> tuple[dict, dict]:
    """LOCAL_* is one pair for every length: ``(geometric-mean time per pair over the lengths, the choice)``, the
    choice the current pair unless another's time is more than ``keep_within`` lower."""
    import numpy as np

    times: dict = {}
    for r in results:
        times.setdefault((r["query_chunk"], r["heads_per_step"]), []).append(r["median_s"])
    score = {pair: float(np.exp(np.mean(np.log(t)))) for pair, t in times.items()}
    fastest = min(score, key=score.get)
    keep = score[current] <= score[fastest] * (1 + keep_within)
    pick = current if keep else fastest
    return score, {
        "query_chunk": pick[0],
        "heads_per_step": pick[1],
        "fastest": list(fastest),
        "current_over_fastest_time": common.ratio(score[current], score[fastest]),
        "current_kept": keep,
    }


def local_sweep(args, info) -> int:
    from docbeam.attention import chunk_sizes

    current = (chunk_sizes.LOCAL_QUERY_CHUNK, chunk_sizes.LOCAL_HEADS_PER_STEP)
    results = [row for length in args.lengths for row in time_local_pairs(args, length, current)]
    score, chosen = choose_local(results, current, args.keep_within)
    pick, fastest = (chosen["query_chunk"], chosen["heads_per_step"]), tuple(chosen["fastest"])
    lengths, margin = list(args.lengths), f"{args.keep_within:.0%}"
    print(f"\n## Geometric mean over {lengths} (current {current} kept unless beaten by more than {margin})\n")
    print(
        common.table(
            ["query_chunk", "heads_per_step", "geomean ms", "÷ current time"],
            [
                [p[0], p[1], score[p] * 1e3, common.ratio(score[p], score[current])]
                for p in sorted(score, key=score.get)
            ],
        )
    )
    print(f"\nchosen: {pick} (fastest {fastest}, current ÷ fastest time {score[current] / score[fastest]:.3f})")
    record = {"benchmark": "chunk_sweep", "args": vars(args), "machine": info, "current": list(current)}
    common.write_results(args, args.name, {**record, "chosen": chosen, "results": results})
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine()
    if args.local_window:
        common.print_machine(f"chunked: a local layer (window {args.local_window}), query chunk × heads per step", info)
        return local_sweep(args, info)
    common.print_machine("chunked: chunk sizes × sequence length", info)
    results, chosen = [], {}
    for length in args.lengths:
        native = run(args, "native", {}, length)
        results.append(native)
        limit = max(
            native["peak_rss_bytes"] * args.max_memory_share if native["status"] == "ok" else 0,
            args.memory_floor_mb * 1e6,
        )
        sizes = [s for s in SIZES if max(args.min_chunk, length // 16) <= s <= length] or [length]
        pairs = [
            run(args, "chunked", {"query_chunk": q, "key_chunk": k, "heads_per_step": args.grid_heads_per_step}, length)
            for q in sizes
            for k in sizes
        ]
        results += pairs
        top = best(pairs, limit)
        if top is None:
            continue
        q, k = top["options"]["query_chunk"], top["options"]["key_chunk"]
        others = [
            run(args, "chunked", {"query_chunk": q, "key_chunk": k, "heads_per_step": int(step)}, length)
            for step in args.other_heads_per_step.split(",")
            if step and int(step) != args.grid_heads_per_step
        ]
        results += others
        top = best([top, *others], limit)
        chosen[length] = {
            **top["options"],
            "best_s": top["best_s"],
            "peak_rss_bytes": top["peak_rss_bytes"],
            "speedup_over_native": common.ratio(native.get("best_s"), top["best_s"]),
            "memory_share_of_native": common.ratio(top["peak_rss_bytes"], native.get("peak_rss_bytes")),
        }

    print("\n## Every case\n")
    print(
        common.table(
            ["T", "backend", "query_chunk", "key_chunk", "heads_per_step", "status", "best ms", "compile s", "peak MB"],
            [
                [
                    r["length"],
                    r["backend"],
                    r["options"].get("query_chunk"),
                    r["options"].get("key_chunk"),
                    r["options"].get("heads_per_step"),
                    r["status"],
                    r["best_s"] * 1e3 if "best_s" in r else None,
                    r.get("compile_s"),
                    r["peak_rss_bytes"] / 1e6 if "peak_rss_bytes" in r else None,
                ]
                for r in results
            ],
        )
    )
    print(f"\n## Fastest per length within {args.max_memory_share:.3g} of native's memory\n")
    print(
        common.table(
            ["T", "query_chunk", "key_chunk", "heads_per_step", "best ms", "× native speed", "share of native memory"],
            [
                [
                    t,
                    c["query_chunk"],
                    c["key_chunk"],
                    c["heads_per_step"],
                    c["best_s"] * 1e3,
                    c["speedup_over_native"],
                    c["memory_share_of_native"],
                ]
                for t, c in chosen.items()
            ],
        )
    )
    common.write_results(
        args,
        args.name,
        {
            "benchmark": "chunk_sweep",
            "args": vars(args),
            "machine": info,
            "chosen": chosen,
            "memory_limit_rule": f"<= {args.max_memory_share:.3g} of native or <= {args.memory_floor_mb:g} MB",
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
