"""docbeam's encoder on Python 3.11 (jax 0.10.2, flax 0.12.8) beside Python 3.13 (jax 0.11.2, flax 0.12.12):
what pyproject's two sets of pins cost or gain on this CPU.

    python benchmarks/pythons.py [--quick] [--rounds 3] [--corpus heldout] [--docs 1800] [--dtypes float32,bfloat16]
                                 [--python311 .venv/bin/python] [--python313 .venv313/bin/python]

Two interpreters cannot share a process, so each measurement is a child: ``benchmarks/encoder.py --skip-pipeline
--st-device skip`` (the encoder alone, as the pipeline batches it: the same windows, buckets and shapes on both)
under one venv's Python. The children take turns, Python by Python and dtype by dtype, the order reversed every
round, so this VM's drift (±20% within minutes) moves both Pythons alike; each child's one timed pass follows its own
warm-up, and the best of the rounds is kept per Python and dtype, every round listed. `make test-py313` builds the
3.13 venv (.ci/python313.sh, then pyproject's 3.12+ pins).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODER = os.path.join(REPO, "benchmarks", "encoder.py")
CHILD_TIMEOUT_S = 3600


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--python311", default=os.path.join(REPO, ".venv", "bin", "python"))
    p.add_argument("--python313", default=os.path.join(REPO, ".venv313", "bin", "python"))
    p.add_argument("--rounds", type=int, help="turns per Python and dtype, best kept (default 3; --quick 1)")
    p.add_argument("--corpus", default="heldout", help="encoder.py's --corpus (default: %(default)s)")
    p.add_argument("--docs", type=int, help="encoder.py's --docs (default 1800; --quick 16)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.docs = args.docs or (16 if args.quick else 1800)
    return args


def encoder_child(python: str, dtype: str, args) -> dict:
    """One run of encoder.py's docbeam side under ``python``: its results file's docbeam figures and machine."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            python,
            ENCODER,
            "--skip-pipeline",
            "--st-device",
            "skip",
            "--repeats",
            "1",
            "--corpus",
            args.corpus,
            "--docs",
            str(args.docs),
            "--dtype",
            dtype,
            "--results",
            folder,
        ] + (["--quick"] if args.quick else [])
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        (path,) = glob.glob(os.path.join(folder, "*.json"))
        with open(path) as f:
            result = json.load(f)
    ours = result["docbeam"]
    return {
        "tokens_per_s": ours["tokens_per_s"],
        "real_tokens": ours["real_tokens"],
        "compile_s": ours["compile_s"],
        "load_s": ours["load_s"],
        "python": result["machine"]["python"],
        "versions": {k: result["machine"]["versions"].get(k) for k in ("jax", "jaxlib", "flax")},
    }


def turns(args) -> dict:
    """{(python label, dtype): [child result per round]}, the children run in turns, reversed every round."""
    pythons = {"3.11": args.python311, "3.13": args.python313}
    order = [(label, dtype) for dtype in args.dtypes.split(",") for label in pythons]
    runs: dict = {key: [] for key in order}
    for r in range(args.rounds):
        for label, dtype in order if r % 2 == 0 else order[::-1]:
            result = encoder_child(pythons[label], dtype, args)
            runs[(label, dtype)].append(result)
            print(
                f"round {r + 1}: Python {result['python']} {dtype}: {result['tokens_per_s']:,.0f} tokens/s", flush=True
            )
    return runs


def summary(runs: dict) -> list[dict]:
    rows = []
    for (label, dtype), results in runs.items():
        rates = [r["tokens_per_s"] for r in results]
        first = results[0]
        rows.append(
            {
                "python": first["python"],
                "label": label,
                "dtype": dtype,
                "jax": first["versions"]["jax"],
                "flax": first["versions"]["flax"],
                "best_tokens_per_s": max(rates),
                "median_tokens_per_s": statistics.median(rates),
                "every_round_tokens_per_s": [round(x) for x in rates],
                "real_tokens": first["real_tokens"],
            }
        )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    for python in (args.python311, args.python313):
        if not os.path.exists(python):
            raise SystemExit(f"{python} not found: `make setup-test` builds .venv, `make test-py313` .venv313")
    info = common.machine()
    common.print_machine("docbeam's encoder: Python 3.11 vs 3.13", info)
    rows = summary(turns(args))
    ratios, medians = {}, {}
    for dtype in args.dtypes.split(","):
        by = {row["label"]: row for row in rows if row["dtype"] == dtype}
        ratios[dtype] = common.ratio(by["3.13"]["best_tokens_per_s"], by["3.11"]["best_tokens_per_s"])
        medians[dtype] = common.ratio(by["3.13"]["median_tokens_per_s"], by["3.11"]["median_tokens_per_s"])
    print("## The encoder alone, per Python and dtype (tokens/s)\n")
    print(
        common.table(
            [
                "Python",
                "jax / flax",
                "dtype",
                "best",
                "median",
                "every round",
                "3.13 ÷ 3.11 best",
                "3.13 ÷ 3.11 median",
            ],
            [
                [
                    row["python"],
                    f"{row['jax']} / {row['flax']}",
                    row["dtype"],
                    row["best_tokens_per_s"],
                    row["median_tokens_per_s"],
                    ", ".join(f"{x:,}" for x in row["every_round_tokens_per_s"]),
                    ratios[row["dtype"]] if row["label"] == "3.13" else None,
                    medians[row["dtype"]] if row["label"] == "3.13" else None,
                ]
                for row in rows
            ],
        )
    )
    print(
        f"\n{args.corpus} corpus, {args.docs} documents, the encoder alone (encoder.py --skip-pipeline), "
        f"{args.rounds} round(s) in turns; {rows[0]['real_tokens']:,} real tokens a pass"
    )
    common.write_results(
        args,
        "pythons",
        {
            "args": vars(args),
            "machine": info,
            "rows": rows,
            "ratio_313_over_311": ratios,
            "median_ratio_313_over_311": medians,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
