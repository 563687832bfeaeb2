"""Beam's own RAG writers (``apache_beam.ml.rag.ingestion``) taking docbeam's hybrid Chunks: the dense run's vector
and the SPLADE run's sparse terms of each document (tests/beam_chunks_test.py ``hybrid_runs``), read back with
``docbeam.ReadBeamChunks`` and joined by id.

Qdrant's writer is pure Python and runs whole, in Qdrant's local mode. Postgres' writer is a cross-language
transform: its ``WriteToJdbc`` needs Beam's Java expansion service jar, which Beam fetches from Maven Central, and
this machine cannot reach it (``~/.m2`` holds the Postgres JDBC driver but no Beam jar). So its Python half runs
(``ColumnSpecsBuilder``'s specs, the INSERT ``PostgresVectorWriterConfig``'s query builder makes, its row converter
and the RowCoder records between Beam steps) and the statement executes against the real Postgres with psycopg
(JDBC's ``?`` as psycopg's ``%s``); only the JdbcIO transport is not run here."""

from __future__ import annotations

import json

import apache_beam as beam
import numpy as np
import pytest
from beam_chunks_test import hybrid_runs, rows_of  # noqa: F401  the session's SPLADE and dense runs

from docbeam.pipeline.stages.rag_chunks import chunk_id

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")]
VOCABULARY = 30522  # the SPLADE checkpoint's (BERT's tokenizer)


def hybrid(item):
    """``(id, {"dense": [Chunk], "sparse": [Chunk]})`` → one Chunk carrying both vectors."""
    from apache_beam.ml.rag.types import Chunk, Embedding

    [dense], [sparse] = item[1]["dense"], item[1]["sparse"]
    assert dense.metadata == sparse.metadata
    return Chunk(
        dense.content, dense.id, dense.index, dense.metadata, Embedding(dense.dense_embedding, sparse.sparse_embedding)
    )


def hybrid_chunks(p, runs: dict, ids: str):
    import docbeam

    read = {
        name: p
        | f"Read{name}" >> docbeam.ReadBeamChunks(runs[name], ids=ids)
        | f"Key{name}" >> beam.Map(lambda c: (c.id, c))
        for name in ("dense", "sparse")
    }
    return read | "JoinById" >> beam.CoGroupByKey() | "Hybrid" >> beam.Map(hybrid)


def committed(runs: dict) -> dict[str, dict]:
    """Each document's committed values: its dense vector, its sparse terms, its kept fields."""
    dense = {r["id"]: r for r in rows_of(runs["dense"])}
    return {
        r["id"]: {
            "dense": np.float32(dense[r["id"]]["embedding"]),
            "indices": r["sparse_embedding"]["indices"],
            "values": np.float32(r["sparse_embedding"]["values"]),
            "payload": {"lang": r["lang"], "meta": json.loads(r["meta"]), "document_id": r["id"]},
        }
        for r in rows_of(runs["sparse"])
    }


def ranked(values: dict, probe: str, score) -> list[str]:
    """Every document by its score against ``probe``'s, best first."""
    return sorted(values, key=lambda i: -score(values[probe], values[i]))


def sparse_dot(a, b) -> float:
    terms = dict(zip(b["indices"], b["values"]))
    return float(sum(v * terms.get(i, 0.0) for i, v in zip(a["indices"], a["values"])))


def test_beams_qdrant_writer_stores_docbeams_hybrid_chunks(hybrid_runs, tmp_path):
    from apache_beam.ml.rag.ingestion.base import VectorDatabaseWriteTransform
    from apache_beam.ml.rag.ingestion.qdrant import QdrantConnectionParameters, QdrantWriteConfig
    from qdrant_client import QdrantClient, models

    values = committed(hybrid_runs)
    dim, path = len(next(iter(values.values()))["dense"]), str(tmp_path / "qdrant")
    client = QdrantClient(path=path)  # dot product: Qdrant keeps the vectors as given (cosine would normalise them)
    client.create_collection(
        "docs",
        vectors_config={"dense": models.VectorParams(size=dim, distance=models.Distance.DOT)},
        sparse_vectors_config={"sparse": models.SparseVectorParams()},
    )
    client.close()  # local mode: one client a folder at a time
    with beam.Pipeline() as p:
        hybrid_chunks(p, hybrid_runs, "uuid5") | VectorDatabaseWriteTransform(
            QdrantWriteConfig(QdrantConnectionParameters.local(path), "docs")
        )

    client = QdrantClient(path=path)
    uuids = {chunk_id({"id": i}, "uuid5"): i for i in values}
    points = client.retrieve("docs", list(uuids), with_vectors=True, with_payload=True)
    assert sorted(uuids[str(p.id)] for p in points) == sorted(values) == sorted(hybrid_runs["texts"])
    for point in points:
        want = values[uuids[str(point.id)]]
        assert np.array_equal(np.float32(point.vector["dense"]), want["dense"])
        assert list(point.vector["sparse"].indices) == want["indices"]
        assert np.array_equal(np.float32(point.vector["sparse"].values), want["values"])
        assert point.payload == want["payload"]
    probe = values["d5"]
    found = client.query_points(
        "docs", query=models.SparseVector(indices=probe["indices"], values=probe["values"]), using="sparse", limit=3
    ).points
    assert [uuids[str(p.id)] for p in found] == ranked(values, "d5", sparse_dot)[:3]
    found = client.query_points("docs", query=probe["dense"].tolist(), using="dense", limit=3).points
    assert [uuids[str(p.id)] for p in found] == ranked(values, "d5", lambda a, b: float(a["dense"] @ b["dense"]))[:3]
    client.close()


