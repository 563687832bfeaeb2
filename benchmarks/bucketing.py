"""Padding efficiency (real ÷ padded tokens) of docbeam's bucketing vs pad-to-max vs sorted fixed-size
batches, on the sample corpus' real windows and on a long-tailed synthetic length distribution.

    python benchmarks/bucketing.py [--quick] [--buckets 32,64,128,256] [--tokens-per-batch 8192]

- docbeam: ``pipeline.tools.bucket_advisor.padding_efficiency`` with the configured buckets and tokens_per_batch
  (a partial batch is padded with empty rows to its bucket's fixed shape).
- docbeam packed: the same with ``batching.packing: true`` (several windows per row, segment ids), as
  ``BucketBatches`` makes them from the windows in this order.
- planned: the buckets ``pipeline.tools.bucket_advisor.propose_buckets`` proposes for these lengths (same budget, at most
  as many buckets as configured), scored the same way.
- pad-to-max: every batch ``tokens_per_batch ÷ max_len`` rows of ``max_len`` tokens: one shape.
- sorted fixed-size: lengths sorted, batches of that same row count, each padded to its longest window;
  the last batch keeps its real rows (dynamic shapes, as sentence-transformers batches), so every distinct
  batch length is one more compilation under jit.
"""

from __future__ import annotations

import sys

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--docs", type=int, help="first N sample documents (default: all; --quick: 100)")
    p.add_argument("--synthetic-windows", type=int, help="default 20000; --quick 2000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--median", type=float, default=64.0, help="synthetic lognormal median length (default %(default)s)")
    p.add_argument("--sigma", type=float, default=1.0, help="synthetic lognormal sigma (default %(default)s)")
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--buckets", help="comma-separated (default: configs/local.yaml's)")
    p.add_argument("--tokens-per-batch", type=int, help="default: configs/local.yaml's")
    p.add_argument("--max-buckets", type=int, help="for propose_buckets (default: as many as --buckets)")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)

    from docbeam.config import load

    local = load(common.LOCAL_CONFIG)
    args.buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else local.batching.buckets
    args.tokens_per_batch = args.tokens_per_batch or local.batching.tokens_per_batch
    args.max_buckets = args.max_buckets or len(args.buckets)
    args.docs = args.docs or (100 if args.quick else None)
    args.synthetic_windows = args.synthetic_windows or (2000 if args.quick else 20000)
    args.tokenize = local.tokenize
    return args


def sample_lengths(args) -> tuple[list[int], int]:
    from docbeam.models.checkpoint import load_tokenizer, open_checkpoint
    from docbeam.pipeline.stages.tokenize import windows_for

    checkpoint = open_checkpoint(args.model)
    window_len = checkpoint.settings.max_seq_len
    docs = common.read_documents(common.SAMPLE, args.docs)
    windows = windows_for(docs, load_tokenizer(checkpoint.folder), window_len=window_len, config=args.tokenize)
    return [w.length for w in windows], window_len


def synthetic_lengths(n: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """Lognormal lengths clipped to [lo, hi]: most windows short, a long tail, and a spike at hi where
    long documents are cut into full windows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi)]


def bucketed(lengths, buckets, tokens_per_batch, packing: bool = False) -> dict:
    from docbeam.pipeline.tools.bucket_advisor import batches_per_bucket, padded_tokens

    batches = batches_per_bucket(lengths, tuple(buckets), tokens_per_batch, packing)
    padded = padded_tokens(lengths, tuple(buckets), tokens_per_batch, packing)
    return {
        "buckets": list(buckets),
        "efficiency": sum(lengths) / padded,
        "padded_tokens": padded,
        "batches": sum(batches.values()),
        "shapes": len(batches),
        "rows": f"{tokens_per_batch} ÷ bucket",
    }


def pad_to_max(lengths, max_len, rows) -> dict:
    batches = -(-len(lengths) // rows)
    padded = batches * rows * max_len
    return {
        "buckets": [max_len],
        "efficiency": sum(lengths) / padded,
        "padded_tokens": padded,
        "batches": batches,
        "shapes": 1,
        "rows": rows,
    }


def sorted_fixed(lengths, rows) -> dict:
    ordered = sorted(lengths)
    batches = [ordered[i : i + rows] for i in range(0, len(ordered), rows)]
    padded = sum(len(b) * max(b) for b in batches)
    return {
        "buckets": None,
        "efficiency": sum(lengths) / padded,
        "padded_tokens": padded,
        "batches": len(batches),
        "shapes": len({(len(b), max(b)) for b in batches}),
        "rows": rows,
    }


def compare(lengths, max_len, args) -> dict:
    from docbeam.pipeline.stages.packer import rows_for
    from docbeam.pipeline.tools.bucket_advisor import propose_buckets

    rows = rows_for(max_len, args.tokens_per_batch)
    out = {
        "docbeam": bucketed(lengths, args.buckets, args.tokens_per_batch),
        "docbeam packed": bucketed(lengths, args.buckets, args.tokens_per_batch, packing=True),
    }
    planned = propose_buckets(
        lengths, max_len=max_len, tokens_per_batch=args.tokens_per_batch, max_buckets=args.max_buckets
    )
    out["planned"] = bucketed(lengths, planned, args.tokens_per_batch)
    out["pad-to-max"] = pad_to_max(lengths, max_len, rows)
    out["sorted fixed-size"] = sorted_fixed(lengths, rows)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine(with_jax=False)
    common.print_machine("bucketing: padding efficiency", info)
    import numpy as np

    real, window_len = sample_lengths(args)
    synthetic = synthetic_lengths(args.synthetic_windows, args.median, args.sigma, args.min_len, window_len, args.seed)
    datasets = {
        f"sample corpus ({len(real)} windows)": real,
        f"synthetic lognormal (median {args.median:g}, sigma {args.sigma:g}, clipped [{args.min_len}, {window_len}], "
        f"{len(synthetic)} windows, seed {args.seed})": synthetic,
    }
    print(
        f"buckets {list(args.buckets)}, tokens_per_batch {args.tokens_per_batch}, window {window_len}, "
        f"propose_buckets max_buckets {args.max_buckets}\n"
    )
    results = {}
    for name, lengths in datasets.items():
        pct = np.percentile(lengths, [50, 90, 99])
        print(
            f"## {name}\n\nlengths: mean {np.mean(lengths):.1f}, p50 {pct[0]:.0f}, p90 {pct[1]:.0f}, "
            f"p99 {pct[2]:.0f}, at {window_len}: {np.mean(np.array(lengths) == window_len):.1%}\n"
        )
        rows = compare(lengths, window_len, args)
        base = rows["docbeam"]["efficiency"]
        print(
            common.table(
                [
                    "strategy",
                    "buckets",
                    "rows per batch",
                    "batches",
                    "padded tokens",
                    "padding efficiency",
                    "÷ docbeam",
                    "distinct shapes",
                ],
                [
                    [
                        label,
                        r["buckets"],
                        r["rows"],
                        r["batches"],
                        r["padded_tokens"],
                        r["efficiency"],
                        r["efficiency"] / base,
                        r["shapes"],
                    ]
                    for label, r in rows.items()
                ],
            )
        )
        print()
        results[name] = {"real_tokens": sum(lengths), "windows": len(lengths), "strategies": rows}

    common.write_results(
        args,
        "bucketing",
        {
            "benchmark": "bucketing",
            "args": {k: v for k, v in vars(args).items() if k != "tokenize"},
            "tokenize": args.tokenize.model_dump(),
            "machine": info,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
