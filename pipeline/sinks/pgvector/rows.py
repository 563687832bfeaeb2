"""What a Postgres load reads of a committed run: its rows (vectors or scores, kept fields as jsonb text), checked
against the manifest first, each row Postgres cannot take named rather than failing the load, and the binary COPY
form of a vector row (load.py runs the load)."""

from __future__ import annotations

import json
import struct
from typing import Callable, Iterator, NamedTuple

import numpy as np

from docbeam.models.heads.registry import described
from docbeam.pipeline.store import storage
from docbeam.pipeline.store.output import EMBEDDINGS, ERRORS, SCORES, SUMMARY, in_folder

# A classifier's run (scores/) loads into a table of its own shape: the label, the top score, every label's
# score in id2label order (the names: the manifest's head.labels), the kept fields.
SCORES_TABLE = (
    "label text, score real NOT NULL, scores real[] NOT NULL",
    ("label", "score", "scores"),
    ["text", "text", "float4", "float4[]", "jsonb"],
)


class TableLayout(NamedTuple):
    folder: str  # where the committed run's rows are
    kind: str  # the table they load into: "scores", "dense_and_sparse", "sparse" or "dense"
    not_loaded: list[str]  # row columns with no column in the table (pgvector has no list of vectors per row)
    dims: dict  # the loaded vector columns' dimensions, by name


def table_layout(manifest: dict) -> TableLayout:
    """What the committed run's rows hold, as the table loads them, from the kinds of the head's columns that the
    manifest lists (models/heads/: a head is never asked by name): a dense ``vector`` column, a ``sparse_vector``
    one, both, or a classifier's ``label``/``score``/``scores``; ``multi_vector`` columns are left out."""
    head = described(manifest.get("head") or {"name": "embedding", "folder": EMBEDDINGS})
    columns = head["columns"]
    kinds = {c["kind"] for c in columns}
    dims = {c["name"]: c["dim"] for c in columns if c["kind"] in ("vector", "sparse_vector")}
    if "vector" in kinds and "sparse_vector" in kinds:
        kind = "dense_and_sparse"
    elif kinds & {"vector", "sparse_vector"}:
        kind = "dense" if "vector" in kinds else "sparse"
    else:
        kind = "scores"
    loaded = {"scores": SCORES_TABLE[1]}.get(kind, tuple(dims))
    return TableLayout(head["folder"], kind, [c["name"] for c in columns if c["name"] not in loaded], dims)


def committed_values(output: str, manifest: dict, folder: str, values: tuple[str, ...]) -> Iterator[tuple]:
    """``(id, *values, kept fields as JSON)`` for every row of the committed files in ``folder``; the kept fields
    are the columns the manifest's ``kept_fields`` names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kept_columns = manifest.get("kept_fields") or {}
    json_columns = {name for name, kind in kept_columns.items() if kind == "json"}
    for f in manifest["files"]:
        if not in_folder(f["path"], folder):
            continue
        table = pq.read_table(pa.BufferReader(storage.read_bytes(storage.join(output, f["path"]))))
        kept = table.select([c for c in table.column_names if c in kept_columns]).to_pylist()
        for row, fields in zip(table.select(["id", *values]).to_pylist(), kept):
            fields = {k: json.loads(v) if k in json_columns and v is not None else v for k, v in fields.items()}
            yield row["id"], *(row[v] for v in values), kept_json(fields)


def committed_scores(output: str, manifest: dict) -> Iterator[tuple]:
    """``(id, label, score, scores, kept fields as JSON)`` for every row of the committed scores files."""
    return committed_values(output, manifest, SCORES, ("label", "score", "scores"))


def committed_sparse(output: str, manifest: dict) -> Iterator[tuple]:
    """``(id, {"indices", "values"}, kept fields as JSON)`` for every row of a sparse head's embeddings files."""
    return committed_values(output, manifest, EMBEDDINGS, ("sparse_embedding",))


