"""Long context: attention for a ModernBERT-base shape (hidden 768, 12 heads x 64, 22 layers of which every
3rd is global and the rest local with a ±64 window; float32, batch 1) at 2k, 8k and 16k tokens, native,
chunked and flash side by side; or, with ``--shape embeddinggemma-300m``, EmbeddingGemma-300m's (3 query heads
over 1 key/value head of 256, 24 bidirectional layers: 4 global, 20 sliding within ±256) at 2k and 8k.

    python benchmarks/long_context.py [--quick] [--lengths 2048,8192,16384] [--backends native,chunked,flash]
    python benchmarks/long_context.py --shape embeddinggemma-300m --backends native,chunked

One global and one local layer are timed per backend and length, each in its own subprocess (so its peak
memory is its own, and under an address-space cap so native's O(T²) scores cannot take the machine down); the
model's attention total weights them by the layer counts (8 global, 14 local). Memory is the child's peak RSS
minus its RSS once the inputs exist (compilation included), and XLA's own count of the temporary buffers the
compiled layer allocates (``memory_analysis().temp_size_in_bytes``: the scores, for native). A case whose native scores would not fit the cap is skipped with the
reason. Lengths run in increasing order, so the largest, slowest points come last.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

KINDS = ("global", "local")
QUICK_LENGTHS = (512, 1024)
GB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's attention: query heads over key/value heads of head_dim, how many layers of each kind, the
    local layers' window (keys each side), the lengths it is measured at and its results file."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layer_counts: dict
    window: tuple[int, int]
    lengths: tuple[int, ...]
    results: str

    def local_window(self, kind: str) -> tuple[int, int] | None:
        return self.window if kind == "local" else None


SHAPES = {  # ModernBERT-base: every 3rd of 22 layers global; EmbeddingGemma-300m: every 6th of 24
    "modernbert-base": Shape(
        "ModernBERT-base", 12, 12, 64, {"global": 8, "local": 14}, (64, 64), (2048, 8192, 16384), "long_context"
    ),
    "embeddinggemma-300m": Shape(
        "EmbeddingGemma-300m",
        3,
        1,
        256,
        {"global": 4, "local": 20},
        (256, 256),
        (2048, 8192),
        "long_context_embeddinggemma",
    ),
}


def case_parser(doc: str, default_lengths, quick_lengths, timeout: float):
    """The options of a benchmark that runs one capped child process per (backend, length) case."""
    p = common.parser(doc)
    p.add_argument(
        "--lengths",
        help=f"comma-separated (default {','.join(map(str, default_lengths))}; "
        f"--quick {','.join(map(str, quick_lengths))})",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed calls, best kept")
    p.add_argument("--time-per-case", type=float, default=20.0, help="stop timing a case after this many seconds")
    p.add_argument("--mem-cap-gb", type=float, default=16.0, help="address-space cap per case (default %(default)s)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per case subprocess (default %(default)s)")
    return p


def lengths_of(args, default_lengths, quick_lengths) -> tuple[int, ...]:
    """--lengths in increasing order, so the largest, slowest points come last."""
    if args.lengths:
        return tuple(sorted(int(x) for x in args.lengths.split(",")))
    return tuple(quick_lengths if args.quick else default_lengths)


def run_case(
    backend: str, length: int, kind: str, repeats: int, time_per_case: float, shape: str = "modernbert-base"
) -> dict:
    """In the child: compile and call one layer's attention; best time of the timed calls, peak RSS growth."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from docbeam import attention

    s = SHAPES[shape]
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, length, heads, s.head_dim), np.float32))
        for heads in (s.heads, s.kv_heads, s.kv_heads)
    )
    lengths = jnp.asarray([length], jnp.int32)
    chosen = attention.get(backend)
    window = s.local_window(kind)
    case = attention.AttentionCase(
        jax.default_backend(), "float32", length, s.heads, s.head_dim, local_window=window, num_kv_heads=s.kv_heads
    )
    kernel = chosen.supports(case, chosen.parse_options(None)).kernel
    fn = chosen.bind()
    attend = jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=lengths, scale=s.head_dim**-0.5, local_window=window))
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    attend = attend.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    temp_bytes = getattr(attend.memory_analysis(), "temp_size_in_bytes", None)
    start = time.perf_counter()
    out = attend(q, k, v).block_until_ready()
    first_s = time.perf_counter() - start
    times = []
    while len(times) < repeats and (not times or sum(times) + times[-1] <= time_per_case):
        start = time.perf_counter()
        attend(q, k, v).block_until_ready()
        times.append(time.perf_counter() - start)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "backend": backend,
        "length": length,
        "kind": kind,
        "status": "ok",
        "kernel": kernel,
        "seconds": round(min(times), 4),
        "calls": len(times),
        "compile_s": round(compile_s, 2),
        "first_call_s": round(first_s, 2),
        "memory_gb": round((peak_kb - baseline_kb) / 2**20, 4),
        "xla_temp_gb": None if temp_bytes is None else round(temp_bytes / GB, 4),
        "finite": bool(np.isfinite(np.asarray(out)).all()),
    }


