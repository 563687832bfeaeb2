"""Incremental runs: a full run vs runs that reuse it with 0%, 10% and 50% of the texts changed.

    python benchmarks/incremental.py [--quick] [--docs 400] [--copies 1] [--churn 0,10,50]

Every run is a whole ``run_job`` in this process (the DirectRunner) on the same machine: first a warm-up
run (its compilations fill the persistent cache, so no timed run pays for them more than another), then
the timed full run, then one incremental run per churn level reusing the full run's output. Printed: wall
time and encoder time (Σ compute_ms − compile_ms of the timing records: the device work, without the
compilations each run's new process-level runtime loads from the cache) of each, and their ratios to the
full run.
"""

from __future__ import annotations

import os
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common


def churned(docs, percent: int):
    """The same documents with ``percent`` of the texts changed (spread evenly over the corpus)."""
    from docbeam.pipeline.records import Document

    step = 100 / percent if percent else None
    changed = {int(i * step) for i in range(round(len(docs) * percent / 100))} if step else set()
    return [
        Document(d.id, d.text + " (revised)" if i in changed else d.text, d.source, d.line) for i, d in enumerate(docs)
    ], len(changed)


def timed_run(corpus: str, output: str, model: str, reuse_from: str | None = None) -> dict:
    from docbeam import config
    from docbeam.pipeline.driver.run import run_job

    overrides = [f"input.path={corpus}", f"output.path={output}", f"model.path={model}", "runner.progress_seconds=0"]
    if reuse_from:
        overrides.append(f"input.reuse_from={reuse_from}")
    cfg = config.load(common.LOCAL_CONFIG, overrides)
    started = time.perf_counter()
    summary = run_job(cfg)
    wall = time.perf_counter() - started
    timing = common.read_timing(output)
    encoder_s = sum(t["compute_ms"] - t["compile_ms"] for t in timing) / 1e3
    compile_s = sum(t["compile_ms"] for t in timing) / 1e3
    return {
        "wall_s": round(wall, 2),
        "encoder_s": round(encoder_s, 2),
        "compile_s": round(compile_s, 2),
        "tokens_encoded": sum(t["real_tokens"] for t in timing),
        "padded_tokens_encoded": sum(t["padded_tokens"] for t in timing),
        "docs_encoded": summary["docs_encoded"],
        "docs_reused": summary["docs_reused"],
        "reused_token_share": summary["reused_token_share"],
    }


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--docs", type=int, default=400, help="documents of the sample corpus (default 400)")
    parser.add_argument(
        "--copies",
        type=int,
        default=1,
        help="repeat the documents under new ids, for a corpus whose changed share fills batches",
    )
    parser.add_argument("--churn", default="0,10,50", help="percent of texts changed, comma-separated")
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    from docbeam.pipeline.records import Document

    sample = common.read_documents(common.SAMPLE, 40 if args.quick else args.docs)
    docs = [
        Document(f"{d.id}#{copy}" if copy else d.id, d.text, d.source, d.line)
        for copy in range(args.copies)
        for d in sample
    ]
    info = common.machine()
    common.print_machine(f"incremental runs: {len(docs)} documents, {args.model}", info)

    rows, results = [], {"machine": info, "documents": len(docs), "model": args.model, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="docbeam-incremental-") as work:

        def corpus(name, documents):
            folder = os.path.join(work, name)
            os.makedirs(folder)
            return common.write_subset(documents, folder)

        base = corpus("base", docs)
        timed_run(base, os.path.join(work, "warm-up"), args.model)
        full = timed_run(base, os.path.join(work, "full"), args.model)
        results["runs"]["full"] = full
        rows.append(
            [
                "full run",
                len(docs),
                0,
                full["tokens_encoded"],
                full["padded_tokens_encoded"],
                full["wall_s"],
                1.0,
                full["encoder_s"],
                1.0,
            ]
        )
        for percent in (int(p) for p in args.churn.split(",")):
            changed_docs, changed = churned(docs, percent)
            run = timed_run(
                corpus(f"churn-{percent}", changed_docs),
                os.path.join(work, f"inc-{percent}"),
                args.model,
                reuse_from=os.path.join(work, "full"),
            )
            assert run["docs_encoded"] == changed, f"{percent}%: encoded {run['docs_encoded']}, changed {changed}"
            run.update(
                churn_percent=percent,
                wall_ratio=common.ratio(run["wall_s"], full["wall_s"]),
                encoder_ratio=common.ratio(run["encoder_s"], full["encoder_s"]),
            )
            results["runs"][f"incremental_{percent}"] = run
            rows.append(
                [
                    f"incremental, {percent}% changed",
                    run["docs_encoded"],
                    run["docs_reused"],
                    run["tokens_encoded"],
                    run["padded_tokens_encoded"],
                    run["wall_s"],
                    run["wall_ratio"],
                    run["encoder_s"],
                    run["encoder_ratio"],
                ]
            )
    print(
        common.table(
            [
                "run",
                "docs encoded",
                "docs reused",
                "tokens encoded",
                "padded tokens",
                "wall s",
                "÷ full",
                "encoder s",
                "÷ full",
            ],
            rows,
        )
    )
    common.write_results(args, "incremental" + (f"-copies{args.copies}" if args.copies > 1 else ""), results)


if __name__ == "__main__":
    main()