def committed_rows(output: str, manifest: dict) -> Iterator[tuple[str, np.ndarray, str]]:
    """``(id, float32 vector, kept fields as JSON)`` for every row of the committed embeddings files. A kept
    column of JSON text (the manifest's ``kept_fields`` type ``json``: values of no one Arrow type) goes in as
    the JSON value it holds, not as a string."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kept_columns = manifest.get("kept_fields") or {}
    json_columns = {name for name, kind in kept_columns.items() if kind == "json"}
    for f in manifest["files"]:
        if not in_folder(f["path"], EMBEDDINGS):
            continue
        table = pq.read_table(pa.BufferReader(storage.read_bytes(storage.join(output, f["path"]))))
        flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        vectors = np.asarray(flat, np.float32).reshape(table.num_rows, -1)
        kept = table.select([c for c in table.column_names if c in kept_columns]).to_pylist()
        for doc_id, vector, fields in zip(table.column("id").to_pylist(), vectors, kept):
            fields = {k: json.loads(v) if k in json_columns and v is not None else v for k, v in fields.items()}
            yield doc_id, vector, kept_json(fields)


def committed_dense_and_sparse(output: str, manifest: dict) -> Iterator[tuple]:
    """``(id, dense vector, {"indices", "values"}, kept fields as JSON)`` for every row whose head writes both
    (bge_m3's; its multi_vector is not read: pgvector has no column of a list of vectors per row)."""
    return committed_values(output, manifest, EMBEDDINGS, ("embedding", "sparse_embedding"))


def vector_layout(output: str, manifest: dict) -> tuple[list[str], Iterator[tuple], Callable[[tuple], bytes]]:
    """An embeddings/ table's vector columns by the run's head (a dense ``vector``, a sparse head's ``sparsevec``
    of the vocabulary's width, or both), its committed rows, and each row's binary COPY tuple."""
    layout = table_layout(manifest)
    kind = layout.kind
    if kind == "dense_and_sparse":
        dense, vocab = int(layout.dims["embedding"]), int(layout.dims["sparse_embedding"])
        return (
            [f"embedding vector({dense})", f"sparse_embedding sparsevec({vocab})"],
            committed_dense_and_sparse(output, manifest),
            lambda r: copy_tuple(
                r[0], vector_bytes(np.asarray(r[1], np.float32)), sparsevec_bytes(r[2], vocab), fields=r[-1]
            ),
        )
    dim = dimension(output)
    if kind == "sparse":
        return (
            [f"sparse_embedding sparsevec({dim})"],
            committed_sparse(output, manifest),
            lambda r: copy_tuple(r[0], sparsevec_bytes(r[1], dim), fields=r[-1]),
        )
    return [f"embedding vector({dim})"], committed_rows(output, manifest), lambda r: binary_row(*r)


def sparsevec_bytes(sparse: dict, dim: int) -> bytes:
    """pgvector's binary sparsevec: its dimension, the number of terms, a reserved 0, the 0-based indices
    (ascending), the float4s."""
    indices, values = np.asarray(sparse["indices"], ">i4"), np.asarray(sparse["values"], ">f4")
    return struct.pack(">iii", dim, len(indices), 0) + indices.tobytes() + values.tobytes()


# Postgres' binary COPY: its signature, no flags, no header extension; a field count of -1 ends the data.
COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
COPY_TRAILER = struct.pack(">h", -1)


def binary_row(doc_id: str, vector: np.ndarray, fields: str) -> bytes:
    """One tuple of binary COPY into (id text, embedding vector, fields jsonb): each field a length and its
    bytes; pgvector's binary vector is its dimension, a reserved 0 and big-endian float4s, so each float32
    goes in exactly as written, without a decimal round trip (ten times faster than text on a 384-wide vector)."""
    return copy_tuple(doc_id, vector_bytes(vector), fields=fields)


def vector_bytes(vector: np.ndarray) -> bytes:
    return struct.pack(">hh", len(vector), 0) + vector.astype(">f4").tobytes()


def copy_tuple(doc_id: str, *vectors: bytes, fields: str) -> bytes:
    """(id, each vector's binary form, fields): each field a length and its bytes."""
    parts = [doc_id.encode("utf-8"), *vectors, b"\x01" + fields.encode("utf-8")]  # jsonb: version 1, the JSON text
    return struct.pack(">h", len(parts)) + b"".join(struct.pack(">i", len(p)) + p for p in parts)


def check_files(output: str, manifest: dict) -> None:
    """Every file the load reads has the size and checksum its manifest lists (as incremental reuse checks), so a
    damaged or replaced file is never loaded."""
    sizes = storage.list_files(output)
    for f in manifest["files"]:
        if not (in_folder(f["path"], table_layout(manifest).folder) or in_folder(f["path"], ERRORS)):
            continue
        path = storage.join(output, f["path"])
        if sizes.get(path) != f["size"] or ("checksum" in f and storage.checksum(path) != f["checksum"]):
            raise ValueError(
                f"{f['path']} in {output} is not the file its manifest lists (size {f['size']}, "
                f"{f.get('checksum')}): damaged or replaced since the commit; nothing was loaded. Run "
                "the job again to commit a sound output"
            )


MAX_ID_BYTES = 2000  # a btree index entry holds about 2,700 bytes: longer ids cannot be primary keys


def load_problem(doc_id: str, fields: str) -> str | None:
    """Why Postgres cannot take this row (it then becomes one rejection of the load, not the load's failure)."""
    if "\x00" in doc_id or "\\u0000" in fields:
        return "a NUL character in the id or a kept field (Postgres text and jsonb cannot hold one)"
    if len(doc_id.encode("utf-8")) > MAX_ID_BYTES:
        return f"an id of {len(doc_id.encode('utf-8'))} bytes (a Postgres key holds at most {MAX_ID_BYTES})"
    return None


def kept_json(fields: dict) -> str:
    """Kept fields as jsonb text; NaN and infinities (which JSON has no spelling for) become null."""

    def finite(value):
        if isinstance(value, float) and not np.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, list):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(fields), ensure_ascii=False, default=str, allow_nan=False)


def dimension(output: str) -> int:
    summary = json.loads(storage.read_bytes(storage.join(output, SUMMARY)))
    return int(summary["embedding_dim"])  # the width written (after model.truncate_dim)
