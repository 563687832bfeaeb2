"""The ``embedding`` column's Arrow type per ``output.vector_dtype``: one declaration that the embedding head's
rows, chunk rows and the manifest share (pipeline/stages/vectors.py quantizes into it).

Every row of a run has the same length, so the column is a ``fixed_size_list``: pyarrow gives it back as one,
Parquet stores it as a plain LIST (which DuckDB, pandas and BigQuery read), and the manifest says its dimension.
"""

from __future__ import annotations

import pyarrow as pa

VECTOR_DTYPES = ("float32", "float16", "int8", "uint8", "binary")
VALUE_TYPES = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "binary": pa.int8(),
}  # binary: 8 signs per byte, packed as sentence-transformers' "binary" (int8)


def known(vector_dtype: str) -> str:
    if vector_dtype not in VECTOR_DTYPES:
        raise ValueError(f"output.vector_dtype: {vector_dtype!r} is not one of {', '.join(VECTOR_DTYPES)}")
    return vector_dtype


def list_size(dim: int, vector_dtype: str) -> int:
    """Values per row: the dimension, or for ``binary`` one byte per 8 dimensions (the last one zero-padded)."""
    return -(-dim // 8) if known(vector_dtype) == "binary" else dim


def embedding_type(dim: int, vector_dtype: str = "float32") -> pa.DataType:
    """The one Arrow type of every ``embedding`` column docbeam writes (document rows and chunk rows alike)."""
    return pa.list_(VALUE_TYPES[known(vector_dtype)], list_size(dim, vector_dtype))


def describe(dim: int, vector_dtype: str) -> dict:
    """The manifest's ``embedding`` block before calibration: what a reader needs to interpret the column."""
    return {
        "dim": dim,
        "dtype": vector_dtype,
        "list_size": list_size(dim, vector_dtype),
        "value_type": str(VALUE_TYPES[known(vector_dtype)]),
    }


# What each representation of a row costs, for summary.json's ``representations`` (pipeline/stages/commit.py sums
# them over the rows and divides per document): a count and the bytes of the values as written (before Parquet).
SPARSE_TERM_BYTES = 8  # an int32 index and a float32 value


def dense_stats(dim: int, vector_dtype: str) -> dict:
    return {"embedding": {"values": dim, "bytes": list_size(dim, vector_dtype) * VALUE_TYPES[vector_dtype].byte_width}}


def sparse_stats(row: dict) -> dict:
    terms = len(row["sparse_embedding"]["indices"])
    return {"sparse_embedding": {"nonzeros": terms, "bytes": terms * SPARSE_TERM_BYTES}}


def multi_vector_stats(row: dict, width: int, vector_dtype: str) -> dict:
    vectors = len(row["multi_vector"])
    return {"multi_vector": {"vectors": vectors, "bytes": vectors * width * VALUE_TYPES[vector_dtype].byte_width}}
