"""Every attention backend (and each flash kernel runnable here) × sequence length × dtype: time, compile
time and peak memory, each case in its own subprocess so its peak memory is its own.

    python benchmarks/attention.py [--quick] [--backends native,flash] [--lengths 128,2048] [--dtypes float32]

Memory is the child's peak RSS (ru_maxrss) minus its RSS after imports, plus the device's
``peak_bytes_in_use`` where the platform reports one (GPU, TPU). ``native`` materialises f32 scores and
probabilities, 2 × B·N·T²·4 bytes; a case whose estimate exceeds the memory budget is reported as
"would need X GB" instead of being run. A child over ``--mem-cap-gb`` of RSS is killed (and on CPU
cannot allocate past it: RLIMIT_AS), so no case can take the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common, processes

# Grow device memory on demand, so a device's peak is the case's own; allow nearly all of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

DEFAULT_LENGTHS = (128, 512, 2048, 8192, 16384, 32768)
QUICK_LENGTHS = (128, 1024)
RESULT_PREFIX = "CASE-RESULT "
GB = 1e9


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument(
        "--backends",
        help="comma-separated labels (default: every registered backend and every "
        "flash kernel runnable here, e.g. flash/tokamax_triton)",
    )
    p.add_argument(
        "--lengths",
        help=f"comma-separated (default {','.join(map(str, DEFAULT_LENGTHS))}; "
        f"--quick {','.join(map(str, QUICK_LENGTHS))})",
    )
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument(
        "--repeats",
        type=int,
        help="timed calls after compile and one warm call, best kept "
        "(default 5; --quick 2); fewer when one call exceeds --time-per-case",
    )
    p.add_argument("--time-per-case", type=float, default=20.0, help="seconds of timed calls per case")
    p.add_argument("--timeout", type=float, help="seconds per case subprocess (default 900; --quick 120)")
    p.add_argument("--mem-cap-gb", type=float, default=16.0, help="host memory cap per case (default %(default)s)")
    p.add_argument(
        "--name", default="attention", help="results file name, before any -<platform> suffix (default %(default)s)"
    )
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case (JSON) and print its result
    args = p.parse_args(argv)
    args.lengths = (
        tuple(int(x) for x in args.lengths.split(","))
        if args.lengths
        else (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    )
    args.dtypes = tuple(args.dtypes.split(","))
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.timeout = args.timeout or (120 if args.quick else 900)
    return args


# --- one case, in the child process --------------------------------------------------------------------


def bind(variant: dict):
    from docbeam import attention

    backend = attention.get(variant["backend"])
    return backend.bind(backend.parse_options(variant["options"]))


def supported(variant: dict, platform: str, dtype: str, length: int, heads: int, head_dim: int):
    from docbeam import attention
    from docbeam.attention import AttentionCase

    backend = attention.get(variant["backend"])
    return backend.supports(
        AttentionCase(platform, dtype, length, heads, head_dim), backend.parse_options(variant["options"])
    )


def run_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    if device.platform == "cpu":
        # A hard stop below the watchdog: XLA's allocation fails (RESOURCE_EXHAUSTED) instead of the host swapping.
        with open("/proc/self/status") as f:
            vm_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        limit = vm_bytes + int(case["mem_cap_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    attend = bind(case["variant"])
    # The capability check imports the kernel's library (tokamax, Pallas), so it is not counted as the case's memory.
    support = supported(
        case["variant"], device.platform, case["dtype"], case["length"], case["heads"], case["head_dim"]
    )
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    b, t, n, h = case["batch"], case["length"], case["heads"], case["head_dim"]
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.float32).astype(case["dtype"]) for key in keys)
    lengths = jnp.full((b,), t, jnp.int32)
    scale = 1.0 / h**0.5
    fn = jax.jit(lambda q, k, v, n_B: attend(q, k, v, kv_lengths_B=n_B, scale=scale))

    t0 = time.perf_counter()
    compiled = fn.lower(q, k, v, lengths).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = compiled(q, k, v, lengths).block_until_ready()
    first_s = time.perf_counter() - t0
    runs = max(1, min(case["repeats"], int(case["time_per_case"] / max(first_s, 1e-6))))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = compiled(q, k, v, lengths).block_until_ready()
        times.append(time.perf_counter() - t0)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return {
        "status": "ok",
        "compile_s": compile_s,
        "first_call_s": first_s,
        "times_s": times,
        "best_s": min(times),
        "finite": bool(jnp.isfinite(out.astype(jnp.float32)).all()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss,
        "device_peak_bytes": int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None,
        "kernel": support.kernel,
        "device": f"{device.platform}:{device.id} {getattr(device, 'device_kind', '')}".strip(),
    }


def child_main(case_json: str) -> int:
    case = json.loads(case_json)
    try:
        result = run_case(case)
    except Exception as e:  # noqa: BLE001  (the parent records every failure as the case's status)
        text = f"{type(e).__name__}: {e}"
        oom = isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        result = {"status": "OOM" if oom else "error", "error": text[:500]}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# --- the parent: which cases, each in a subprocess under a watchdog ----------------------------------


def variants(platform: str, dtypes, head_dim: int) -> list[dict]:
    """Registered backends, ``native/jax_nn`` (native's other formulation, where it is not the default),
    plus ``flash/<kernel>`` for each flash kernel that runs here for some dtype and is not already what
    ``kernel: auto`` picks for every dtype."""
    from docbeam import attention
    from docbeam.attention import AttentionCase
    from docbeam.attention.flash import KERNELS, FlashOptions, pick_kernel
    from docbeam.attention.native import NativeOptions, formulation

    out = [{"label": name, "backend": name, "options": {}} for name in attention.names()]
    if formulation(NativeOptions(), platform) != "jax_nn":
        out.append({"label": "native/jax_nn", "backend": "native", "options": {"implementation": "jax_nn"}})
    if "flash" not in attention.names():
        return out
    for kernel in KERNELS:
        options = FlashOptions(kernel=kernel)
        runnable = [d for d in dtypes if pick_kernel(AttentionCase(platform, d, 128, 1, head_dim), options)[0]]
        auto = {pick_kernel(AttentionCase(platform, d, 128, 1, head_dim), FlashOptions())[0] for d in runnable}
        if runnable and auto != {kernel}:
            out.append({"label": f"flash/{kernel}", "backend": "flash", "options": {"kernel": kernel}})
    return out


def native_estimate_bytes(batch: int, heads: int, length: int) -> int:
    """jax.nn.dot_product_attention (xla) keeps f32 logits and f32 probabilities: 2 × B·N·T·S·4 bytes."""
    return 2 * batch * heads * length * length * 4


def run_in_subprocess(case: dict, timeout: float, cap_bytes: float) -> dict:
    return processes.watched_subprocess(__file__, case, timeout, cap_bytes, RESULT_PREFIX)


def memory_of(r: dict) -> float | None:
    """The measure the ratios use: device peak where the platform reports one, else host RSS growth."""
    if r.get("status") != "ok":
        return None
    return r["device_peak_bytes"] if r.get("device_peak_bytes") is not None else r["peak_rss_bytes"]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.case:
        return child_main(args.case)
    info = common.machine()
    common.print_machine("attention: backends × sequence length × dtype", info)
    import jax

    platform = jax.default_backend()
    stats = jax.devices()[0].memory_stats() or {}
    device_limit = stats.get("bytes_limit")
    native_budget = device_limit if device_limit else args.mem_cap_gb * GB
    cap_bytes = args.mem_cap_gb * GB
    available = {v["label"]: v for v in variants(platform, args.dtypes, args.head_dim)}
    labels = args.backends.split(",") if args.backends else list(available)
    unknown = [label for label in labels if label not in available]
    if unknown:
        raise SystemExit(f"--backends: {unknown} not available here; available: {', '.join(available)}")
    print(
        f"batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, lengths {list(args.lengths)}, "
        f"dtypes {list(args.dtypes)}, backends {labels}; host cap {args.mem_cap_gb:g} GB per case, native budget "
        f"{native_budget / GB:.1f} GB ({'device' if device_limit else 'host'})\n",
        flush=True,
    )

    results = []
    for label in labels:
        variant = available[label]
        for dtype in args.dtypes:
            for length in args.lengths:
                row = {"backend": label, "dtype": dtype, "length": length}
                support = supported(variant, platform, dtype, length, args.heads, args.head_dim)
                row["kernel"] = support.kernel
                estimate = (
                    native_estimate_bytes(args.batch, args.heads, length) if variant["backend"] == "native" else None
                )
                if not support.ok:
                    row.update(status=f"refused: {support.reason}")
                elif estimate and estimate > native_budget:
                    row.update(status=f"would need {estimate / GB:.3g} GB (not run)", estimate_bytes=estimate)
                else:
                    case = {
                        "variant": variant,
                        "dtype": dtype,
                        "length": length,
                        "batch": args.batch,
                        "heads": args.heads,
                        "head_dim": args.head_dim,
                        "repeats": args.repeats,
                        "time_per_case": args.time_per_case,
                        "mem_cap_bytes": cap_bytes,
                    }
                    row.update(run_in_subprocess(case, args.timeout, cap_bytes + GB))
                    if estimate:
                        row["estimate_bytes"] = estimate
                results.append(row)
                print(
                    f"  {label:24} {dtype:9} T={length:<6} {row['status']}"
                    + (f"  {row['best_s'] * 1e3:.2f} ms" if row["status"] == "ok" else ""),
                    flush=True,
                )

    print("\n## Attention: time and memory per case\n")
    print(
        common.table(
            [
                "backend",
                "kernel",
                "dtype",
                "T",
                "status",
                "compile s",
                "best ms",
                "runs",
                "host peak MB",
                "device peak MB",
                "finite",
            ],
            [
                [
                    r["backend"],
                    r.get("kernel") or "",
                    r["dtype"],
                    r["length"],
                    r["status"],
                    r.get("compile_s"),
                    r["best_s"] * 1e3 if "best_s" in r else None,
                    len(r["times_s"]) if "times_s" in r else None,
                    r["peak_rss_bytes"] / 1e6 if "peak_rss_bytes" in r else None,
                    r["device_peak_bytes"] / 1e6 if r.get("device_peak_bytes") is not None else None,
                    r.get("finite"),
                ]
                for r in results
            ],
        )
    )

    by_key = {(r["backend"], r["dtype"], r["length"]): r for r in results}
    others = [label for label in labels if label != "native"]
    ratio_rows = []
    for dtype in args.dtypes:
        for length in args.lengths:
            native = by_key.get(("native", dtype, length), {})
            row = [dtype, length, native["best_s"] * 1e3 if native.get("status") == "ok" else native.get("status")]
            for label in others:
                r = by_key.get((label, dtype, length), {})
                ok = r.get("status") == "ok" and native.get("status") == "ok"
                row += [
                    common.ratio(r["best_s"], native["best_s"]) if ok else None,
                    common.ratio(memory_of(r), memory_of(native)) if ok else None,
                ]
            ratio_rows.append(row)
    if "native" in labels and others:
        print("\n## Ratios to native (time: best call; memory: device peak, else host RSS growth)\n")
        print(
            common.table(
                ["dtype", "T", "native ms"] + [f"{label}/native {m}" for label in others for m in ("time", "mem")],
                ratio_rows,
            )
        )

    flash_vs_native = []
    for dtype in args.dtypes:
        for length in args.lengths:
            r = by_key.get(("flash", dtype, length), {})
            for base in [label for label in labels if label.startswith("native")]:
                native = by_key.get((base, dtype, length), {})
                if r.get("status") == "ok" and native.get("status") == "ok":
                    flash_vs_native.append(
                        {
                            "dtype": dtype,
                            "length": length,
                            "native": base,
                            "native_kernel": native["kernel"],
                            "flash_kernel": r["kernel"],
                            "native_s": native["best_s"],
                            "flash_s": r["best_s"],
                            "speedup": common.ratio(native["best_s"], r["best_s"]),
                            "memory_ratio": common.ratio(memory_of(r), memory_of(native)),
                        }
                    )
    if flash_vs_native:
        print("\n## flash vs native (speedup: native time ÷ flash time; memory: flash ÷ native)\n")
        print(
            common.table(
                ["dtype", "T", "native", "flash kernel", "native ms", "flash ms", "speedup", "memory ratio"],
                [
                    [
                        c["dtype"],
                        c["length"],
                        c["native"],
                        c["flash_kernel"],
                        c["native_s"] * 1e3,
                        c["flash_s"] * 1e3,
                        c["speedup"],
                        c["memory_ratio"],
                    ]
                    for c in flash_vs_native
                ],
            )
        )

    suffix = "" if platform == "cpu" else f"-{platform}"
    common.write_results(
        args,
        f"{args.name}{suffix}",
        {
            "benchmark": "attention",
            "args": vars(args),
            "machine": info,
            "platform": platform,
            "native_budget_bytes": native_budget,
            "flash_vs_native": flash_vs_native,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
