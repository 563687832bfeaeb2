"""output.dedup: what it adds to an embedding run, and its near-duplicate method beside datatrove's and exact Jaccard.

    python benchmarks/dedup.py [--quick] [--sizes 3000] [--repeats 2] [--graph-sizes 10000,30000,100000]
        [--near-docs 3000] [--groups 200] [--singles 100] [--datatrove-python /tmp/dtvenv/bin/python]

The corpora come from data/planted_copies.py (``groups`` originals with 4 copies each: exact, whitespace, edited,
reordered; ``singles`` without copies; the rest distinct mixed documents), so every mark is held to a known truth.

Two measures of what dedup adds. (1) The whole job of configs/local.yaml on ``--sizes`` documents, without
output.dedup and with all three methods (exact, near with its defaults, semantic eps 0.1), ``--repeats`` pairs
alternating (this VM's speed drifts by tens of percent within the hour: one run after the other compares the
hours, not the runs), each in a fresh process so its peak RSS (ru_maxrss) is its own; a warm-up run first puts every
compilation in the persistent cache. The median run of each is compared. (2) The dedup graph alone, where the sizes
can reach 100,000 (the encoder would take an hour per 100,000 documents here): the same Beam steps as the job's
(graph.py's order) on ``--graph-sizes`` documents, beside the same pipeline's input alone (read, parse, vectors), each
in its own process; the vectors stand in for an encoder's (a seeded random projection of each text's word counts),
since the graph's cost does not depend on the model. Besides each run's own CPU seconds the tables give the CPU
seconds other processes took meanwhile and those the hypervisor stole (/proc/stat). Recall and precision count a
mark right when its duplicate_of is of its group (recall over the 4 copies a group has to mark).

The near method is then compared on the ``--near-docs`` corpus (the same planted mix; the first size's corpus when
equal), alone (output.dedup: {near: {}}): as a whole job, as its Beam steps without the encoder (steps.MarkNear on
the texts: the method's own time), beside datatrove's MinHash (signatures, buckets, clusters: 5-grams, 14 buckets × 8
hashes, its spaCy word tokenizer) and the exact Jaccard of docbeam's own word 5-gram sets over every pair (a sparse
product gives every pair's intersection at once; a document is marked when an earlier kept one, by id, is at 0.8 or
more: docbeam's greedy rule without MinHash's estimate). Here recall counts the copies near-duplication is for (exact,
whitespace and edited: 3 a group), and a mark is right when its kept partner is of its group. datatrove runs in
another interpreter, its own venv, so its pins never touch .venv (``python3 -m venv /tmp/dtvenv &&
/tmp/dtvenv/bin/pip install datatrove regex 'xxhash<4' tokenizers spacy``: its minhash module imports modules of
its ``processing`` extra, and spaCy for its English words); without it the exact reference alone is reported, and
the results say why. datatrove marks every pair sharing a bucket (no Jaccard check) and keeps its union-find root,
so its precision is LSH's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import bootstrap  # noqa: F401  (the repository root on sys.path, JAX's environment: benchmarks/bootstrap.py)

from benchmarks import common
from benchmarks.dedup_references import (
    NEAR_ONLY,
    agreement,
    child_datatrove,
    child_near_steps,
    exact_reference,
    scored,
)

ALL_METHODS = "{exact: true, near: {}, semantic: {eps: 0.1}}"


# --- children: each in its own process (peak RSS per run; datatrove in its own interpreter) ---------------------


def child_job(spec: dict) -> dict:
    import resource

    from docbeam import config
    from docbeam.pipeline.driver.run import run_job

    sets = [f"input.path={spec['corpus']}", f"output.path={spec['out']}", "runner.progress_seconds=0"]
    sets += [f"output.dedup={spec['dedup']}"] if spec["dedup"] else []
    cfg = config.load(common.LOCAL_CONFIG, sets)
    started, cpu = time.perf_counter(), time.process_time()
    summary = run_job(cfg)
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(time.process_time() - cpu, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "docs_embedded": summary["docs_embedded"],
        "dedup": summary.get("dedup"),
        "marks": read_marks(spec["out"]),
    }


def read_marks(out: str) -> dict[str, str]:
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(out, "duplicates", "*.parquet")))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return {r["id"]: [r["duplicate_of"], r["kind"]] for r in rows}


def child_graph(spec: dict) -> dict:
    """output.dedup's graph alone (graph.py's steps, DirectRunner), or only its input (``methods`` empty: the read
    and the vectors, to subtract), on a corpus whose vectors stand in for an encoder's: a seeded random projection of
    each text's word counts (copies get close vectors; the graph's cost does not depend on the model)."""
    import resource
    import zlib

    import apache_beam as beam
    import numpy as np

    from docbeam.pipeline.records import Document
    from docbeam.pipeline.sinks.dedup import settings, signatures, steps

    words: dict[str, np.ndarray] = {}

    def row(d: dict) -> dict:
        vector = np.zeros(384, np.float32)
        for w in signatures.words(d["text"]):
            if w not in words:
                words[w] = np.random.default_rng(zlib.crc32(w.encode())).normal(size=384).astype(np.float32)
            vector += words[w]
        return {"id": d["id"], "embedding": vector.tolist()}

    near = settings.NearOptions()
    started, cpu = time.perf_counter(), time.process_time()
    with beam.Pipeline(runner="DirectRunner") as p:
        raw = p | beam.io.ReadFromText(spec["corpus"]) | "Parse" >> beam.Map(json.loads)
        inputs = {
            "documents": raw | "Docs" >> beam.Map(lambda d: Document(d["id"], d["text"], "corpus", None)),
            "rows": raw | "Rows" >> beam.Map(row),
            "earlier": p | "NoEarlier" >> beam.Create([]),
        }
        if spec["methods"]:
            items = inputs | steps.ItemsOfRun("embedding", False, False)
            items = (items | steps.MarkExact())["kept"]
            items = (items | steps.MarkNear(near.threshold, near.ngram, near.bands, near.rows, near.scheme()))["kept"]
            items = (items | steps.MarkSemantic(0.1, None, "hard", 2000, 0))["kept"]
        else:
            items = inputs["rows"]
        items | beam.combiners.Count.Globally() | beam.Map(lambda n: None)
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(time.process_time() - cpu, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


CHILDREN = {"job": child_job, "graph": child_graph, "near_steps": child_near_steps, "datatrove": child_datatrove}


def cpu_now() -> tuple[float, float, float]:
    """(the machine's busy and stolen CPU seconds since boot, this process's children's CPU seconds so far)."""
    import resource

    with open("/proc/stat") as f:
        ticks = [int(v) / os.sysconf("SC_CLK_TCK") for v in f.readline().split()[1:]]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6))  # user nice system irq softirq (guest is in user)
    return busy, ticks[7], children.ru_utime + children.ru_stime


