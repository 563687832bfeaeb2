"""Whole `docbeam run`s of the bge_m3 head (models/heads/bge_m3.py): embeddings/ rows hold FlagEmbedding's three
representations, summary.json gives each one's size per document, an incremental run carries the rows over, and
output.pgvector loads the dense and sparse columns into one table of the real Postgres, where a hybrid query
(dense cosine plus sparse inner product in one ORDER BY) ranks as numpy ranks docbeam's own rows."""

from __future__ import annotations

import glob
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from bge_m3_heads_test import differences, flag_embedding, m3_checkpoint
from conftest import job_config
from multivector_head_test import TEXTS

from docbeam.pipeline.driver.run import run_job

pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")
BATCHING = {"buckets": [16, 32, 48], "tokens_per_batch": 256, "packing": True}


def write_docs(path, texts: dict[str, str]) -> str:
    path.write_text("".join(json.dumps({"id": i, "text": t, "lang": "en"}) + "\n" for i, t in texts.items()))
    return str(path)


def read_rows(out) -> dict[str, dict]:
    return {r["id"]: r for f in sorted(glob.glob(f"{out}/embeddings/*.parquet")) for r in pq.read_table(f).to_pylist()}


@pytest.mark.slow
def test_a_run_writes_the_three_representations_and_an_incremental_run_carries_them_over(tmp_path):
    folder, model, colbert, sparse = m3_checkpoint(str(tmp_path / "model"))
    docs = write_docs(tmp_path / "docs.jsonl", {f"d{i}": t for i, t in enumerate(TEXTS)})
    sections = {"model": {"head": "bge_m3"}, "batching": BATCHING}
    summary = run_job(job_config(docs, str(tmp_path / "out"), folder, **sections))
    rows = read_rows(tmp_path / "out")
    expected = flag_embedding(model, colbert, sparse, folder, TEXTS)
    assert differences([rows[f"d{i}"] for i in range(len(TEXTS))], expected) == []
    assert summary["head"]["name"] == "bge_m3" and summary["embedding_dim"] == 32
    terms = np.mean([len(e["lexical"]) for e in expected])
    vectors = np.mean([len(e["colbert"]) for e in expected])
    assert summary["representations"] == {
        "embedding": {"values_per_document": 32, "bytes_per_document": 128},
        "multi_vector": {"vectors_per_document": round(vectors, 2), "bytes_per_document": round(vectors * 24 * 4, 2)},
        "sparse_embedding": {"nonzeros_per_document": round(terms, 2), "bytes_per_document": round(terms * 8, 2)},
    }
    again = run_job(
        job_config(
            docs, str(tmp_path / "again"), folder, **{**sections, "input": {"reuse_from": str(tmp_path / "out")}}
        )
    )
    assert again["docs_reused"] == len(TEXTS) and read_rows(tmp_path / "again") == rows
    assert again["representations"] == summary["representations"]
    assert_reads_back_as_hybrid_beam_chunks(str(tmp_path / "out"), rows)


def assert_reads_back_as_hybrid_beam_chunks(out: str, rows: dict) -> None:
    """docbeam.ReadBeamChunks: one hybrid Chunk per row, its dense and sparse vectors exactly the row's (a Chunk
    has no place for the ColBERT vectors, which stay in the Parquet files)."""
    import apache_beam as beam
    from apache_beam.testing.util import assert_that

    import docbeam

    def same(chunks):
        assert sorted(c.id for c in chunks) == sorted(rows)
        for c in chunks:
            row = rows[c.id]
            assert c.dense_embedding == [float(x) for x in np.float32(row["embedding"])]
            assert c.sparse_embedding == (
                row["sparse_embedding"]["indices"],
                [float(x) for x in np.float32(row["sparse_embedding"]["values"])],
            )

    with beam.Pipeline() as p:
        assert_that(p | docbeam.ReadBeamChunks(out), same)


def test_the_run_summary_line_names_the_heads_sizes():
    from docbeam.pipeline.driver.cli import format_head, format_sizes

    head = {"name": "bge_m3", "checkpoint_head": None, "pooling": "tokens", "folder": "embeddings"}
    sizes = {"sparse_embedding": {"nonzeros_per_document": 41.5, "bytes_per_document": 332.0}}
    assert format_head(head, None) + format_sizes(sizes, head) == (
        "  head       bge_m3 (dense, sparse and ColBERT) → embeddings/; per document: sparse_embedding 41.5 "
        "nonzeros 332.0 bytes"
    )


# The query shares its rare words with "lexical" only; the others are multivector_head_test's sentences, of
# which the random model's dense vectors put another nearer the query than "lexical".
QUERY = "zephyr quokka xylophone marmalade"
HYBRID_TEXTS = {
    "query": QUERY,
    "lexical": "a quokka, a zephyr and marmalade on the xylophone",
    **{f"d{i}": t for i, t in enumerate(TEXTS)},
}
WEIGHT = 0.5  # of the sparse inner product beside the dense cosine


def hybrid_scores(rows: dict, probe: str, weight: float) -> dict[str, float]:
    """numpy's hybrid score of every other row: cosine of the dense vectors plus ``weight`` × the sparse inner
    product (what the SQL below orders by, negated)."""
    q = np.asarray(rows[probe]["embedding"], np.float64)
    q_terms = dict(zip(rows[probe]["sparse_embedding"]["indices"], rows[probe]["sparse_embedding"]["values"]))
    scores = {}
    for doc_id, row in rows.items():
        if doc_id == probe:
            continue
        e = np.asarray(row["embedding"], np.float64)
        sparse = row["sparse_embedding"]
        inner = sum(v * q_terms.get(i, 0.0) for i, v in zip(sparse["indices"], sparse["values"]))
        scores[doc_id] = float(q @ e / np.linalg.norm(q) / np.linalg.norm(e)) + weight * inner
    return scores


