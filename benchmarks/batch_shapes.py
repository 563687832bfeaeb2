"""docbeam's encoder under several batch shapes (bucket sets × tokens_per_batch), timed side by side on the
same windows: what ``configs/local.yaml``'s ``batching`` is chosen by.

    python benchmarks/batch_shapes.py [--quick] [--corpus sample|heldout|PATH] [--docs N]
                                      [--settings "128,256@2048;128,256@1024"]

Each setting is ``buckets@tokens_per_batch``. Each is timed as ``benchmarks/encoder.py`` times docbeam
(windows → ``batch_windows`` → ``EncoderRuntime.encode``, every shape compiled before timing), and their timed
passes take turns (best of ``--repeats`` each), so the VM's drift moves all of them alike. Tokens/s counts
real tokens: a setting pays for its padding and for its shapes' speed per token (smaller batches stay in
cache; shorter rows pay less attention). Compilation is reported, not timed into the rate: a whole run pays
it once per shape, partly in the background.
"""

from __future__ import annotations

import argparse
import os
import sys

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from benchmarks import encoder as encoder_bench
from benchmarks.sides import alternate

DEFAULT_SETTINGS = "128,256@2048;128,256@1024;128,256@512;256@1024;64,128,256@1024"


def parse_setting(text: str) -> tuple[tuple[int, ...], int]:
    try:
        buckets, tokens = text.split("@")
        return tuple(int(b) for b in buckets.split(",")), int(tokens)
    except ValueError:
        raise SystemExit(f"--settings: {text!r} is not buckets@tokens_per_batch, e.g. 128,256@1024") from None


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--corpus", default="sample", help="as benchmarks/encoder.py's --corpus")
    p.add_argument("--docs", type=int, help="first N documents (default: all; --quick: 32)")
    p.add_argument(
        "--settings", default=DEFAULT_SETTINGS, help="';'-separated buckets@tokens_per_batch (default: %(default)s)"
    )
    p.add_argument("--packing", choices=("on", "off"), default="on")
    p.add_argument(
        "--long-documents",
        choices=("truncate", "window"),
        default="window",
        help="window (default): every window, as `docbeam run` on configs/local.yaml encodes them",
    )
    p.add_argument("--repeats", type=int, help="timed passes per setting, best kept (default 3; --quick 1)")
    p.add_argument("--model", default=common.DEFAULT_MODEL)
    args = p.parse_args(argv)

    from docbeam.config import load

    local = load(common.LOCAL_CONFIG)
    args.settings = [parse_setting(s) for s in args.settings.split(";") if s]
    args.configured = (tuple(local.batching.buckets), local.batching.tokens_per_batch)
    args.docs = args.docs or (32 if args.quick else None)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.stride = local.tokenize.stride
    return args


def side_args(args, buckets: tuple[int, ...], tokens_per_batch: int) -> argparse.Namespace:
    """What ``encoder.docbeam_side`` reads, for one setting."""
    return argparse.Namespace(
        buckets=buckets,
        tokens_per_batch=tokens_per_batch,
        packing=args.packing == "on",
        dtype="float32",
        backend="native",
        attention_options={},
        model=args.model,
        long_documents=args.long_documents,
        stride=args.stride,
        repeats=args.repeats,
    )


def label(buckets, tokens_per_batch) -> str:
    return f"[{', '.join(map(str, buckets))}] @ {tokens_per_batch}"


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine()
    common.print_machine("batch shapes: docbeam's encoder per bucket set × tokens_per_batch", info)
    from docbeam.models.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(args.model)
    source, docs = common.corpus_documents(args, checkpoint.folder)
    print(
        f"{len(docs)} documents from {os.path.relpath(source, common.REPO)}, long documents "
        f"{args.long_documents}, packing {args.packing}, best of {args.repeats}; configs/local.yaml has "
        f"{label(*args.configured)}\n",
        flush=True,
    )

    sides = [
        encoder_bench.docbeam_side(side_args(args, b, t), docs, checkpoint.folder, checkpoint.settings)
        for b, t in args.settings
    ]
    results = alternate(*sides)
    base = results[0]["tokens_per_s"]
    rows, out = [], []
    for (buckets, tokens_per_batch), r in zip(args.settings, results):
        r.pop("vectors")
        r.update(
            buckets=list(buckets),
            tokens_per_batch=tokens_per_batch,
            padding_efficiency=r["real_tokens"] / r["padded_tokens"],
            configured=(buckets, tokens_per_batch) == args.configured,
        )
        out.append(r)
        rows.append(
            [
                label(buckets, tokens_per_batch) + (" (configured)" if r["configured"] else ""),
                len(r["shapes"]),
                r["batches"],
                r["padded_tokens"],
                r["padding_efficiency"],
                r["compile_s"],
                r["best_s"],
                r["tokens_per_s"],
                common.ratio(r["tokens_per_s"], base),
            ]
        )
    print("## Encoder alone per batch shape (float32, native)\n")
    print(
        common.table(
            [
                "buckets @ tokens_per_batch",
                "shapes",
                "batches",
                "padded tokens",
                "padding efficiency",
                "compile s",
                f"best of {args.repeats} s",
                "tokens/s",
                "÷ first",
            ],
            rows,
        )
    )
    print("\n## Per shape\n")
    print(
        common.table(
            ["setting", "bucket", "rows", "batches", "steady ms/batch", "ms per 1,000 padded tokens"],
            [
                [
                    label(r["buckets"], r["tokens_per_batch"]),
                    s["bucket"],
                    s["rows"],
                    s["batches"],
                    s["steady_ms"],
                    s["steady_ms"] * 1000 / (s["bucket"] * s["rows"]),
                ]
                for r in out
                for s in r["shapes"]
            ],
        )
    )
    corpus = "" if args.corpus == "sample" else f"-{os.path.basename(args.corpus).split('.')[0]}{len(docs)}"
    common.write_results(
        args,
        "batch_shapes" + corpus,
        {
            "benchmark": "batch_shapes",
            "args": {**vars(args), "settings": [list(s) for s in args.settings]},
            "machine": info,
            "docs": len(docs),
            "results": out,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
