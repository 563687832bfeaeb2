"""The near-duplicate method's references for benchmarks/dedup.py: docbeam's near steps alone, datatrove's MinHash
(run in its own interpreter) and the exact Jaccard of every pair; and how marks are scored against the planted
truth. A library module: benchmarks/dedup.py runs these as its children and prints their tables."""

from __future__ import annotations

import glob
import json
import os
import time

from benchmarks import common

NEAR_ONLY = "{near: {}}"
NEAR_KINDS = ("original", "exact", "whitespace", "edited")  # one of the four is kept: 3 copies a group to mark


def child_near_steps(spec: dict) -> dict:
    """docbeam's near method as its Beam steps alone (DirectRunner), on the texts, without the encoder."""
    import apache_beam as beam

    from docbeam import config
    from docbeam.pipeline.sinks.dedup import signatures, steps
    from docbeam.pipeline.sinks.dedup.marking import Item

    docs = [json.loads(line) for line in open(spec["corpus"])]
    out = os.path.join(spec["out"], "marks")
    n = config.load(common.LOCAL_CONFIG, [f"output.dedup={NEAR_ONLY}"]).output.dedup.near  # as graph.py calls it
    started = time.perf_counter()
    with beam.Pipeline(runner="DirectRunner") as p:
        items = p | beam.Create([Item(d["id"], signatures.exact_key(d["text"]), d["text"]) for d in docs])
        near = items | "MarkNear" >> steps.MarkNear(n.threshold, n.ngram, n.bands, n.rows, n.scheme())
        near["marked"] | beam.Map(lambda m: json.dumps(m.row())) | beam.io.WriteToText(out)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for f in glob.glob(out + "*") for line in open(f)]
    return {"wall_s": round(wall, 2), "marks": {r["id"]: [r["duplicate_of"], "near"] for r in rows}}


def child_datatrove(spec: dict) -> dict:
    """datatrove's MinHash stages 1-3 on the corpus sorted by id; marks read from its .remove and .clusters."""
    import struct

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader

    work, ids = spec["out"], [json.loads(line)["id"] for line in open(spec["corpus"])]
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    stages = [
        ([JsonlReader(os.path.dirname(spec["corpus"])), MinhashDedupSignature(f"{work}/sigs", config=cfg)], 1),
        ([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=cfg)], cfg.num_buckets),
        ([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=cfg, save_cluster_id=True)], 1),
    ]
    started = time.perf_counter()
    for number, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=f"{work}/logs{number}").run()
    wall = time.perf_counter() - started

    def ints(name):
        path = f"{work}/remove/000000.{name}"
        data = open(path, "rb").read() if os.path.exists(path) else b""
        return struct.unpack(f"<{len(data) // 4}I", data)

    removed, pairs = set(ints("remove")), ints("clusters")
    cluster = dict(zip(pairs[::2], pairs[1::2]))
    root = {c: doc for doc, c in cluster.items() if doc not in removed}
    return {"wall_s": round(wall, 2), "marks": {ids[d]: [ids[root[cluster[d]]], "near"] for d in removed}}


def exact_reference(docs: list[dict], threshold: float = 0.8, ngram: int = 5) -> tuple[dict, float]:
    """Exact Jaccard of the word ``ngram``-gram sets (docbeam's words: signatures.words) over every pair, then the
    greedy rule by id: marks and seconds."""
    import numpy as np
    import scipy.sparse as sp

    from docbeam.pipeline.sinks.dedup.signatures import words

    started = time.perf_counter()
    ordered = sorted(docs, key=lambda d: d["id"])
    vocab: dict[tuple, int] = {}
    rows, cols = [], []
    for i, d in enumerate(ordered):
        tokens = words(d["text"])
        grams = {tuple(tokens[k : k + ngram]) for k in range(max(len(tokens) - ngram + 1, 1))}
        cols += [vocab.setdefault(g, len(vocab)) for g in grams]
        rows += [i] * len(grams)
    m = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(ordered), len(vocab)))
    sizes = np.asarray(m.sum(axis=1)).ravel()
    inter = sp.triu(m @ m.T, k=1).tocoo()  # every pair sharing an n-gram; the others have Jaccard 0
    jaccard = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    earlier: dict[int, list[tuple[float, int]]] = {}
    for a, b, s in zip(inter.row, inter.col, jaccard):
        if s >= threshold:
            earlier.setdefault(int(b), []).append((float(s), int(a)))
    kept, marks = set(), {}
    for i in range(len(ordered)):
        best = max((p for p in earlier.get(i, []) if p[1] in kept), default=None)
        if best:
            marks[ordered[i]["id"]] = [ordered[best[1]]["id"], "near"]
        else:
            kept.add(i)
    return marks, time.perf_counter() - started


def scored(marks: dict, truth: dict, near_only: bool = False) -> dict:
    """Marks held to the planted truth: right when the kept partner is of the marked document's group."""
    right = {
        d for d, (of, _) in marks.items() if truth[d]["group"] is not None and truth[d]["group"] == truth[of]["group"]
    }
    groups = {v["group"] for v in truth.values() if v["group"] is not None}
    if near_only:
        per_group: dict = {}
        for d in right:
            if truth[d]["kind"] in NEAR_KINDS:
                per_group[truth[d]["group"]] = per_group.get(truth[d]["group"], 0) + 1
        found, wanted = (
            sum(min(n, len(NEAR_KINDS) - 1) for n in per_group.values()),
            len(groups) * (len(NEAR_KINDS) - 1),
        )
    else:
        found, wanted = len(right), sum(1 for v in truth.values() if v["group"] is not None) - len(groups)
    return {
        "marked": len(marks),
        "true_positives": len(right),
        "recall": round(found / wanted, 4) if wanted else None,
        "precision": round(len(right) / len(marks), 4) if marks else None,
    }


def agreement(a: dict, b: dict) -> float | None:
    """Jaccard of two sets of marked ids."""
    return round(len(a.keys() & b.keys()) / len(a.keys() | b.keys()), 4) if a or b else None
