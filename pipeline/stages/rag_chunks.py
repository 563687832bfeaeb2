"""docbeam's rows as Apache Beam's own RAG type, ``apache_beam.ml.rag.types.Chunk``, so a pipeline of the user's
writes them with Beam's maintained ingestion writers (``apache_beam.ml.rag.ingestion``: Postgres, AlloyDB, Cloud
SQL, BigQuery, Qdrant, Milvus, Spanner) rather than docbeam's sinks.

One mapping (``chunk_of_row``) serves every source, so ``EmbedDocuments(..., beam_chunks=True)``, ``AsBeamChunks``
on rows and ``ReadBeamChunks`` on a committed output give equal Chunks for equal rows: the row's id (a chunk row's
``<document_id>#<chunk_index>``), ``index`` (0, or the chunk's), the dense vector (``embedding``) and the sparse
one (``sparse_embedding`` as Beam's ``(indices, values)``) as float lists holding the float32 values exactly, the
text where it is known, and ``metadata``: the kept fields (a JSON-text column as the JSON it holds), the
``document_id``, and a chunk's ``char_start``/``char_end``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

import apache_beam as beam
import numpy as np

from docbeam.errors import Refused
from docbeam.models.heads.registry import described
from docbeam.pipeline.stages.keep import OUTPUT_COLUMNS
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage

# A row's columns that are docbeam's own (every run's, and the vector heads'); every other column is a kept field.
OWN_COLUMNS = frozenset(OUTPUT_COLUMNS)
NOT_CHUNKS = ("multi_vector", "scores")  # rows a Chunk has no place for: one vector per token, a classifier's scores
CHUNK_KINDS = {"vector", "sparse_vector"}  # the kinds of column (models/heads/) a Beam Chunk's Embedding holds
IDS = ("docbeam", "uuid5")  # a Chunk's id: docbeam's own, or a UUID made from it (for Qdrant and Milvus)
FLOAT_DTYPES = ("float32", "float16")


class NotChunks(Refused):
    """Rows or a run that cannot become Beam Chunks: named, with what would."""


def chunk_id(row: dict, ids: str = "docbeam") -> str:
    """A document row's id, or a chunk row's ``<document_id>#<chunk_index>`` (unique: the index follows the
    last ``#``); with ``ids="uuid5"``, ``uuid5(NAMESPACE_URL, "docbeam:" + that)``, the same on every run."""
    own = f"{row['document_id']}#{row['chunk_index']}" if "document_id" in row else row["id"]
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"docbeam:{own}")) if ids == "uuid5" else own


def has_vectors(row: dict) -> bool:
    return row.get("embedding") is not None or row.get("sparse_embedding") is not None


def chunk_of_row(row: dict, json_fields: tuple[str, ...] = (), text: str | None = None, ids: str = "docbeam"):
    """One docbeam row (an ``embeddings/`` or ``chunks/`` row, or ``EmbedDocuments``' dict) → Beam's Chunk."""
    from apache_beam.ml.rag.types import Chunk, Content, Embedding

    # bge-m3's rows hold dense and sparse vectors beside their ColBERT ones: a hybrid Chunk, without the tokens'.
    refused = [c for c in NOT_CHUNKS if c in row and not (c == "multi_vector" and has_vectors(row))]
    if refused:
        raise NotChunks(
            f"a row with {refused[0]!r} (id {row.get('id')!r}) is not one vector per document or "
            "chunk, which a Beam Chunk holds; use a head that writes embedding or sparse_embedding"
        )
    if row.get("embedding") is None and row.get("sparse_embedding") is None:
        raise NotChunks(
            f"row {row.get('id', row.get('document_id'))!r} has neither embedding nor sparse_embedding; "
            f"its columns are {sorted(row)}"
        )
    sparse = row.get("sparse_embedding")
    embedding = Embedding(
        dense_embedding=None if row.get("embedding") is None else float32_list(row["embedding"]),
        sparse_embedding=None
        if sparse is None
        else ([int(i) for i in sparse["indices"]], float32_list(sparse["values"])),
    )
    document_id = row.get("document_id", row.get("id"))
    metadata = {
        k: json.loads(v) if k in json_fields and v is not None else v for k, v in row.items() if k not in OWN_COLUMNS
    }
    metadata["document_id"] = document_id
    if "char_start" in row:
        metadata.update(char_start=row["char_start"], char_end=row["char_end"])
    return Chunk(
        content=Content(text=row.get("chunk_text", text)),
        id=chunk_id(row, ids),
        index=int(row.get("chunk_index", 0)),
        metadata=metadata,
        embedding=embedding,
    )


def float32_list(values) -> list[float]:
    """Python floats holding each float32 value exactly (what Beam's writers format or bind)."""
    return np.asarray(values, np.float32).astype(np.float64).tolist()


def check_ids(ids: str) -> str:
    if ids not in IDS:
        raise ValueError(f"ids={ids!r}: a Chunk's id is one of {', '.join(IDS)}")
    return ids


class AsBeamChunks(beam.PTransform):
    """docbeam rows (``EmbedDocuments``' ``embeddings``, or rows read from a run) → Beam ``Chunk``s.

    ``json_fields``: kept fields whose column holds JSON text, decoded into the metadata. A row has no text
    (``content.text`` None) unless it is a chunk row with ``chunk_text``; ``EmbedDocuments(beam_chunks=True)``
    gives the documents' texts too."""

    def __init__(self, json_fields: tuple[str, ...] = (), ids: str = "docbeam"):
        super().__init__()
        self._json_fields, self._ids = tuple(json_fields), check_ids(ids)

    def expand(self, rows):
        return rows | "ToBeamChunks" >> beam.Map(chunk_of_row, self._json_fields, None, self._ids)


