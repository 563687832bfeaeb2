"""WriteChunks (``output.granularity: chunk | both``): one row per window the encoder saw, in ``chunks/``.

A chunk is a window: the characters its own tokens cover (``char_start``/``char_end``, set by Tokenize from
the tokenizer's offsets, in code points of the source text), and the vector the document's pooling received
for it, cut to ``truncate_dim`` and L2-normalised when the model normalises, as a document's vector is: a
chunk is the vector its text alone would get as a one-window document, and a one-window document's chunk
vector is its document vector, bit for bit. Only documents whose pooled vector was kept get chunk rows: a
document rejected at pooling (non-finite) has none, as it has no embeddings row.

With the sparse head (models/heads/sparse.py) a chunk row carries its window's ``sparse_embedding`` instead,
pruned as a document's is (``model.sparse``'s ``threshold`` and ``max_terms``); with ``model.sparse.windows:
first`` a long document is cut at its first window, so it has that one chunk. Late chunking
(``output.chunking: late``) hands this stage its chunks' late vectors (pipeline/stages/late_chunking.py) in place
of its windows', with the same indexes, offsets and lengths.
"""

from __future__ import annotations

import logging

import apache_beam as beam
import numpy as np
import pyarrow as pa

from docbeam.pipeline.records import Document, Rejected, WindowEmbedding
from docbeam.pipeline.stages import vectors
from docbeam.pipeline.stages.keep import with_kept
from docbeam.pipeline.store.output import CHUNKS, part_prefix


def chunk_schema(vector: pa.Field, with_text: bool, kept_columns: tuple[pa.Field, ...] = ()) -> pa.Schema:
    """The chunks/ columns; ``vector`` is the embeddings/ file's own column (``embedding``, write.py, or the
    sparse head's ``sparse_embedding``), so the two never differ, and the kept fields' columns are theirs too
    (pipeline/stages/keep.py)."""
    return pa.schema(
        [
            ("document_id", pa.string()),
            ("chunk_index", pa.int32()),
            ("char_start", pa.int64()),  # [char_start, char_end) of the source text, in code points (Python str)
            ("char_end", pa.int64()),
            *([("chunk_text", pa.string())] if with_text else []),
            vector,
            ("num_tokens", pa.int32()),  # tokens the model saw (special and prompt tokens included): its pooling weight
            *kept_columns,
        ]
    )


def chunk_rows(windows: list[WindowEmbedding], document: Document | None, head) -> list[dict]:
    """One document's chunk rows in window order; ``document`` (None: no ``chunk_text`` column) gives their
    text: its source is ``text_offset`` characters longer than its text (a BOM) and the offsets count them.
    Each row carries the head's ``chunk_column``: its ``chunk_value`` of the window (models/heads/)."""
    rows = []
    for w in sorted(windows, key=lambda w: w.index):
        row = {"document_id": w.doc_id, "chunk_index": w.index, "char_start": w.char_start, "char_end": w.char_end}
        if document is not None:
            row["chunk_text"] = document.text[w.char_start - document.text_offset : w.char_end - document.text_offset]
        row[head.chunk_column] = head.chunk_value(w.vector)
        row["num_tokens"] = w.length
        rows.append(with_kept(row, document.kept) if document is not None else row)
    return rows


def not_written(count: int, reason: str) -> None:
    """Chunk rows of a written document left out: a Beam counter (summary.json's metrics) and a log line."""
    if count:
        from apache_beam.metrics import Metrics

        from docbeam.pipeline.telemetry.observe import CHUNKS_NOT_WRITTEN, METRICS_NAMESPACE, metric_name

        Metrics.counter(METRICS_NAMESPACE, metric_name(CHUNKS_NOT_WRITTEN, reason)).inc(count)
        logging.getLogger(__name__).warning("docbeam: %d chunk row(s) not written (%s)", count, reason)


class WriteChunks(beam.PTransform):
    """Input ``{"windows": WindowEmbeddings, "documents": the Documents encoded, "embedded": their pooled rows}``
    and, for int8/uint8, ``"calibration"``: the documents' ranges, which chunk rows are quantized with too (one
    scale per output; a chunk value outside them is clipped, as for reused documents); writes chunks/ into the
    run's staging folder and outputs the file names (for CommitRun's ``written``). Each row carries the head's
    ``chunk_column``, typed as the head's rows type it."""

    def __init__(
        self,
        staging_path: str,
        run_id: str,
        num_shards: int,
        *,
        head,
        with_text: bool,
        vector_dtype: str = "float32",
        kept_columns: tuple[pa.Field, ...] = (),
    ):
        super().__init__()
        self._out, self._run_id, self._shards = staging_path.rstrip("/"), run_id, num_shards
        self._head, self._with_text = head, with_text
        column = next(c for c in head.columns() if c.name == head.chunk_column).field()
        self._schema = chunk_schema(column, with_text, kept_columns)
        self._dtype = vector_dtype
        self._documents = with_text or bool(kept_columns)  # the texts and kept fields travel only when rows use them

    def expand(self, inputs):
        from apache_beam.io.parquetio import WriteToParquet

        head, with_text, dtype = self._head, self._with_text, self._dtype

        def rows(item, calibration=None):
            _, grouped = item
            if not list(grouped["embedded"]):  # rejected at pooling, or never encoded
                return []
            document = next(iter(grouped["document"]), None) if "document" in grouped else None
            rows = chunk_rows(list(grouped["windows"]), document, head)
            rows = rows if with_text else [{k: v for k, v in r.items() if k != "chunk_text"} for r in rows]
            # A late chunk whose context window gave NaN or inf is not written, though its document's row (from
            # its windows) was: an embedding written is always finite. Counted, so the summary's metrics say so.
            finite = [r for r in rows if "embedding" not in r or np.all(np.isfinite(r["embedding"]))]
            not_written(len(rows) - len(finite), "non_finite")
            if dtype == "float32":  # the head's chunk_value made them float32 already
                return finite
            # A chunk with values beyond float16's range is not written (an embedding written is always finite).
            quantized = [vectors.quantize_row({**r, "id": r["document_id"]}, dtype, calibration) for r in finite]
            kept = [{k: v for k, v in q.items() if k != "id"} for q in quantized if not isinstance(q, Rejected)]
            not_written(len(finite) - len(kept), "out_of_range")
            return kept

        joined = {
            "windows": inputs["windows"] | "KeyWindows" >> beam.Map(lambda w: (w.doc_id, w)),
            "embedded": inputs["embedded"] | "KeyEmbedded" >> beam.Map(lambda row: (row["id"], True)),
        }
        if self._documents:
            joined["document"] = inputs["documents"] | "KeyDocuments" >> beam.Map(lambda d: (d.id, d))
        return (
            joined
            | "GroupChunks" >> beam.CoGroupByKey()
            | "ChunkRows"
            >> beam.FlatMap(
                rows, *([beam.pvalue.AsSingleton(inputs["calibration"])] if "calibration" in inputs else [])
            )
            | "WriteParquet"
            >> WriteToParquet(
                part_prefix(self._out, CHUNKS, self._run_id),
                self._schema,
                file_name_suffix=".parquet",
                num_shards=self._shards,
                use_compliant_nested_type=True,
            )
        )
