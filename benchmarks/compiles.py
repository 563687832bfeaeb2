"""Does the pipeline compile the encoder exactly once per (bucket, rows) shape? Runs the job on the sample
corpus and compares summary.json's ``compiles``, the compilations jax.monitoring saw in this process, and
the distinct shapes in ``timing/``. Exits 1 on FAIL.

    python benchmarks/compiles.py [--quick] [--real] [--docs N] [--set key.path=value ...]

By default the model is a tiny random BERT in the real checkpoint format (``tiny_bert``: two layers of width 32,
all-MiniLM-L6-v2's tokenizer, window 128); ``--real`` uses all-MiniLM-L6-v2.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common


def tiny_bert(folder: str) -> str:
    """A random two-layer BERT of width 32, saved by transformers, with the default model's tokenizer: what
    compiles is counted here, not what it computes, so a tiny model keeps each compilation cheap."""
    import torch
    import transformers

    from docbeam.models.checkpoint import TOKENIZER_FILES, resolve_dir

    source = resolve_dir(common.DEFAULT_MODEL)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(source, name), folder)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128, "do_lower_case": False}, f)
    return folder


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--real", action="store_true", help="all-MiniLM-L6-v2 instead of the tiny random checkpoint")
    p.add_argument("--docs", type=int, help="first N sample documents (default: all; --quick: 60)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides on configs/local.yaml, e.g. attention.backend=chunked",
    )
    args = p.parse_args(argv)
    args.docs = args.docs or (60 if args.quick else None)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    info = common.machine()
    common.print_machine("compiles: one encoder compilation per (bucket, rows) shape", info)
    from docbeam.config import load
    from docbeam.pipeline.driver.run import run_job
    from docbeam.pipeline.telemetry.observe import CompileWatch

    watch = CompileWatch.get()  # the process's own: the DirectRunner's in-process workers report to it too
    with tempfile.TemporaryDirectory(prefix="docbeam-compiles-") as tmp:
        model = common.DEFAULT_MODEL
        if not args.real:
            model = tiny_bert(os.path.join(tmp, "tiny"))
        docs = common.read_documents(common.SAMPLE, args.docs)
        out = os.path.join(tmp, "out")
        overrides = [
            f"input.path={common.write_subset(docs, tmp)}",
            f"output.path={out}",
            f"model.path={model}",
            "runner.progress_seconds=0",
            *args.set,
        ]
        t0 = time.perf_counter()
        summary = run_job(load(common.LOCAL_CONFIG, overrides))
        wall = time.perf_counter() - t0
        timing = common.read_timing(out)

    per_shape = collections.defaultdict(lambda: {"batches": 0, "compiled": 0})
    for r in timing:
        key = (r["worker"], r["attention_backend"], r["bucket_len"], r["rows"])
        per_shape[key]["batches"] += 1
        per_shape[key]["compiled"] += int(r["compiled"])
    workers = {key[0] for key in per_shape}
    # Shapes compiled before the first batch (every bucket's, whether or not a batch came) count too.
    seen = {(backend, bucket, rows) for _, backend, bucket, rows in per_shape}
    ahead = {
        (name.split(",")[1], int(name.split("x")[1].split(",")[0]), int(name.split("x")[0]))
        for name in summary.get("startup", {}).get("compiles_s", {})
        if "(at its batch)" not in name
    }
    expected = len(per_shape) + len(ahead - seen)
    checks = {
        "summary.json compiles": summary["compiles"],
        "jax.monitoring lowerings (this process, pipeline.telemetry.observe.CompileWatch)": watch.count,
    }
    verdicts = {name: value == expected for name, value in checks.items()}
    passed = all(verdicts.values())

    print(
        f"{len(docs)} documents, model {'all-MiniLM-L6-v2' if args.real else 'tiny random BERT'}, "
        f"{len(timing)} batches on {len(workers)} worker(s), job {wall:.1f} s\n"
    )
    print("## Shapes in timing/\n")
    print(
        common.table(
            ["worker", "backend", "bucket", "rows", "batches", "batches that compiled"],
            [[*key, v["batches"], v["compiled"]] for key, v in sorted(per_shape.items())],
        )
    )
    print("\n## Compilations vs distinct shapes\n")
    print(
        common.table(
            ["count", "value", "distinct (worker, backend, bucket, rows)", "verdict"],
            [[name, value, expected, "PASS" if verdicts[name] else "FAIL"] for name, value in checks.items()],
        )
    )
    recompiled = [key for key, v in per_shape.items() if v["compiled"] > 1]
    if recompiled:
        print(f"\nshapes compiled more than once: {sorted(recompiled)}")
    print(f"\n{'PASS' if passed else 'FAIL'}")
    common.write_results(
        args,
        "compiles-real" if args.real else "compiles",
        {
            "benchmark": "compiles",
            "args": vars(args),
            "machine": info,
            "docs": len(docs),
            "batches": len(timing),
            "distinct_shapes": expected,
            "checks": checks,
            "passed": passed,
            "shapes": [
                {"worker": k[0], "backend": k[1], "bucket": k[2], "rows": k[3], **v} for k, v in per_shape.items()
            ],
            "recompiled": recompiled,
        },
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
