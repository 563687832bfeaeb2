"""Long context for decoders: the attention of a Qwen3-0.6B shape (28 layers, every one global and causal;
16 query heads over 8 key/value heads of 128; float32, batch 1) at 4k, 16k and 32k tokens, side by side:

- ``native``: XLA's einsum softmax, the whole [T, T] score matrix per head;
- ``chunked``: the online softmax, which never holds [T, T] and skips the key blocks past the diagonal;
- ``chunked-noskip``: the same kernel and chunks with ``skip_causal_blocks: false``, scanning and masking every
  key block: the baseline the skipping is measured against;
- ``chunked-1024``: skipping with the non-causal table's 1024-row chunks instead of the causal default
  (attention/chunk_sizes.py's CAUSAL_SIZES), whose coarser blocks skip less;
- ``chunked-2heads``: the causal chunks with two query heads (one k/v head) per step instead of every head at once
  (attention/chunk_sizes.py's CAUSAL_SIZES), as the non-causal table's one head per step rounds to;
- ``flash``: whatever kernel the flash backend maps a causal grouped case to on this platform.

    python benchmarks/long_context_decoder.py [--quick] [--lengths 4096,16384,32768] [--backends ...]
                                              [--dtype float32] [--name long_context_decoder]

One layer is timed per backend and length, each in its own subprocess under an address-space cap
(benchmarks/long_context.py's ``spawn``); the model's attention is 28 times that layer. A case whose native
scores would not fit the cap is skipped with the reason. The expensive cases are timed once: a call at 32k
tokens takes minutes on two CPU cores.
"""

from __future__ import annotations

import json
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common, long_context

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28  # Qwen3-0.6B (Qwen3-Embedding-0.6B)
DEFAULT_LENGTHS, QUICK_LENGTHS = (4096, 16384, 32768), (512, 1024)
VARIANTS = {
    "native": ("native", None),
    "chunked": ("chunked", None),
    "chunked-noskip": ("chunked", {"skip_causal_blocks": False}),
    "chunked-1024": ("chunked", {"query_chunk": 1024, "key_chunk": 1024}),
    "chunked-2heads": ("chunked", {"heads_per_step": 2}),
    "flash": ("flash", None),
}
GB = 2**30


