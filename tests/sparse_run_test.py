"""The sparse head's rows and runs (models/heads/sparse.py): a long document's vector from its windows, pruning
into rows, the outputs a sparse head refuses, and whole `docbeam run`s whose embeddings/ rows equal
``SparseEncoder.encode_document`` (first window) or the max over its vectors of every window docbeam cut."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from sparse_head_test import TEXTS, assert_same_sparse_vectors, reference_vectors, sparse_checkpoint

from docbeam.config import ModelConfig
from docbeam.models import checkpoint
from docbeam.models.heads.registry import resolve


def window(index, count, vector, length=30):
    """A window as Encode hands it on: the sparse head's nonzero terms of its vector."""
    from docbeam.models.heads.sparse import SparseHead
    from docbeam.pipeline.records import WindowEmbedding

    terms = SparseHead.compact_window(None, np.asarray(vector, np.float32))
    return WindowEmbedding(
        doc_id="d",
        index=index,
        num_windows=count,
        length=length,
        doc_tokens=90,
        truncated=False,
        vector=terms,
        bucket_len=64,
        backend="native",
    )


@pytest.fixture(scope="module")
def bert_max(tmp_path_factory):
    return sparse_checkpoint(str(tmp_path_factory.mktemp("bert-rows")), "bert", "max")


def test_a_long_documents_vector_is_its_first_window_or_every_windows_as_the_pooling_combines(bert_max):
    ck = checkpoint.open_checkpoint(bert_max)
    windows = [window(1, 2, [0.0, 2.0, 1.0, 0.0]), window(0, 2, [3.0, 0.0, 2.0, 0.0])]

    def row(pooling, **sparse):
        head = resolve(ck, "auto", ModelConfig(path=bert_max, sparse=sparse))
        return dataclasses.replace(head, pooling=pooling, width=4).document_row(windows)["sparse_embedding"]

    assert row("max") == {"indices": [0, 2], "values": [3.0, 2.0]}  # the first window: SparseEncoder truncates
    assert row("max", windows="all") == {"indices": [0, 1, 2], "values": [3.0, 2.0, 2.0]}
    assert row("sum", windows="all") == {"indices": [0, 1, 2], "values": [3.0, 2.0, 3.0]}
    assert row("max", windows="all", max_terms=2, threshold=2.5) == {"indices": [0], "values": [3.0]}
    head = resolve(ck, "auto", ModelConfig(path=bert_max))
    assert head.document_row([window(0, 1, [np.nan] * 4)]).startswith("the sparse vector has NaN")
    assert head.reusable({"sparse_embedding": {"indices": [3, 70], "values": [0.5, 1.0]}})
    assert not head.reusable({"sparse_embedding": {"indices": [70, 3], "values": [0.5, 1.0]}})  # not ascending


def test_a_sparse_encoder_is_not_embedded_as_a_dense_model(bert_max):
    with pytest.raises(checkpoint.CheckpointError, match="model.head: embedding, but .* makes a SparseEncoder"):
        resolve(checkpoint.open_checkpoint(bert_max), "embedding", ModelConfig(path=bert_max))


@pytest.mark.parametrize(
    "sets, match",
    [
        ({"output": {"vector_dtype": "int8"}}, "output.vector_dtype: int8: model.head resolved to sparse"),
        (
            {"output": {"granularity": "chunk", "chunking": "late"}},
            "output.chunking: late: model.head resolved to sparse",
        ),
    ],
)
def test_outputs_that_take_dense_vectors_are_refused_for_sparse_rows(tmp_path, bert_max, sets, match):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    with pytest.raises(ConfigError, match=match):
        make_plan(
            job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), bert_max, **sets), probe_backends=False
        )


@pytest.mark.slow
@pytest.mark.parametrize("packing, backend", [(True, "native"), (False, "chunked")])
def test_docbeam_run_writes_sparse_encoders_vectors(tmp_path, bert_max, packing, backend):
    """A whole run: embeddings/ rows' sparse_embedding equal encode_document's, the summary gives the terms per
    document, and an incremental run carries every row over unchanged."""
    import glob

    import pyarrow.parquet as pq
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in TEXTS.items()))
    sections = dict(
        batching={"buckets": [32, 64], "tokens_per_batch": 512, "packing": packing}, attention={"backend": backend}
    )
    summary = run_job(job_config(str(docs), str(tmp_path / "out"), bert_max, **sections))

    def read(out):
        return {
            r["id"]: r for f in sorted(glob.glob(f"{out}/embeddings/*.parquet")) for r in pq.read_table(f).to_pylist()
        }

    rows = read(tmp_path / "out")
    reference = reference_vectors(bert_max, list(TEXTS.values()))
    ours = np.zeros_like(reference)
    for i, doc_id in enumerate(TEXTS):
        sparse = rows[doc_id]["sparse_embedding"]
        assert sparse["indices"] == sorted(sparse["indices"])
        ours[i, sparse["indices"]] = sparse["values"]
    assert_same_sparse_vectors(ours, reference, (packing, backend))
    assert summary["head"]["name"] == "sparse" and summary["head"]["pooling"] == "max"
    terms = (reference > 0).sum(1).mean()
    sizes = {
        "nonzeros_per_document": pytest.approx(terms, abs=0.01),
        "bytes_per_document": pytest.approx(8 * terms, abs=0.01),
    }
    assert summary["representations"] == {"sparse_embedding": sizes}
    again = run_job(
        job_config(
            str(docs), str(tmp_path / "again"), bert_max, **{**sections, "input": {"reuse_from": str(tmp_path / "out")}}
        )
    )
    assert again["docs_reused"] == len(TEXTS) and read(tmp_path / "again") == rows