@pytest.mark.slow
@pytest.mark.extra
def test_a_bge_m3_run_loads_dense_and_sparse_columns_and_a_hybrid_query_ranks_as_numpy(tmp_path, postgres):
    from pgvector_sparse_test import parse_sparsevec
    from pgvector_test import query

    folder, *_ = m3_checkpoint(str(tmp_path / "model"))
    docs = write_docs(tmp_path / "docs.jsonl", HYBRID_TEXTS)
    sections = {
        "model": {"head": "bge_m3"},
        "batching": BATCHING,
        "input": {"keep_fields": ["lang"]},
        "output": {"pgvector": {"dsn": postgres, "table": "m3"}},
    }
    summary = run_job(job_config(docs, str(tmp_path / "out"), folder, **sections))
    assert summary["pgvector"]["upserted"] == len(HYBRID_TEXTS)
    assert summary["pgvector"]["not_loaded"] == ["multi_vector"]
    rows = read_rows(tmp_path / "out")
    loaded = query(postgres, "SELECT id, embedding::text, sparse_embedding::text, fields FROM m3 ORDER BY id")
    assert [r[0] for r in loaded] == sorted(rows)
    for doc_id, dense, sparse_text, fields in loaded:
        dim, terms = parse_sparsevec(sparse_text)
        assert dim == 30522 and fields == {"lang": "en"}
        assert sorted(terms) == rows[doc_id]["sparse_embedding"]["indices"]
        assert np.allclose(json.loads(dense), rows[doc_id]["embedding"], rtol=1e-6)
    probe = rows["query"]
    dense_literal = json.dumps(probe["embedding"])
    sparse_literal = (
        "{"
        + ",".join(
            f"{i + 1}:{v!r}" for i, v in zip(probe["sparse_embedding"]["indices"], probe["sparse_embedding"]["values"])
        )
        + "}/30522"
    )
    dense_only = hybrid_scores(rows, "query", 0.0)
    expected = sorted((s, i) for i, s in hybrid_scores(rows, "query", WEIGHT).items())[::-1]
    ranked = query(
        postgres,
        "SELECT id FROM m3 WHERE id <> 'query' ORDER BY (embedding <=> %s::vector) "
        "+ %s * (sparse_embedding <#> %s::sparsevec), id",
        (dense_literal, WEIGHT, sparse_literal),
    )
    assert [r[0] for r in ranked] == [i for _, i in expected]
    by_meaning = sorted(dense_only, key=lambda i: -dense_only[i])
    assert by_meaning[0] != "lexical" and ranked[0] == ("lexical",)  # the shared rare words put it first
    assert [r[0] for r in ranked[1:]] == [i for i in by_meaning if i != "lexical"]  # no shared term: by meaning


@pytest.mark.slow
@pytest.mark.extra
def test_bge_m3_rows_in_a_shared_table_follow_their_runs_through_removal_rejection_and_an_odd_id(tmp_path, postgres):
    """Two outputs in one table, an incremental run that drops a document, a document rejected (no tokens) and an
    id holding a line break: the table ends as each output's last committed run, both vector columns equal to the
    Parquet rows, and neither output deletes the other's rows."""
    from pgvector_sparse_test import parse_sparsevec
    from pgvector_test import query

    folder, *_ = m3_checkpoint(str(tmp_path / "model"))
    texts = list(TEXTS)
    order = ["a0", "a1", "line\nbreak", "a2", "o0"]  # each id keeps its text from run to run

    def run(name, ids, reuse=None):
        path = tmp_path / f"{name}.jsonl"
        lines = [{"id": i, "text": texts[order.index(i) % len(texts)]} for i in ids] + [{"id": "empty", "text": ""}]
        path.write_text("".join(json.dumps(d) + "\n" for d in lines))
        sections = {
            "model": {"head": "bge_m3"},
            "batching": BATCHING,
            "input": {"max_rejected_fraction": 0.5, **({"reuse_from": str(tmp_path / reuse)} if reuse else {})},
            "output": {"pgvector": {"dsn": postgres, "table": "shared"}},
        }
        return run_job(job_config(str(path), str(tmp_path / name), folder, **sections))

    first = run("a", ["a0", "a1", "line\nbreak"])
    assert first["docs_rejected"] == 1  # "empty": no tokens, never loaded
    run("other", ["o0"])
    second = run("b", ["a1", "line\nbreak", "a2"], reuse="a")
    assert second["docs_reused"] == 2, second["reuse"]
    assert second["pgvector"]["upserted"] >= 1
    loaded = {r[0]: r[1:] for r in query(postgres, "SELECT id, embedding::text, sparse_embedding::text FROM shared")}
    assert sorted(loaded) == sorted(["a1", "a2", "line\nbreak", "o0"])
    for out in ("b", "other"):
        for doc_id, row in read_rows(tmp_path / out).items():
            dense, sparse = loaded[doc_id]
            assert np.allclose(json.loads(dense), row["embedding"], rtol=1e-6), doc_id
            assert sorted(parse_sparsevec(sparse)[1]) == row["sparse_embedding"]["indices"], doc_id