def run_case(backend: str, length: int, repeats: int, time_per_case: float, dtype: str = "float32") -> dict:
    """In the child: compile one causal grouped layer's attention ahead of time, then time calls (best kept)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from docbeam import attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, length, HEADS, HEAD_DIM), np.float32), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, length, KV_HEADS, HEAD_DIM), np.float32), dtype) for _ in range(2))
    lengths = jnp.asarray([length], jnp.int32)
    name, raw_options = VARIANTS[backend]
    chosen = attention.get(name)
    options = chosen.parse_options(raw_options)
    case = attention.AttentionCase(
        jax.default_backend(), dtype, length, HEADS, HEAD_DIM, causal=True, num_kv_heads=KV_HEADS
    )
    support = chosen.supports(case, options)
    if not support.ok:
        return {"backend": backend, "length": length, "status": f"refused: {support.reason}"}
    fn = chosen.bind(options)
    attend = jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=lengths, scale=HEAD_DIM**-0.5, causal=True))
    return {
        "backend": backend,
        "length": length,
        "status": "ok",
        "kernel": support.kernel,
        **common.time_compiled(attend, (q, k, v), repeats, time_per_case),
    }


def native_scores_gb(length: int) -> float:
    """native holds float32 scores and their exponentials for every query head: 2 × N·T² × 4 bytes."""
    return 2 * HEADS * length * length * 4 / GB


def ratios(results: list[dict], lengths) -> list[dict]:
    """Per length: chunked-noskip ÷ chunked (what skipping the blocks past the diagonal buys), chunked-1024 ÷
    chunked (what the causal layers' smaller chunks buy) and native ÷ each other backend, in time and peak
    memory."""
    ok = {(r["backend"], r["length"]): r for r in results if r["status"] == "ok"}

    def ratio(a, b, key):
        return round(a[key] / b[key], 2) if a and b and b[key] else None

    rows = []
    for length in lengths:
        native, chunked = ok.get(("native", length)), ok.get(("chunked", length))
        row = {
            "length": length,
            "skipping_speedup": ratio(ok.get(("chunked-noskip", length)), chunked, "seconds"),
            "coarse_over_chunked": ratio(ok.get(("chunked-1024", length)), chunked, "seconds"),
            "two_heads_over_chunked": ratio(ok.get(("chunked-2heads", length)), chunked, "seconds"),
        }
        for backend in ("chunked", "chunked-noskip", "chunked-1024", "flash"):
            row[f"native_over_{backend}"] = ratio(native, ok.get((backend, length)), "seconds")
            row[f"{backend}_memory_over_native"] = ratio(ok.get((backend, length)), native, "memory_gb")
        rows.append(row)
    return rows


def target_verdict(rows: list[dict], wanted: float = 1.7) -> dict:
    """Issue target: causal block skipping at least ``wanted`` × chunked without it, at every measured length
    of 4k tokens or more."""
    measured = {r["length"]: r["skipping_speedup"] for r in rows if r["length"] >= 4096 and r["skipping_speedup"]}
    verdict = "not measured" if not measured else ("PASS" if min(measured.values()) >= wanted else "FAIL")
    line = (
        f"target: chunked with causal block skipping >= {wanted:g}x chunked without it: "
        + (", ".join(f"{n}: {s:.2f}x" for n, s in sorted(measured.items())) or "—")
        + f" {verdict}"
    )
    return {"wanted": wanted, "speedups": measured, "verdict": verdict, "line": line}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(run_case(**json.loads(sys.argv[2]))))
        return 0
    p = long_context.case_parser(__doc__, DEFAULT_LENGTHS, QUICK_LENGTHS, timeout=1500.0)
    p.add_argument("--backends", default=",".join(VARIANTS), help="of " + ", ".join(VARIANTS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="q, k and v's dtype")
    p.add_argument("--name", default="long_context_decoder", help="results file name (default %(default)s)")
    args = p.parse_args(argv)
    lengths = long_context.lengths_of(args, DEFAULT_LENGTHS, QUICK_LENGTHS)
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(VARIANTS))
    if unknown:
        p.error(f"--backends: unknown {unknown}; choose from {sorted(VARIANTS)}")
    info = common.machine(with_jax=False)
    common.print_machine("long context: Qwen3-0.6B attention, causal and grouped", info)
    print(
        f"{HEADS} query heads over {KV_HEADS} k/v heads x {HEAD_DIM}, {args.dtype}, batch 1, {LAYERS} causal layers; "
        f"cap {args.mem_cap_gb:g} GB per case\n",
        flush=True,
    )
    results, started = [], time.perf_counter()
    for length in lengths:
        for backend in backends:
            case = {"backend": backend, "length": length, "repeats": args.repeats, "time_per_case": args.time_per_case,
                    "dtype": args.dtype}  # fmt: skip
            results.append(
                long_context.spawn(case, args.mem_cap_gb, args.timeout, script=__file__, native_gb=native_scores_gb)
            )
            print(f"  {results[-1]}", flush=True)
    rows = ratios(results, lengths)
    print(f"\n## The model's attention ({LAYERS} causal layers of 16 query heads over 8 k/v heads)\n")
    print(
        common.table(
            ["backend", "tokens", "kernel", "status", "seconds", "peak RSS growth GB", "XLA temp GB"],
            [
                [
                    r["backend"],
                    r["length"],
                    r.get("kernel", "—"),
                    r["status"],
                    LAYERS * r["seconds"] if "seconds" in r else None,
                    r.get("memory_gb"),
                    r.get("xla_temp_gb"),
                ]
                for r in results
            ],
        )
    )
    print("\n## Ratios\n")
    print(
        common.table(
            [
                "tokens",
                "skipping speed-up",
                "chunked-1024 ÷ chunked",
                "chunked-2heads ÷ chunked",
                "native ÷ chunked",
                "native ÷ flash",
                "chunked memory ÷ native",
            ],
            [
                [
                    r["length"],
                    r["skipping_speedup"],
                    r["coarse_over_chunked"],
                    r["two_heads_over_chunked"],
                    r["native_over_chunked"],
                    r["native_over_flash"],
                    r["chunked_memory_over_native"],
                ]
                for r in rows
            ],
        )
    )
    target = target_verdict(rows)
    print(f"\n{target['line']}\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    common.write_results(
        args,
        args.name,
        {
            "machine": info,
            "dtype": args.dtype,
            "lengths": list(lengths),
            "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "layers": LAYERS, "causal": True},
            "results": results,
            "ratios": rows,
            "target": target,
        },
    )
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