def sparsevec(sparse) -> str:
    """Beam's (indices, values) as pgvector's sparsevec text (1-based indices; each float32 exactly)."""
    indices, values = sparse
    return "{" + ",".join(f"{i + 1}:{v!r}" for i, v in zip(indices, values)) + f"}}/{VOCABULARY}"


def four_decimals(values) -> str:  # the converter Beam's own docstring shows: lossy, so the round trip must see it
    return "{" + ",".join(f"{x:.4f}" for x in values) + "}"


def postgres_config(dsn: str, table: str, embedding_convert=None):
    """Beam's PostgresVectorWriterConfig for the hybrid table: its id, dense (float[] → vector), Beam's default
    sparse column (jsonb), a sparsevec column of docbeam's own spec, and the metadata (jsonb)."""
    from apache_beam.ml.rag.ingestion.jdbc_common import ConnectionConfig
    from apache_beam.ml.rag.ingestion.postgres import PostgresVectorWriterConfig
    from apache_beam.ml.rag.ingestion.postgres_common import ColumnSpec, ColumnSpecsBuilder, ConflictResolution

    specs = (
        ColumnSpecsBuilder()
        .with_id_spec()
        .with_embedding_spec(convert_fn=embedding_convert)
        .with_sparse_embedding_spec(column_name="sparse_terms")
        .with_metadata_spec()
        .add_custom_column_spec(
            ColumnSpec("sparse_embedding", str, lambda c: sparsevec(c.sparse_embedding), "::sparsevec")
        )
        .build()
    )
    return PostgresVectorWriterConfig(
        ConnectionConfig(jdbc_url=f"jdbc:postgresql://{dsn.split('@')[-1]}", username="postgres", password=""),
        table,
        column_specs=specs,
        conflict_resolution=ConflictResolution("id", "UPDATE"),
    )


class ExecuteInsert(beam.DoFn):
    """What JdbcIO does with each record, done by psycopg: the builder's statement with the record's values."""

    def __init__(self, dsn: str, statement: str):
        super().__init__()
        self._dsn, self._statement = dsn, statement.replace("?", "%s")

    def setup(self):
        import psycopg

        self._conn = psycopg.connect(self._dsn, autocommit=True)

    def process(self, record):
        self._conn.execute(self._statement, tuple(record))

    def teardown(self):
        self._conn.close()


@pytest.mark.extra
@pytest.mark.parametrize("convert, exact", [(None, True), (four_decimals, False)], ids=["beams-default", "lossy"])
def test_beams_postgres_writer_statement_loads_hybrid_chunks_into_the_real_postgres(
    hybrid_runs, postgres, convert, exact
):
    from pgvector_sparse_test import parse_sparsevec
    from pgvector_test import query

    values, table = committed(hybrid_runs), f"beam_hybrid_{'exact' if exact else 'lossy'}"
    dim = len(next(iter(values.values()))["dense"])
    query(postgres, "CREATE EXTENSION IF NOT EXISTS vector")
    query(
        postgres,
        f"CREATE TABLE {table} (id text PRIMARY KEY, embedding vector({dim}), sparse_terms jsonb, "
        f"metadata jsonb, sparse_embedding sparsevec({VOCABULARY}))",
    )
    config = postgres_config(postgres, table, convert)
    statement = config.query_builder.build_insert()
    assert f"INSERT INTO {table}" in statement and "?::float[]" in statement and "?::sparsevec" in statement
    with beam.Pipeline() as p:
        (
            hybrid_chunks(p, hybrid_runs, "docbeam")
            | "ToRecords" >> beam.Map(config.query_builder.create_converter())
            | "Insert" >> beam.ParDo(ExecuteInsert(postgres, statement))
        )

    loaded = query(postgres, f"SELECT id, embedding::text, sparse_terms, metadata, sparse_embedding::text FROM {table}")
    assert sorted(r[0] for r in loaded) == sorted(values)
    differ = set()
    for doc_id, dense, terms, metadata, sparse in loaded:
        want = values[doc_id]
        dimension, pg_terms = parse_sparsevec(sparse)
        assert dimension == VOCABULARY and sorted(pg_terms) == want["indices"] and metadata == want["payload"]
        assert np.array_equal(np.float32([pg_terms[i] for i in want["indices"]]), want["values"])
        assert np.array_equal(np.float32([terms[str(i)] for i in want["indices"]]), want["values"])
        if not np.array_equal(np.float32(json.loads(dense)), want["dense"]):
            differ.add(doc_id)
    assert differ == (set() if exact else set(values))  # the lossy converter is caught on every row
    if exact:  # a hybrid query: sparse inner product plus dense cosine similarity

        def score(a, b):
            return sparse_dot(a, b) + float(a["dense"] @ b["dense"]) / np.linalg.norm(a["dense"]) / np.linalg.norm(
                b["dense"]
            )

        probe = values["d5"]
        found = query(
            postgres,
            f"SELECT id FROM {table} WHERE id <> 'd5' ORDER BY (sparse_embedding <#> %s::sparsevec)"
            f" + (embedding <=> %s::vector) LIMIT 1",
            (sparsevec((probe["indices"], probe["values"].tolist())), json.dumps(probe["dense"].tolist())),
        )
        assert found == [([i for i in ranked(values, "d5", score) if i != "d5"][0],)]