def with_texts(item, ids: str):
    """From ``(id, {"rows": [row], "texts": [text], "fields": [(text, fields)]})``: the row's Chunk with its
    document's text and, as metadata, the other fields of the input dict that text came from."""
    _, grouped = item
    texts = list(grouped["texts"])
    text = texts[0] if texts else None
    fields = next((f for t, f in grouped.get("fields", ()) if t == text), {})
    for row in grouped["rows"]:
        yield chunk_of_row({**fields, **row}, (), text, ids)


class ChunksWithTexts(beam.PTransform):
    """``{"rows": rows, "texts": (id, text) pairs, "fields": (id, (text, other fields)) pairs}`` → each row's
    Chunk with its text and those fields (EmbedDocuments' step: a user's dicts carry their own metadata)."""

    def __init__(self, ids: str = "docbeam"):
        super().__init__()
        self._ids = check_ids(ids)

    def expand(self, inputs):
        keyed = inputs["rows"] | "KeyRowsById" >> beam.Map(lambda r: (r["id"], r))
        return (
            {**inputs, "rows": keyed}
            | "JoinTexts" >> beam.CoGroupByKey()
            | "ToBeamChunks" >> beam.FlatMap(with_texts, self._ids)
        )


def other_fields(item, id_field: str, text_field: str) -> list[tuple[str, tuple]]:
    """A user's dict → ``(its id as docbeam spells it, (its text, its other fields))``; nothing for anything else,
    nor for an element that breaks on being read (the document itself is an error row: embed.py ``_checked``)."""
    try:
        if (
            not isinstance(item, Mapping)
            or isinstance(item.get(id_field), bool)
            or not isinstance(item.get(id_field), (str, int))
        ):
            return []
        rest = {k: v for k, v in item.items() if k not in (id_field, text_field) and k not in OWN_COLUMNS}
        return [(str(item[id_field]), (item.get(text_field), rest))]
    except Exception:  # noqa: BLE001  whatever the element holds, it never crashes the pipeline
        return []


def committed_files(output: str, manifest: dict | None, rows: str | None) -> tuple[str, tuple[str, ...]]:
    """(the folder, its files) of the committed run that ReadBeamChunks reads, or NotChunks naming why not."""
    if manifest is None:
        raise NotChunks(
            f"{output} holds no committed docbeam run ({output_lib.MANIFEST} is missing); "
            "point ReadBeamChunks at a run's output.path"
        )
    head = described(manifest["head"]) or {}  # read_manifest gives every run one (before heads: the embedding head)
    columns = head.get("columns") if isinstance(head.get("columns"), list) else []
    if not {c.get("kind") for c in columns if isinstance(c, dict)} & CHUNK_KINDS:
        raise NotChunks(
            f"{output}'s run has model.head {head.get('name')!r}, whose {head.get('folder')}/ rows are not one "
            "vector per document; only runs whose rows hold a dense or a sparse vector become Beam Chunks"
        )
    dtype = (manifest.get("embedding") or {}).get("dtype", "float32")
    if dtype not in FLOAT_DTYPES:
        raise NotChunks(
            f"{output}'s run wrote output.vector_dtype {dtype!r}; Beam's Embedding holds floats, so "
            f"read a run written as {' or '.join(FLOAT_DTYPES)}"
        )
    granularity = manifest["granularity"]
    rows = rows or (output_lib.CHUNKS if granularity == "chunk" else output_lib.EMBEDDINGS)
    if rows not in (output_lib.EMBEDDINGS, output_lib.CHUNKS):
        raise NotChunks(f"ReadBeamChunks(rows={rows!r}): rows is {output_lib.EMBEDDINGS!r} or {output_lib.CHUNKS!r}")
    wrote = {"document": (output_lib.EMBEDDINGS,), "chunk": (output_lib.CHUNKS,)}.get(
        granularity, (output_lib.EMBEDDINGS, output_lib.CHUNKS)
    )
    if rows not in wrote:
        raise NotChunks(
            f"{output}'s run has output.granularity {granularity!r}, so it wrote no {rows}/ rows; "
            f"read its {wrote[0]}/ (rows={wrote[0]!r})"
        )
    why = output_lib.damaged(output, manifest, rows, require_checksums=False)  # a run before checksums: sizes
    if why:
        raise NotChunks(f"{output}: {why}; ReadBeamChunks reads only a committed run's files as committed")
    files = tuple(storage.join(output, f["path"]) for f in manifest["files"] if output_lib.in_folder(f["path"], rows))
    return rows, files


class ReadBeamChunks(beam.PTransform):
    """A committed run's rows, as its ``_manifest.json`` lists them → Beam ``Chunk``s, as ``AsBeamChunks`` makes
    them. ``rows``: ``"embeddings"`` (document rows) or ``"chunks"`` (``output.granularity`` chunk or both);
    by default the run's document rows, or its chunk rows when it wrote only those. The manifest is read here,
    where the transform is made: a folder without a committed run, a head whose rows are not one vector each,
    or integer vectors are refused before the pipeline starts."""

    def __init__(self, output: str, rows: str | None = None, ids: str = "docbeam"):
        super().__init__()
        manifest = output_lib.read_manifest(output)
        self.folder, self.files = committed_files(output, manifest, rows)
        kinds = (manifest.get("kept_fields") or {}).items()
        self._json_fields = tuple(name for name, kind in kinds if kind == "json")
        self._ids = check_ids(ids)

    def expand(self, pipeline):
        from apache_beam.io.parquetio import ReadAllFromParquet

        return (
            pipeline
            | "CommittedFiles" >> beam.Create(self.files)
            | "ReadRows" >> ReadAllFromParquet()
            | "ToBeamChunks" >> beam.Map(chunk_of_row, self._json_fields, None, self._ids)
        )
