"""Deduplication as Beam steps, one PTransform per method, each bounded in memory (docs/outputs.md#deduplication):

- ``ItemsOfRun``: the documents with a row, joined by id with their vector and with the earlier run's index
  (a CoGroupByKey: no step holds the corpus).
- ``MarkExact``: a GroupByKey on the exact key; memory: one group of identical documents.
- ``MarkNear``: signatures in a ParDo, one key per LSH band, a GroupByKey per band; each bucket verifies its members
  against its ``TOP`` first by priority (two passes over the grouped values: memory O(TOP) per bucket, whatever
  its size); the verified pairs meet in one combine (memory: the pairs at or above the threshold, about 100 bytes
  each: the duplicates, not the corpus).
- ``MarkSemantic``: centroids fitted on a bounded sample (clusters.py), every vector assigned in a ParDo, a
  GroupByKey per cluster, SemDeDup in pieces of at most ``max_cluster`` (memory: max_cluster² float32 + its vectors).

Each method passes on what it kept, so a later method never marks against a marked document, and protects the
documents an earlier method kept a copy against (marking.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq

import apache_beam as beam
import numpy as np

from docbeam.pipeline.sinks.dedup import clusters, signatures
from docbeam.pipeline.sinks.dedup.marking import Item, Mark, mark_cluster, mark_exact, priority
from docbeam.pipeline.sinks.dedup.settings import NEAR_SWEEP, SEMANTIC_SWEEP

TOP = 16  # the members of an LSH bucket every other member is verified against
MARKED = "marked"
NEAR_BINS = tuple(round(0.05 * i, 2) for i in range(21))


def item_of(item, vector_column: str | None, earlier_vectors: bool, history: bool):
    """``(id, {"document": [...], "row": [...], "earlier": [...]})`` → the one Item deduplication sees, or none.

    A document with a row whose text the earlier run kept unchanged is protected and keeps its stored signature.
    An earlier kept document without a row today is a protected reference when it was read and rejected (a
    rejection says nothing about whether it still exists, as for the sinks' removals) or, under ``history``, when
    it was not read at all; otherwise it left the corpus and is no reference. Its stored vector is used only
    where ``earlier_vectors`` (the earlier run's vectors are this model's)."""
    doc_id, grouped = item
    documents, rows, earlier = list(grouped["document"]), list(grouped["row"]), list(grouped["earlier"])
    before = earlier[0] if earlier else None
    if documents and rows:
        text = documents[0].text
        key = signatures.exact_key(text)
        vector = None
        if vector_column is not None and rows[0].get(vector_column) is not None:
            vector = clusters.unit(rows[0][vector_column])
        if before is not None and before["key"] == key:  # kept by the earlier run, and unchanged since
            yield Item(doc_id, key, text, stored_signature(before), vector, True, scheme=before.get("scheme") or "")
        else:
            yield Item(doc_id, key, text, None, vector)
    elif before is not None and (documents or history):
        stored = before.get("vector")
        vector = np.asarray(stored, np.float32) if earlier_vectors and stored is not None else None
        sig, scheme = stored_signature(before), before.get("scheme") or ""
        yield Item(doc_id, before["key"], None, sig, vector, protected=True, earlier=True, scheme=scheme)


def stored_signature(row: dict | None) -> np.ndarray | None:
    return None if row is None or row.get("signature") is None else np.asarray(row["signature"], np.uint32)


class ItemsOfRun(beam.PTransform):
    """Input ``{"documents", "rows", "earlier"}`` (the earlier run's dedup_index rows, possibly empty); output the
    Items: each document with a row once, and each earlier kept document not read again, protected."""

    def __init__(self, vector_column: str | None, earlier_vectors: bool, history: bool):
        super().__init__()
        self._args = (vector_column, earlier_vectors, history)

    def expand(self, inputs):
        return (
            {
                "document": inputs["documents"] | "KeyDocuments" >> beam.Map(lambda d: (d.id, d)),
                "row": inputs["rows"] | "KeyRows" >> beam.Map(lambda r: (r["id"], r)),
                "earlier": inputs["earlier"] | "KeyEarlier" >> beam.Map(lambda r: (r["id"], r)),
            }
            | "JoinById" >> beam.CoGroupByKey()
            | "Items" >> beam.FlatMap(item_of, *self._args)
        )


def _exact(item):
    _, items = item
    for out in mark_exact(items):
        yield beam.pvalue.TaggedOutput(MARKED, out) if isinstance(out, Mark) else out


class MarkExact(beam.PTransform):
    """Items → ``kept`` Items and ``marked`` Marks (kind exact)."""

    def expand(self, items):
        out = (
            items
            | "KeyByText" >> beam.Map(lambda i: (i.key, i))
            | "GroupIdentical" >> beam.GroupByKey()
            | "KeepFirst" >> beam.FlatMap(_exact).with_outputs(MARKED, main="kept")
        )
        return {"kept": out.kept, "marked": out[MARKED]}


def signed(item: Item, ngram: int, num_perm: int, scheme: str) -> Item:
    """The item with its signature of ``scheme`` (an earlier run's is read, never recomputed; one of another scheme
    is recomputed from the text, or kept as it is for the index when there is no text: it does not compare) and
    without its text, which no later step needs (the shuffles after this carry only signatures and vectors)."""
    if (item.signature is None or item.scheme != scheme) and item.text is not None:
        item = dataclasses.replace(item, signature=signatures.signature(item.text, ngram, num_perm), scheme=scheme)
    return dataclasses.replace(item, text=None)


def band_members(item: Item, bands: int, rows: int, scheme: str):
    if item.signature is None or item.scheme != scheme:
        return
    member = (priority(item), item.id, item.signature, item.protected)
    for key in signatures.band_keys(item.signature, bands, rows):
        yield key, member


def verified_pairs(bucket):
    """A band's bucket → each member's estimated Jaccard with the bucket's TOP first members before it:
    ``((first_id, member_id), similarity)``; a protected member is never the later one. Two passes over the
    values, none held whole."""
    _, members = bucket
    top = heapq.nsmallest(TOP, members, key=lambda m: m[0])
    if len(top) < 2:
        return
    for prio, doc_id, sig, protected in members:
        if protected:
            continue
        for t_prio, t_id, t_sig, _ in top:
            if t_prio >= prio:
                break
            yield (t_id, doc_id), signatures.estimated_jaccard(t_sig, sig)


def root_candidates(item):
    """``(earlier, {"pairs": [(later, similarity)], "not_root": [...]})`` → ``(later, (−similarity, earlier))`` for
    each pair whose earlier document is a root (marking.mark_near's rule, one document at a time)."""
    earlier, grouped = item
    if list(grouped["not_root"]):
        return
    for later, sim in grouped["pairs"]:
        yield later, (-sim, earlier)


def kept_after(item, kind_protects: bool = True):
    """``(id, {"item", "marked", "target"})`` → the item unless it was marked; protected when a mark points at it."""
    _, grouped = item
    marked, targeted = list(grouped["marked"]), list(grouped["target"])
    for one in grouped["item"]:
        if not marked:
            yield dataclasses.replace(one, protected=True) if targeted and kind_protects else one


def without_marked(items, marks, label: str):
    """The items no mark names, those a mark points at protected (a CoGroupByKey on the id)."""
    return (
        {
            "item": items | f"Key{label}Items" >> beam.Map(lambda i: (i.id, i)),
            "marked": marks | f"Key{label}Marked" >> beam.Map(lambda m: (m.id, None)),
            "target": marks | f"Key{label}Targets" >> beam.Map(lambda m: (m.duplicate_of, None)),
        }
        | f"Join{label}Marks" >> beam.CoGroupByKey()
        | f"Kept{label}" >> beam.FlatMap(kept_after)
    )


class MarkNear(beam.PTransform):
    """Items → ``kept`` (signed, text dropped), ``marked`` (kind near) and ``closest``: (id, its greatest estimated
    Jaccard with any candidate before it), for the report's histogram and sweep."""

    def __init__(self, threshold: float, ngram: int, bands: int, rows: int, scheme: str):
        super().__init__()
        self._threshold, self._ngram, self._bands, self._rows = threshold, ngram, bands, rows
        self._scheme = scheme

    def expand(self, items):
        signed_items = items | "Sign" >> beam.Map(signed, self._ngram, self._bands * self._rows, self._scheme)
        pairs = (
            signed_items
            | "BandKeys" >> beam.FlatMap(band_members, self._bands, self._rows, self._scheme)
            | "GroupByBand" >> beam.GroupByKey()
            | "VerifyCandidates" >> beam.FlatMap(verified_pairs)
        )
        threshold = self._threshold
        close = (
            pairs
            | "AtThreshold" >> beam.Filter(lambda p: p[1] >= threshold)
            | "KeyPair" >> beam.Map(lambda p: (p[0], p[1]))
            | "EachPairOnce" >> beam.CombinePerKey(max)  # a pair shares several bands
        )
        not_root = close | "NotRoots" >> beam.Map(lambda p: (p[0][1], None))
        marks = (
            {"pairs": close | "ByEarlier" >> beam.Map(lambda p: (p[0][0], (p[0][1], p[1]))), "not_root": not_root}
            | "JoinRoots" >> beam.CoGroupByKey()
            | "RootCandidates" >> beam.FlatMap(root_candidates)
            | "MostSimilarRoot" >> beam.CombinePerKey(min)
            | "NearMarks" >> beam.MapTuple(lambda later, best: Mark(later, best[1], "near", round(-best[0], 6)))
        )
        closest = pairs | "KeyCandidate" >> beam.Map(lambda p: (p[0][1], p[1])) | "Closest" >> beam.CombinePerKey(max)
        return {"kept": without_marked(signed_items, marks, "Near"), "marked": marks, "closest": closest}


def sample_key(seed: int, doc_id: str) -> str:
    return hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).hexdigest()


def order_in_cluster(keep: str, distance: float, doc_id: str, seed: int):
    """SemDeDup's choice of which to keep: ``hard`` keeps the ones far from the centroid first, ``easy`` the
    central ones, ``random`` a seeded shuffle."""
    if keep == "hard":
        return -distance
    if keep == "easy":
        return distance
    return sample_key(seed, doc_id)


def cluster_marks(cluster, eps: float, max_cluster: int):
    """One cluster's members → its semantic Marks (main) and ``closest`` values. The members are sorted by priority
    first (their ids and vectors held: the plan's hash pieces keep a cluster near max_cluster), then compared in
    pieces of ``max_cluster`` in that order, so the marks do not depend on the order Beam hands them over in."""
    _, members = cluster
    members = sorted(members, key=lambda m: m[0])
    for start in range(0, len(members), max_cluster):
        piece = members[start : start + max_cluster]
        ids = [m[1] for m in piece]
        marks, closest = mark_cluster(ids, np.stack([m[2] for m in piece]), [m[3] for m in piece], eps)
        yield from marks
        for value in closest:
            yield beam.pvalue.TaggedOutput("closest", value)


class MarkSemantic(beam.PTransform):
    """Items → ``kept``, ``marked`` (kind semantic), ``closest`` (SemDeDup's greatest cosine to a predecessor) and
    ``plan`` (the clusters' description). Items without a vector pass through kept."""

    def __init__(self, eps: float, clusters_wanted: int | None, keep: str, max_cluster: int, seed: int):
        super().__init__()
        self._eps, self._clusters, self._keep = eps, clusters_wanted, keep
        self._max_cluster, self._seed = max_cluster, seed

    def expand(self, items):
        with_vector = items | "HaveVectors" >> beam.Filter(lambda i: i.vector is not None)
        keep, seed = self._keep, self._seed
        sample = (
            with_vector
            | "HashVectors" >> beam.Map(lambda i: (sample_key(seed, i.id), i.vector))
            # the same documents every run (by hash of the id), so the same centroids: the marks are stable
            | "SampleVectors" >> beam.combiners.Top.Of(clusters.SAMPLE_SIZE, key=lambda kv: kv[0])
            | "SampleOnly" >> beam.Map(lambda kvs: [v for _, v in kvs])
        )
        count = with_vector | "CountVectors" >> beam.combiners.Count.Globally()
        args = (self._clusters, self._max_cluster, self._seed)
        plan = (
            items.pipeline
            | "Once" >> beam.Create([None])
            | "FitCentroids"
            >> beam.Map(
                lambda _, s, n: clusters.fit(s, n, *args),
                beam.pvalue.AsSingleton(sample),
                beam.pvalue.AsSingleton(count),
            )
        )

        def assigned(item, fitted):
            key, distance = fitted.assign(item.vector, item.id, seed)
            order = (not item.protected, order_in_cluster(keep, distance, item.id, seed), item.id)
            return key, (order, item.id, item.vector, item.protected)

        grouped = (
            with_vector
            | "AssignCluster" >> beam.Map(assigned, beam.pvalue.AsSingleton(plan))
            | "GroupByCluster" >> beam.GroupByKey()
            | "SemDeDup"
            >> beam.FlatMap(cluster_marks, self._eps, self._max_cluster).with_outputs("closest", main="marked")
        )
        return {
            "kept": without_marked(items, grouped.marked, "Semantic"),
            "marked": grouped.marked,
            "closest": grouped.closest,
            "plan": plan | "DescribeClusters" >> beam.Map(lambda p: p.describe()),
        }


def near_stats(closest: tuple[str, float]) -> dict:
    """One document's greatest candidate similarity → its histogram bin and the thresholds it would be marked at."""
    _, sim = closest
    low = max(b for b in NEAR_BINS if b <= sim + 1e-9)
    return {
        "histogram": {"near": {f"{low:.2f}": 1}},
        "sweep": {"near": {f"{t:g}": 1 for t in NEAR_SWEEP if sim >= t}},
    }


def semantic_stats(closest: tuple[str, float]) -> dict:
    """One document's greatest cosine to a predecessor (SemDeDup) → its histogram bin (0.01 wide from 0.80) and the
    eps it would be marked at."""
    _, cos = closest
    low = "<0.80" if cos < 0.8 else f"{min(np.floor(cos * 100 + 1e-6) / 100, 1.0):.2f}"
    return {
        "histogram": {"semantic": {low: 1}},
        "sweep": {"semantic": {f"{e:g}": 1 for e in SEMANTIC_SWEEP if cos >= 1 - e}},
    }


def mark_stats(mark: Mark) -> dict:
    return {"marked": {mark.kind: 1}}
