"""output.dedup's part of the job's graph: the methods in order (exact, near, semantic; each on what the one before
kept), then ``duplicates/`` and ``dedup_index/`` written into the staging folder, and the counts, histograms and
sweeps summary.json records (summed with the run's statistics)."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import pyarrow as pa

from docbeam.pipeline.sinks.dedup import steps
from docbeam.pipeline.sinks.dedup.earlier import EarlierIndex
from docbeam.pipeline.sinks.dedup.settings import DUPLICATES, INDEX, DedupConfig
from docbeam.pipeline.sinks.registry import Curated
from docbeam.pipeline.store.output import part_prefix

DUPLICATES_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("duplicate_of", pa.string()),
        pa.field("kind", pa.string()),
        pa.field("similarity", pa.float64()),
    ]
)
INDEX_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("key", pa.string()),
        pa.field("scheme", pa.string()),
        pa.field("signature", pa.list_(pa.uint32())),
        pa.field("vector", pa.list_(pa.float32())),
    ]
)


def index_row(item) -> dict:
    """A kept document as the next run reads it back (steps.item_of): what it holds is carried on as it is."""
    return {
        "id": item.id,
        "key": item.key,
        "scheme": item.scheme if item.signature is not None else "",
        "signature": None if item.signature is None else item.signature.tolist(),
        "vector": None if item.vector is None else item.vector.tolist(),
    }


def curate(section: DedupConfig, inputs, staging: str, run_id: str, plan, earlier: EarlierIndex, vector_column):
    from apache_beam.io.parquetio import ReadAllFromParquet, WriteToParquet

    p = inputs.rows.pipeline
    scheme = section.near.scheme() if section.near else ""
    earlier_rows = p | "EarlierIndexFiles" >> beam.Create(earlier.files) | "ReadEarlierIndex" >> ReadAllFromParquet()
    semantic = section.semantic
    items = {
        "documents": inputs.documents,
        "rows": inputs.rows,
        "earlier": earlier_rows,
    } | "DedupItems" >> steps.ItemsOfRun(vector_column if semantic else None, earlier.vectors, section.history)
    marked, stats = [], []
    if section.exact:
        exact = items | "MarkExact" >> steps.MarkExact()
        items = exact["kept"]
        marked.append(exact["marked"])
    if section.near:
        n = section.near
        near = items | "MarkNear" >> steps.MarkNear(n.threshold, n.ngram, n.bands, n.rows, scheme)
        items = near["kept"]
        marked.append(near["marked"])
        stats.append(near["closest"] | "NearStats" >> beam.Map(steps.near_stats))
    if not section.near:  # near drops the texts once signed; no later step needs them
        items = items | "DropTexts" >> beam.Map(lambda i: dataclasses.replace(i, text=None))
    if semantic:
        clusters_wanted = None if semantic.clusters == "auto" else semantic.clusters
        sem = items | "MarkSemantic" >> steps.MarkSemantic(
            semantic.eps, clusters_wanted, semantic.keep, semantic.max_cluster, semantic.seed
        )
        items = sem["kept"]
        marked.append(sem["marked"])
        stats.append(sem["closest"] | "SemanticStats" >> beam.Map(steps.semantic_stats))
        stats.append(sem["plan"] | "ClusterStats" >> beam.Map(lambda d: {"clusters": d}))
    marks = tuple(marked) | "AllMarks" >> beam.Flatten()
    shards = plan.config.output.num_shards
    written = (
        marks
        | "DuplicateRows" >> beam.Map(lambda m: m.row())
        | "WriteDuplicates"
        >> WriteToParquet(
            part_prefix(staging, DUPLICATES, run_id), DUPLICATES_SCHEMA, file_name_suffix=".parquet", num_shards=shards
        ),
        items
        | "IndexRows" >> beam.Map(index_row)
        | "WriteDedupIndex"
        >> WriteToParquet(
            part_prefix(staging, INDEX, run_id), INDEX_SCHEMA, file_name_suffix=".parquet", num_shards=shards
        ),
    )
    counted = (
        marks | "MarkStats" >> beam.Map(steps.mark_stats),
        items | "KeptStats" >> beam.Map(lambda i: {"earlier_compared": 1} if i.earlier else {"kept": 1}),
        *stats,
    )
    all_stats = counted | "DedupStats" >> beam.Flatten() | "UnderSinkKey" >> beam.Map(lambda d: {"sinks": {"dedup": d}})
    return Curated(
        written=written,
        stats=all_stats,
        marked=marks | "MarkedIds" >> beam.Map(lambda m: (m.id, m.kind)),
    )