def native_scores_gb(length: int, shape: str = "modernbert-base") -> float:
    """native's einsum form holds float32 scores and their exponentials, 2 × N·T² × 4 bytes, for every layer
    (the window is a mask on the whole score matrix)."""
    return 2 * SHAPES[shape].heads * length * length * 4 / GB


def spawn(case: dict, cap_gb: float, timeout: float, script: str = __file__, native_gb=native_scores_gb) -> dict:
    """One case in a child process of ``script`` under an address-space cap; native is skipped, with the reason,
    where its scores (``native_gb(length)``) would not fit."""

    def limit():
        cap = int(cap_gb * GB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    label = {key: case[key] for key in ("backend", "length", "kind") if key in case}
    if case["backend"] == "native" and native_gb(case["length"]) > 0.8 * cap_gb:
        return {
            **label,
            "status": f"skipped: native's scores need ~{native_gb(case['length']):.1f} GB, over "
            f"80% of the {cap_gb:g} GB cap on this {common.machine(False)['memory_gib']} GiB "
            "machine shared with other jobs",
        }
    cmd = [sys.executable, script, "--child", json.dumps(case)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {**label, "status": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
    return {**label, "status": f"failed under the {cap_gb:g} GB cap: {tail}"}


def model_totals(results: list[dict], backends, lengths, layer_counts: dict) -> list[dict]:
    """Per backend and length: the model's attention time (global and local layers weighted by their
    counts) and the larger of the two kinds' peak memory (layers run one after another)."""
    ok = {(r["backend"], r["length"], r["kind"]): r for r in results if r["status"] == "ok"}
    totals = []
    for length in lengths:
        for backend in backends:
            kinds = [ok.get((backend, length, kind)) for kind in KINDS]
            if not all(kinds):
                totals.append({"backend": backend, "length": length, "status": "incomplete"})
                continue
            totals.append(
                {
                    "backend": backend,
                    "length": length,
                    "status": "ok",
                    "model_seconds": round(sum(layer_counts[r["kind"]] * r["seconds"] for r in kinds), 3),
                    "memory_gb": max(r["memory_gb"] for r in kinds),
                    "xla_temp_gb": max((r["xla_temp_gb"] or 0) for r in kinds),
                }
            )
    return totals


def ratios(results: list[dict], totals: list[dict], lengths) -> list[dict]:
    """native ÷ each other backend: time and memory per kind of layer and for the model."""

    def find(rows, **keys):
        return next((r for r in rows if r["status"] == "ok" and all(r[k] == v for k, v in keys.items())), None)

    out = []
    for length in lengths:
        for backend in sorted({r["backend"] for r in results} - {"native"}):
            row = {"backend": backend, "length": length}
            for kind in KINDS:
                mine, native = (
                    find(results, backend=backend, length=length, kind=kind),
                    find(results, backend="native", length=length, kind=kind),
                )
                row[f"{kind}_speedup"] = round(native["seconds"] / mine["seconds"], 2) if mine and native else None
                row[f"{kind}_memory_ratio"] = (
                    round(mine["memory_gb"] / native["memory_gb"], 4)
                    if mine and native and native["memory_gb"]
                    else None
                )
            mine, native = find(totals, backend=backend, length=length), find(totals, backend="native", length=length)
            row["model_speedup"] = (
                round(native["model_seconds"] / mine["model_seconds"], 2) if mine and native else None
            )
            out.append(row)
    return out


def target_verdict(results: list[dict], speedups: list[dict], length: int = 8192, wanted: float = 3.0) -> dict:
    """Issue 18's target: with local layers, the model's attention on chunked at least ``wanted`` × native's
    speed at ``length`` tokens, with flat memory (chunked's local-layer memory per length beside native's)."""
    row = next((r for r in speedups if r["backend"] == "chunked" and r["length"] == length), None)
    speedup = row and row["model_speedup"]
    memory = {
        backend: {
            r["length"]: r["memory_gb"]
            for r in results
            if r["backend"] == backend and r["kind"] == "local" and r["status"] == "ok"
        }
        for backend in ("chunked", "native")
    }
    verdict = "not measured" if speedup is None else ("PASS" if speedup >= wanted else "FAIL")
    line = (
        f"target: chunked's model attention >= {wanted:g}x native at {length} tokens: "
        f"{'—' if speedup is None else f'{speedup:.2f}x'} {verdict}; local-layer peak RSS growth by length, "
        + "; ".join(
            f"{backend} " + ", ".join(f"{n}: {gb:.3g} GB" for n, gb in sorted(by_length.items()))
            for backend, by_length in memory.items()
        )
    )
    return {
        "speedup": speedup,
        "wanted": wanted,
        "length": length,
        "verdict": verdict,
        "local_memory_gb": memory,
        "line": line,
    }


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        case = json.loads(sys.argv[2])
        print(json.dumps(run_case(**case)))
        return 0
    p = case_parser(__doc__, SHAPES["modernbert-base"].lengths, QUICK_LENGTHS, timeout=300.0)
    p.add_argument("--backends", default="native,chunked,flash")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="modernbert-base",
        help="the model whose attention is measured (default %(default)s; its default --lengths)",
    )
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    lengths = lengths_of(args, shape.lengths, QUICK_LENGTHS)
    backends = tuple(args.backends.split(","))
    info = common.machine(with_jax=False)
    counts = shape.layer_counts
    common.print_machine(f"long context: {shape.name} attention, global and local layers", info)
    print(
        f"{shape.heads} query heads over {shape.kv_heads} k/v heads x {shape.head_dim}, float32, batch 1; "
        f"{sum(counts.values())} layers: {counts['global']} global, {counts['local']} local (window "
        f"{shape.window}); cap {args.mem_cap_gb:g} GB per case\n",
        flush=True,
    )
    results = []
    started = time.perf_counter()
    for length in sorted(lengths):
        for backend in backends:
            for kind in KINDS:
                case = {
                    "backend": backend,
                    "length": length,
                    "kind": kind,
                    "repeats": args.repeats,
                    "time_per_case": args.time_per_case,
                    "shape": args.shape,
                }
                results.append(
                    spawn(case, args.mem_cap_gb, args.timeout, native_gb=lambda n: native_scores_gb(n, args.shape))
                )
                print(f"  {results[-1]}", flush=True)
    totals = model_totals(results, backends, sorted(lengths), counts)
    speedups = ratios(results, totals, sorted(lengths))

    print("\n## One layer's attention\n")
    print(
        common.table(
            ["backend", "tokens", "layer", "kernel", "status", "ms", "peak RSS growth GB", "XLA temp GB"],
            [
                [
                    r["backend"],
                    r["length"],
                    r["kind"],
                    r.get("kernel", "—"),
                    r["status"],
                    r["seconds"] * 1000 if "seconds" in r else None,
                    r.get("memory_gb"),
                    r.get("xla_temp_gb"),
                ]
                for r in results
            ],
        )
    )
    print(f"\n## The model's attention ({counts['global']} global + {counts['local']} local layers)\n")
    print(
        common.table(
            ["backend", "tokens", "status", "seconds", "peak RSS growth GB", "XLA temp GB"],
            [
                [
                    t["backend"],
                    t["length"],
                    t["status"],
                    t.get("model_seconds"),
                    t.get("memory_gb"),
                    t.get("xla_temp_gb"),
                ]
                for t in totals
            ],
        )
    )
    print("\n## native ÷ backend\n")
    print(
        common.table(
            [
                "backend",
                "tokens",
                "global speed-up",
                "local speed-up",
                "model speed-up",
                "global memory ÷ native",
                "local memory ÷ native",
            ],
            [
                [
                    r["backend"],
                    r["length"],
                    r["global_speedup"],
                    r["local_speedup"],
                    r["model_speedup"],
                    r["global_memory_ratio"],
                    r["local_memory_ratio"],
                ]
                for r in speedups
            ],
        )
    )
    target = target_verdict(results, speedups) if args.shape == "modernbert-base" else None  # issue 18's
    if target:
        print(f"\n{target['line']}")
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    common.write_results(
        args,
        shape.results,
        {
            "machine": info,
            "lengths": list(lengths),
            "shape": {
                "name": shape.name,
                "heads": shape.heads,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "layers": sum(counts.values()),
                "layer_counts": counts,
                "window": list(shape.window),
            },
            "results": results,
            "model_totals": totals,
            "native_over_backend": speedups,
            "target": target,
        },
    )
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
