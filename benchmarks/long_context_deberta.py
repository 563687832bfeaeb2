"""Long context for DeBERTa: the disentangled attention of a DeBERTa-v3-base shape (12 layers of 12 heads x 64,
content→position and position→content terms from a 512-row relative table, v3's log buckets: position_buckets
256, max_relative_positions 512; float32, batch 1) at 2k and 8k tokens, native beside chunked:

- ``native``: the whole [T, T] scores per head, plus both relative terms gathered to [T, T] each;
- ``chunked``: the online softmax with the terms built per block from the table rows the block reaches
  (attention/relative.py), so nothing [T, T] exists;
- ``flash`` (not by default): on CPU it runs the same chunked kernel.

    python benchmarks/long_context_deberta.py [--quick] [--lengths 2048,8192] [--backends native,chunked]

One layer is timed per backend and length, each in its own subprocess under an address-space cap
(benchmarks/long_context.py's ``spawn``); the model's attention is 12 times that layer (its projections and MLPs
are not timed: they are the same for both backends). Memory is the child's peak RSS growth once the inputs exist
(compilation included) and XLA's count of the compiled layer's temporary buffers.
"""

from __future__ import annotations

import json
import sys
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common, long_context

HEADS, HEAD_DIM, LAYERS, BUCKETS, MAX_RELATIVE = 12, 64, 12, 256, 512  # microsoft/deberta-v3-base
DEFAULT_LENGTHS, QUICK_LENGTHS = (2048, 8192), (256, 512)
GB = 2**30


def relative_positions(seed: int = 0):
    """v3-base's row function (the family's own) over random projected tables of 2 · BUCKETS rows."""
    import jax.numpy as jnp
    import numpy as np

    from docbeam.attention.relative import RelativePositions
    from docbeam.models.families import deberta

    config = deberta.Config(
        vocab_size=128100,
        hidden_size=HEADS * HEAD_DIM,
        num_layers=LAYERS,
        num_heads=HEADS,
        intermediate_size=3072,
        max_position=512,
        position="relative",
        position_buckets=BUCKETS,
        max_relative_positions=MAX_RELATIVE,
    )
    rng = np.random.default_rng(seed)
    key_RxNxH, query_RxNxH = (
        jnp.asarray(rng.standard_normal((2 * BUCKETS, HEADS, HEAD_DIM), np.float32)) for _ in range(2)
    )
    return RelativePositions(deberta.relative_row(config), key_RxNxH, query_RxNxH)


def run_case(backend: str, length: int, repeats: int, time_per_case: float) -> dict:
    """In the child: compile one layer's disentangled attention ahead of time, then time calls (best kept)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from docbeam import attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, length, HEADS, HEAD_DIM), np.float32)) for _ in range(3))
    lengths, relative = jnp.asarray([length], jnp.int32), relative_positions()
    chosen = attention.get(backend)
    case = attention.AttentionCase(jax.default_backend(), "float32", length, HEADS, HEAD_DIM, relative_positions=True)
    support = chosen.refusal(case) or chosen.supports(case, chosen.parse_options(None))
    if not support.ok:
        return {"backend": backend, "length": length, "status": f"refused: {support.reason}"}
    fn = chosen.bind()
    scale = 1.0 / (3 * HEAD_DIM) ** 0.5  # c2p and p2c: 1/sqrt(d (1 + 2))
    attend = jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=lengths, scale=scale, relative_positions=relative))
    return {
        "backend": backend,
        "length": length,
        "status": "ok",
        "kernel": support.kernel,
        **common.time_compiled(attend, (q, k, v), repeats, time_per_case),
    }


def native_gb(length: int) -> float:
    """native's temporaries: about two float32 [N, T, T] arrays (XLA's count at 8k: 6.5 GB)."""
    return 2 * HEADS * length * length * 4 / GB


def growth(results: list[dict], lengths) -> dict:
    """Per backend: how much its peak RSS growth and XLA temporaries grow from the shortest to the longest length,
    beside (longest / shortest)², what O(T²) memory would do."""
    ok = {(r["backend"], r["length"]): r for r in results if r["status"] == "ok"}
    short, long = min(lengths), max(lengths)
    out = {"quadratic": round((long / short) ** 2, 2), "from": short, "to": long}
    for backend in sorted({r["backend"] for r in results}):
        a, b = ok.get((backend, short)), ok.get((backend, long))
        out[backend] = {
            key: round(b[key] / a[key], 2) if a and b and a[key] else None for key in ("memory_gb", "xla_temp_gb")
        }
    return out


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(run_case(**json.loads(sys.argv[2]))))
        return 0
    p = long_context.case_parser(__doc__, DEFAULT_LENGTHS, QUICK_LENGTHS, timeout=900.0)
    p.add_argument("--backends", default="native,chunked")
    args = p.parse_args(argv)
    lengths = long_context.lengths_of(args, DEFAULT_LENGTHS, QUICK_LENGTHS)
    backends = args.backends.split(",")
    info = common.machine(with_jax=False)
    common.print_machine("long context: DeBERTa-v3-base disentangled attention", info)
    print(
        f"{HEADS} heads x {HEAD_DIM}, c2p and p2c over {2 * BUCKETS} relative rows, float32, batch 1, {LAYERS} "
        f"layers; cap {args.mem_cap_gb:g} GB per case\n",
        flush=True,
    )
    results, started = [], time.perf_counter()
    for length in lengths:
        for backend in backends:
            case = {"backend": backend, "length": length, "repeats": args.repeats, "time_per_case": args.time_per_case}
            results.append(
                long_context.spawn(case, args.mem_cap_gb, args.timeout, script=__file__, native_gb=native_gb)
            )
            print(f"  {results[-1]}", flush=True)
    ok = {(r["backend"], r["length"]): r for r in results if r["status"] == "ok"}
    print(f"\n## The model's attention ({LAYERS} layers)\n")
    print(
        common.table(
            ["backend", "tokens", "kernel", "status", "seconds", "one layer ms", "peak RSS growth GB", "XLA temp GB"],
            [
                [
                    r["backend"],
                    r["length"],
                    r.get("kernel", "—"),
                    r["status"],
                    LAYERS * r["seconds"] if "seconds" in r else None,
                    1000 * r["seconds"] if "seconds" in r else None,
                    r.get("memory_gb"),
                    r.get("xla_temp_gb"),
                ]
                for r in results
            ],
        )
    )
    speedups = {
        n: round(ok[("native", n)]["seconds"] / ok[("chunked", n)]["seconds"], 2)
        for n in lengths
        if ("native", n) in ok and ("chunked", n) in ok
    }
    grown = growth(results, lengths)
    print("\n## native ÷ chunked, and memory growth\n")
    print(common.table(["tokens", "native ÷ chunked time"], [[n, s] for n, s in speedups.items()]))
    print(
        f"\nfrom {grown['from']} to {grown['to']} tokens (T² grows {grown['quadratic']}x): "
        + "; ".join(
            f"{b} peak RSS growth x{g['memory_gb']}, XLA temp x{g['xla_temp_gb']}"
            for b, g in grown.items()
            if isinstance(g, dict)
        )
    )
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    common.write_results(
        args,
        "long_context_deberta",
        {
            "machine": info,
            "lengths": list(lengths),
            "shape": {
                "heads": HEADS,
                "head_dim": HEAD_DIM,
                "layers": LAYERS,
                "position_buckets": BUCKETS,
                "max_relative_positions": MAX_RELATIVE,
                "pos_att_type": ["c2p", "p2c"],
            },
            "results": results,
            "native_over_chunked": speedups,
            "memory_growth": grown,
        },
    )
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