def test_the_run_summary_line_names_the_sparse_head():
    from docbeam.pipeline.driver.cli import format_head

    head = {"name": "sparse", "checkpoint_head": "BertForMaskedLM", "pooling": "max", "folder": "embeddings"}
    assert format_head(head, None) == "  head       sparse (BertForMaskedLM, max pooling) → embeddings/"


@pytest.mark.slow
def test_a_run_of_every_window_gives_the_max_of_sparse_encoders_vectors_of_its_windows(tmp_path, bert_max):
    """model.sparse.windows: all, max pooling: a long document's vector is, term by term, the max over
    SparseEncoder's vectors of the windows docbeam cut (the same token ids, each window with [CLS] and [SEP])."""
    import glob

    import pyarrow.parquet as pq
    import torch
    from conftest import job_config
    from sentence_transformers import SparseEncoder

    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.driver.run import run_job
    from docbeam.pipeline.records import Document
    from docbeam.pipeline.stages.tokenize import windows_for

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in TEXTS.items()))
    cfg = job_config(
        str(docs),
        str(tmp_path / "out"),
        bert_max,
        model={"sparse": {"windows": "all"}},
        batching={"buckets": [32, 64], "tokens_per_batch": 512, "packing": True},
    )
    summary = run_job(cfg)
    rows = {r["id"]: r for f in glob.glob(f"{tmp_path}/out/embeddings/*.parquet") for r in pq.read_table(f).to_pylist()}
    plan = make_plan(cfg, probe_backends=False)
    windows = windows_for(
        [Document(i, t, "docs.jsonl", n) for n, (i, t) in enumerate(TEXTS.items())],
        checkpoint.load_tokenizer(bert_max),
        window_len=plan.window_len,
        config=plan.tokenize,
    )
    assert max(w.num_windows for w in windows) > 1  # some documents are longer than one window
    model = SparseEncoder(bert_max, device="cpu")
    reference = np.zeros((len(TEXTS), 30522))
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor(np.asarray(w.token_ids, np.int64))[None]
            vector = model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})["sentence_embedding"][0]
            row = list(TEXTS).index(w.doc_id)
            reference[row] = np.maximum(reference[row], vector.numpy())
    ours = np.zeros_like(reference)
    for i, doc_id in enumerate(TEXTS):
        ours[i, rows[doc_id]["sparse_embedding"]["indices"]] = rows[doc_id]["sparse_embedding"]["values"]
    assert_same_sparse_vectors(ours, reference, "windows: all")
    assert summary["head"]["windows"] == "all"


@pytest.mark.slow
def test_chunk_rows_carry_each_windows_sparse_vector_pruned_as_documents_are(tmp_path, bert_max):
    """granularity both, every window: a one-window document's chunk is encode_document of the chunk's text
    alone (and its document's row); a longer document's row is the max over its chunks' (max pooling). Then
    max_terms prunes chunk rows as it prunes document rows."""
    import glob

    import pyarrow.parquet as pq
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in TEXTS.items()))

    def run(name, **sparse):
        run_job(
            job_config(
                str(docs),
                str(tmp_path / name),
                bert_max,
                model={"sparse": {"windows": "all", **sparse}},
                output={"granularity": "both"},
                batching={"buckets": [32, 64], "tokens_per_batch": 512, "packing": True},
            )
        )
        read = lambda folder: [
            r
            for f in sorted(glob.glob(f"{tmp_path}/{name}/{folder}/*.parquet"))  # noqa: E731
            for r in pq.read_table(f).to_pylist()
        ]
        return {r["id"]: r for r in read("embeddings")}, read("chunks")

    rows, chunks = run("out")
    dense = lambda sparse: np.bincount(sparse["indices"], sparse["values"], minlength=30522)  # noqa: E731
    one_window = [c for c in chunks if rows[c["document_id"]]["num_windows"] == 1]
    assert one_window and len(one_window) < len(chunks)  # some documents have several chunks
    reference = reference_vectors(bert_max, [c["chunk_text"] for c in one_window])
    ours = np.stack([dense(c["sparse_embedding"]) for c in one_window])
    assert_same_sparse_vectors(ours, reference, "one-window chunks")
    for c in one_window:
        assert c["sparse_embedding"] == rows[c["document_id"]]["sparse_embedding"]
    for doc_id, row in rows.items():
        own = [dense(c["sparse_embedding"]) for c in chunks if c["document_id"] == doc_id]
        assert len(own) == row["num_windows"]
        np.testing.assert_array_equal(np.max(own, axis=0), dense(row["sparse_embedding"]))
    _, pruned = run("pruned", max_terms=3)
    assert {len(c["sparse_embedding"]["indices"]) for c in pruned} == {3}
    by_key = {(c["document_id"], c["chunk_index"]): c for c in chunks}
    for c in pruned:
        full = by_key[c["document_id"], c["chunk_index"]]["sparse_embedding"]
        assert sorted(c["sparse_embedding"]["values"]) == sorted(full["values"])[-3:]