def in_child(kind: str, spec: dict, work: str, python: str = sys.executable) -> dict:
    """Runs this script as ``kind``'s child and returns what it wrote, with the CPU seconds other processes took
    meanwhile and those the hypervisor stole (a run that competed for the 2 cores shows it). Its log goes to a file,
    printed on failure."""
    spec = {**spec, "kind": kind, "result": os.path.join(work, f"{kind}-{time.monotonic_ns()}.json")}
    log = spec["result"] + ".log"
    before = cpu_now()
    with open(log, "w") as f:
        done = subprocess.run([python, os.path.abspath(__file__), "--child", json.dumps(spec)], stdout=f, stderr=f)
    if done.returncode != 0:
        print(open(log).read()[-4000:], file=sys.stderr)
        raise SystemExit(f"{kind} child failed (exit {done.returncode}); log {log}")
    busy, stolen, own = (a - b for a, b in zip(cpu_now(), before))
    with open(spec["result"]) as f:
        return {**json.load(f), "others_cpu_s": round(max(busy - own, 0.0), 1), "stolen_cpu_s": round(stolen, 1)}


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (the lower of two): its figures, marks and summary together."""
    return sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]


def contention(run: dict) -> str:
    return f"{run['wall_s']} s (CPU {run['cpu_s']} s; others {run['others_cpu_s']} s, stolen {run['stolen_cpu_s']} s)"


# --- references and scoring ----------------------------------------------------------------------------------------


def corpus(work: str, size: int, groups: int, singles: int, sort: bool = False) -> tuple[str, list, dict]:
    from data.planted_copies import planted

    docs, truth = planted(groups, singles, seed=0, mixed_docs=size - groups * 5 - singles)
    folder = os.path.join(work, f"corpus-{size}-{groups}-{singles}" + ("-sorted" if sort else ""))
    os.makedirs(folder, exist_ok=True)  # the same arguments make the same corpus
    path = os.path.join(folder, "docs.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps(d, ensure_ascii=False) + "\n" for d in (sorted(docs, key=lambda d: d["id"]) if sort else docs)
        )
    return path, docs, truth


# --- the benchmark -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--sizes", default="3000", help="documents per whole-job corpus, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="whole-job pairs, alternating without and with")
    parser.add_argument(
        "--graph-sizes", default="10000,30000,100000", help="documents per corpus of the dedup graph alone"
    )
    parser.add_argument("--near-docs", type=int, default=3000, help="documents of the near-duplicate comparison")
    parser.add_argument("--groups", type=int, default=200, help="originals with 4 planted copies each")
    parser.add_argument("--singles", type=int, default=100, help="originals without copies")
    parser.add_argument("--datatrove-python", default="/tmp/dtvenv/bin/python", help="a venv's python with datatrove")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a child run: its spec as JSON
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        with open(spec["result"], "w") as f:
            json.dump(CHILDREN[spec["kind"]](spec), f)
        return
    sizes = [1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    groups, singles = (20, 20) if args.quick else (args.groups, args.singles)
    info = common.machine()
    common.print_machine(f"output.dedup: {', '.join(map(str, sizes))} documents, configs/local.yaml", info)
    results: dict = {"machine": info, "groups": groups, "singles": singles, "sizes": {}, "near": {}}
    cost_rows, kind_rows, score_rows = [], [], []
    with tempfile.TemporaryDirectory(prefix="docbeam-dedup-") as work:
        warm, _, _ = corpus(work, 300, 10, 10)
        in_child("job", {"corpus": warm, "out": os.path.join(work, "warm-up"), "dedup": ALL_METHODS}, work)
        corpora = {}
        for size in sizes:
            path, docs, truth = corpora[size] = corpus(work, size, groups, singles)
            plains, dedups = [], []
            for turn in range(1 if args.quick else args.repeats):  # alternating: the VM's speed drifts
                spec = {"corpus": path, "out": os.path.join(work, f"plain-{size}-{turn}"), "dedup": ""}
                plains.append(in_child("job", spec, work))
                print(f"{size}: without dedup {contention(plains[-1])}", flush=True)
                spec = {"corpus": path, "out": os.path.join(work, f"dedup-{size}-{turn}"), "dedup": ALL_METHODS}
                dedups.append(in_child("job", spec, work))
                print(f"{size}: with dedup {contention(dedups[-1])}", flush=True)
            plain, dedup = median_run(plains), median_run(dedups)
            score = scored(dedup["marks"], truth)
            marked = (dedup["dedup"] or {}).get("marked", {})
            results["sizes"][str(size)] = {
                "without": {k: v for k, v in plain.items() if k != "marks"},
                "with": {k: v for k, v in dedup.items() if k != "marks"},
                "runs": {
                    "without": [{k: v for k, v in r.items() if k not in ("marks", "dedup")} for r in plains],
                    "with": [{k: v for k, v in r.items() if k not in ("marks", "dedup")} for r in dedups],
                },
                "wall_ratio": common.ratio(dedup["wall_s"], plain["wall_s"]),
                "rss_ratio": common.ratio(dedup["peak_rss_mb"], plain["peak_rss_mb"]),
                "score": score,
            }
            for name, run in (("none", plain), ("exact + near + semantic", dedup)):
                figures = [(run[k], common.ratio(run[k], plain[k])) for k in ("wall_s", "peak_rss_mb", "cpu_s")]
                cost_rows.append(
                    [size, name, *(v for pair in figures for v in pair), run["others_cpu_s"], run["stolen_cpu_s"]]
                )
            counts = [marked.get(k, 0) for k in ("exact", "near", "semantic")]
            score_rows.append([size, *counts, *(score[k] for k in ("marked", "true_positives", "recall", "precision"))])
            by_kind: dict = {}
            for d, v in truth.items():
                row = by_kind.setdefault(v["kind"], {"docs": 0, "exact": 0, "near": 0, "semantic": 0})
                row["docs"] += 1
                if d in dedup["marks"]:
                    row[dedup["marks"][d][1]] += 1
            results["sizes"][str(size)]["marked_by_planted_kind"] = by_kind
            kind_rows += [
                [size, k, r["docs"], r["exact"], r["near"], r["semantic"]] for k, r in sorted(by_kind.items())
            ]

        graph_rows = []
        for gsize in [2000] if args.quick else [int(g) for g in args.graph_sizes.split(",")]:
            gpath, _, _ = corpus(work, gsize, groups, singles)
            base = in_child("graph", {"corpus": gpath, "methods": False}, work)
            full = in_child("graph", {"corpus": gpath, "methods": True}, work)
            added = {k: round(full[k] - base[k], 2) for k in ("wall_s", "cpu_s", "peak_rss_mb")}
            results.setdefault("graph", {})[str(gsize)] = {"input_only": base, "with_dedup": full, "added": added}
            graph_rows.append(
                [gsize, base["wall_s"], full["wall_s"], added["wall_s"], round(1e3 * added["wall_s"] / gsize, 2)]
                + [
                    base["peak_rss_mb"],
                    full["peak_rss_mb"],
                    added["peak_rss_mb"],
                    base["others_cpu_s"] + full["others_cpu_s"],
                ]
            )
            print(f"graph {gsize}: {contention(base)} → {contention(full)}", flush=True)

        size = sizes[0] if args.quick else args.near_docs
        path, docs, truth = corpora[size] if size in corpora else corpus(work, size, groups, singles)
        near_job = in_child(
            "job", {"corpus": path, "out": os.path.join(work, f"near-{size}"), "dedup": NEAR_ONLY}, work
        )
        steps = in_child("near_steps", {"corpus": path, "out": os.path.join(work, "near-steps")}, work)
        exact_marks, exact_s = exact_reference(docs)
        runs = {
            "docbeam near, whole job": (
                near_job["marks"],
                near_job["wall_s"],
                f"embedding included; {contention(near_job)}",
            ),
            "docbeam near, Beam steps alone": (steps["marks"], steps["wall_s"], "steps.MarkNear, DirectRunner"),
            "exact Jaccard, all pairs": (exact_marks, round(exact_s, 2), "word 5-gram sets, greedy by id"),
        }
        if os.path.exists(args.datatrove_python):
            sorted_path, _, _ = corpus(work, size, groups, singles, sort=True)
            dt = in_child(
                "datatrove",
                {"corpus": sorted_path, "out": os.path.join(work, "datatrove")},
                work,
                python=args.datatrove_python,
            )
            shown = subprocess.run([args.datatrove_python, "-m", "pip", "show", "datatrove"], capture_output=True)
            dt_version = shown.stdout.decode().split("Version: ")[-1].split()[0]
            runs["datatrove MinHash"] = (dt["marks"], dt["wall_s"], f"datatrove {dt_version}, stages 1-3, 1 worker")
            results["near"]["reference"] = (
                f"datatrove {dt_version} (installed in {args.datatrove_python}) and exact Jaccard"
            )
        else:
            results["near"]["reference"] = (
                f"exact Jaccard only: no datatrove interpreter at {args.datatrove_python} (the docstring makes one)"
            )
        results["near"]["documents"] = size
        for name, (marks, seconds, note) in runs.items():
            score = scored(marks, truth, near_only=True)
            same = agreement(marks, exact_marks)
            results["near"][name] = {**score, "seconds": seconds, "same_marks_as_exact": same, "note": note}
            figures = [score[k] for k in ("marked", "true_positives", "recall", "precision")]
            results["near"].setdefault("rows", []).append([name, *figures, same, seconds, note])

    print("\n## dedup's added cost over the embedding run (whole job, each run its own process)\n")
    headers = ["docs", "output.dedup", "wall s", "÷ none", "peak RSS MB", "÷ none", "CPU s", "÷ none"]
    print(common.table(headers + ["others' CPU s", "stolen s"], cost_rows))
    print("\n## the dedup graph alone (exact + near + semantic), beside its input alone, each in its own process\n")
    print(
        common.table(
            ["docs", "input s", "with dedup s", "added s", "added ms/doc", "input RSS MB", "with RSS MB", "added MB"]
            + ["others' CPU s"],
            graph_rows,
        )
    )
    print("\n## what the dedup run marked, against the planted truth\n")
    print(common.table(["docs", "exact", "near", "semantic", "marked", "right", "recall", "precision"], score_rows))
    print("\n## planted kind → marked as\n")
    print(common.table(["docs", "planted kind", "documents", "exact", "near", "semantic"], kind_rows))
    print(f"\n## near duplicates on {size} documents: docbeam's near method beside references\n")
    print(f"reference: {results['near']['reference']}\n")
    print(
        common.table(
            ["method", "marked", "right", "recall (3/group)", "precision", "same as exact", "seconds", "note"],
            results["near"].pop("rows"),
        )
    )
    common.write_results(args, "dedup", results)


if __name__ == "__main__":
    main()
