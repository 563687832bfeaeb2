"""docbeam's rows as Beam's own ``apache_beam.ml.rag.types.Chunk`` (pipeline/stages/rag_chunks.py): the mapping,
``EmbedDocuments(beam_chunks=True)`` and ``ReadBeamChunks`` on committed runs giving the same Chunks, and Beam's
maintained writers taking them (tests/beam_writers_test.py)."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest

from docbeam.pipeline.stages.rag_chunks import NotChunks, chunk_of_row

pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")
LANGS = ("en", "de")


def test_a_row_becomes_beams_chunk_holding_every_value_exactly():
    from apache_beam.ml.rag.types import Chunk

    dense, values = np.float32([0.1, -1 / 3, 2e-8]), np.float32([0.7, 1 / 7])
    row = {
        "id": "doc-7",
        "embedding": dense.tolist(),
        "sparse_embedding": {"indices": [5, 900], "values": values},
        "num_tokens": 9,
        "num_windows": 1,
        "truncated": False,
        "content_hash": "h",
        "lang": "en",
        "meta": '{"a": 1}',
    }
    chunk = chunk_of_row(row, json_fields=("meta",), text="the text")
    assert isinstance(chunk, Chunk) and (chunk.id, chunk.index, chunk.content.text) == ("doc-7", 0, "the text")
    assert chunk.metadata == {"lang": "en", "meta": {"a": 1}, "document_id": "doc-7"}
    assert np.array_equal(np.float32(chunk.dense_embedding), dense) and chunk.dense_embedding[1] != -1 / 3
    assert chunk.sparse_embedding == ([5, 900], values.astype(np.float64).tolist())
    assert chunk_of_row({**row, "embedding": None}).dense_embedding is None


def test_a_chunk_row_carries_its_span_and_text_and_an_id_of_its_own():
    row = {
        "document_id": "a#1",
        "chunk_index": 2,
        "char_start": 4,
        "char_end": 9,
        "chunk_text": "quick",
        "embedding": [0.5, 0.5],
        "num_tokens": 3,
        "lang": "de",
    }
    chunk = chunk_of_row(row)
    assert (chunk.id, chunk.index, chunk.content.text) == ("a#1#2", 2, "quick")
    assert chunk.metadata == {"lang": "de", "document_id": "a#1", "char_start": 4, "char_end": 9}
    uuid_id = chunk_of_row(row, ids="uuid5").id
    assert uuid_id == chunk_of_row(row, ids="uuid5").id != chunk_of_row({**row, "chunk_index": 3}, ids="uuid5").id
    assert len(uuid_id) == 36 and uuid_id.count("-") == 4


def test_as_beam_chunks_maps_rows_in_a_pipeline():
    import apache_beam as beam
    from apache_beam.ml.rag.types import Chunk, Content, Embedding
    from apache_beam.testing.util import assert_that, equal_to

    import docbeam

    rows = [
        {"id": "a", "embedding": [0.5, 0.25], "num_tokens": 2, "tags": '["x"]'},
        {"id": "b", "sparse_embedding": {"indices": [1], "values": [2.0]}, "num_tokens": 2, "tags": None},
    ]
    with beam.Pipeline() as p:
        chunks = p | beam.Create(rows) | docbeam.AsBeamChunks(json_fields=("tags",))
        assert_that(
            chunks,
            equal_to(
                [
                    Chunk(Content(), "a", 0, {"tags": ["x"], "document_id": "a"}, Embedding([0.5, 0.25])),
                    Chunk(Content(), "b", 0, {"tags": None, "document_id": "b"}, Embedding(None, ([1], [2.0]))),
                ]
            ),
        )


@pytest.mark.parametrize(
    "row, match",
    [
        ({"id": "a", "multi_vector": [[0.1]]}, "'multi_vector' .* use a head that writes embedding"),
        ({"id": "a", "label": "x", "scores": [0.5]}, "'scores'"),
        ({"id": "a", "num_tokens": 3}, "neither embedding nor sparse_embedding"),
    ],
)
def test_rows_a_chunk_cannot_hold_are_refused_naming_them(row, match):
    with pytest.raises(NotChunks, match=match):
        chunk_of_row(row)


def test_read_beam_chunks_refuses_what_is_not_a_committed_run_of_vectors(tmp_path):
    import docbeam
    from docbeam.pipeline.stages.rag_chunks import committed_files
    from docbeam.pipeline.store.output import upgrade_manifest

    with pytest.raises(NotChunks, match="holds no committed docbeam run"):
        docbeam.ReadBeamChunks(str(tmp_path))

    def manifest(**fields):  # a version-1 manifest as read_manifest gives it: what it leaves out filled in
        return upgrade_manifest({"files": [{"path": "embeddings/part-r-0.parquet"}], **fields}, "out/_manifest.json")

    with pytest.raises(NotChunks, match="output.vector_dtype 'int8'"):
        committed_files("out", manifest(embedding={"dtype": "int8"}), None)
    with pytest.raises(NotChunks, match="model.head 'classifier'"):
        committed_files("out", manifest(head={"name": "classifier", "folder": "scores"}), None)
    with pytest.raises(NotChunks, match="granularity 'document', so it wrote no chunks/"):
        committed_files("out", manifest(granularity="document"), "chunks")
    with pytest.raises(NotChunks, match="its file embeddings/part-r-0.parquet is missing"):  # listed, not there
        committed_files("out", manifest(), None)
    with pytest.raises(NotChunks, match="model.head None"):  # a garbled head: named, never a KeyError
        committed_files("out", manifest(head={}), None)
    with pytest.raises(ValueError, match="ids='uuid4'"):
        docbeam.AsBeamChunks(ids="uuid4")


def test_embed_documents_refuses_beam_chunks_for_a_head_without_one_vector_per_document():
    from docbeam.config import ConfigError
    from docbeam.models.heads.classifier import ClassifierHead
    from docbeam.models.heads.multivector import MultiVectorHead
    from docbeam.models.heads.sparse import SparseHead
    from docbeam.pipeline.driver.embed import beam_chunks_ids

    common = dict(pooling="cls", layers=(), width=4, folder="embeddings")
    for head in (
        ClassifierHead(
            name="classifier",
            labels=("a",),
            function="softmax",
            windows="first",
            tensors=(),
            **{**common, "folder": "scores"},
        ),
        MultiVectorHead(name="multi_vector", normalize=True, skip_ids=(), **common),
    ):
        with pytest.raises(ConfigError, match=f"beam_chunks=True\\): model.head resolved to {head.name}"):
            beam_chunks_ids(head, "docbeam")
    sparse = SparseHead(
        name="sparse", activation="relu", windows="first", max_terms=None, threshold=None, layout=None, **common
    )
    assert beam_chunks_ids(sparse, "uuid5") == "uuid5"


def write_docs(path, texts: dict) -> None:
    """The documents, with a kept string (``lang``) and a field of no one type (``meta``: JSON text)."""
    path.write_text(
        "".join(
            json.dumps({"id": i, "text": t, "lang": LANGS[n % 2], "meta": n if n % 2 else str(n)}) + "\n"
            for n, (i, t) in enumerate(texts.items())
        )
    )


@pytest.fixture(scope="session")
def hybrid_runs(tmp_path_factory, tiny_checkpoint_dir):
    """A SPLADE run (with output.vertex_ai) and a dense run (granularity both) of the same documents."""
    from conftest import job_config
    from sparse_head_test import TEXTS, sparse_checkpoint

    from docbeam.pipeline.driver.run import run_job

    root = tmp_path_factory.mktemp("hybrid")
    write_docs(root / "docs.jsonl", TEXTS)
    sparse_model = sparse_checkpoint(str(root / "splade"), "bert", "max")
    batching = {"buckets": [32, 64], "tokens_per_batch": 512}
    keep = {"keep_fields": ["lang", "meta"]}
    run_job(
        job_config(
            str(root / "docs.jsonl"),
            str(root / "sparse"),
            sparse_model,
            batching=batching,
            input=keep,
            output={"vertex_ai": {"restricts": ["lang"]}},
        )
    )
    run_job(
        job_config(
            str(root / "docs.jsonl"),
            str(root / "dense"),
            tiny_checkpoint_dir,
            batching=batching,
            input=keep,
            output={"granularity": "both"},
            model={"max_seq_len": 32},
            tokenize={"stride": 8},
        )
    )
    return {
        "sparse": str(root / "sparse"),
        "dense": str(root / "dense"),
        "texts": TEXTS,
        "docs": str(root / "docs.jsonl"),
        "sparse_model": sparse_model,
        "batching": batching,
    }


def rows_of(output: str, folder: str = "embeddings") -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(glob.glob(f"{output}/{folder}/*.parquet")) for r in pq.read_table(f).to_pylist()]


def expected_chunk(row: dict, text: str | None = None):
    """What the Chunk of a committed row must be, spelled out from Beam's types, not from docbeam's mapping."""
    from apache_beam.ml.rag.types import Chunk, Content, Embedding

    meta = {"lang": row["lang"], "meta": json.loads(row["meta"])}
    sparse = row.get("sparse_embedding")
    if "chunk_index" in row:
        return Chunk(
            Content(row["chunk_text"]),
            f"{row['document_id']}#{row['chunk_index']}",
            row["chunk_index"],
            {**meta, "document_id": row["document_id"], "char_start": row["char_start"], "char_end": row["char_end"]},
            Embedding(row["embedding"]),
        )
    return Chunk(
        Content(text),
        row["id"],
        0,
        {**meta, "document_id": row["id"]},
        Embedding(row.get("embedding"), sparse and (sparse["indices"], sparse["values"])),
    )


def collected(pcoll, label: str, check) -> None:
    """``check(list of the PCollection's elements)`` once the pipeline has run (a Beam assertion)."""
    from apache_beam.testing.util import assert_that

    assert_that(pcoll, check, label=label)


@pytest.mark.slow
@pytest.mark.parametrize("run, rows", [("sparse", None), ("dense", None), ("dense", "chunks")])
def test_a_committed_run_reads_back_as_the_chunks_of_its_rows(hybrid_runs, run, rows):
    import apache_beam as beam

    import docbeam

    out = hybrid_runs[run]
    expected = [expected_chunk(r) for r in rows_of(out, rows or "embeddings")]
    assert len(expected) >= len(hybrid_runs["texts"])

    def same(actual):
        assert sorted(actual, key=lambda c: c.id) == sorted(expected, key=lambda c: c.id)

    with beam.Pipeline() as p:
        collected(p | docbeam.ReadBeamChunks(out, rows=rows), "SameChunks", same)


@pytest.mark.slow
def test_embed_documents_gives_the_chunks_a_committed_run_reads_back_with_their_texts(hybrid_runs):
    """The same documents through EmbedDocuments(beam_chunks=True): each Chunk is the committed row's, with the
    text, and the dict's other fields as metadata (``meta`` as the value itself, where the run kept JSON text)."""
    import apache_beam as beam
    from conftest import job_config

    import docbeam

    texts = hybrid_runs["texts"]
    committed = {r["id"]: r for r in rows_of(hybrid_runs["sparse"])}
    config = job_config(
        hybrid_runs["docs"],
        "unused",
        hybrid_runs["sparse_model"],
        batching=hybrid_runs["batching"],
        input={"keep_fields": ["lang", "meta"]},
    )
    embed = docbeam.EmbedDocuments(config, beam_chunks=True)

    def same(actual):
        assert sorted(c.id for c in actual) == sorted(texts)
        for chunk in actual:
            want = expected_chunk(committed[chunk.id], texts[chunk.id])
            assert (chunk.content, chunk.index, chunk.metadata) == (want.content, want.index, want.metadata)
            assert chunk.dense_embedding is None and chunk.sparse_embedding[0] == want.sparse_embedding[0]
            assert np.allclose(chunk.sparse_embedding[1], want.sparse_embedding[1], rtol=1e-6, atol=0)

    with beam.Pipeline() as p:
        docs = p | beam.io.ReadFromText(hybrid_runs["docs"]) | beam.Map(json.loads)
        collected((docs | embed)["chunks"], "SameChunks", same)


@pytest.mark.parametrize("damage", ["flipped", "shortened"])
def test_read_beam_chunks_refuses_a_committed_file_that_fails_its_manifest(hybrid_runs, tmp_path, damage):
    """A committed file changed after the commit (one byte flipped in place, or cut short) is refused before the
    pipeline starts, naming the file, as reuse refuses it: never read as if it were the run's."""
    import glob
    import shutil

    import docbeam
    from docbeam.pipeline.stages.rag_chunks import NotChunks

    copy = str(tmp_path / "dense")
    shutil.copytree(hybrid_runs["dense"], copy)
    target = sorted(glob.glob(f"{copy}/embeddings/*.parquet"))[0]
    data = bytearray(open(target, "rb").read())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:-10]
    open(target, "wb").write(bytes(data))
    with pytest.raises(NotChunks, match=r"embeddings/.*(does not match the checksum|not the size)"):
        docbeam.ReadBeamChunks(copy)
    docbeam.ReadBeamChunks(hybrid_runs["dense"])  # the run as committed reads


def test_a_run_from_before_checksums_reads_with_its_sizes_checked(hybrid_runs, tmp_path):
    import json
    import shutil

    import docbeam
    from docbeam.pipeline.stages.rag_chunks import NotChunks, other_fields

    copy = str(tmp_path / "old")
    shutil.copytree(hybrid_runs["dense"], copy)
    path = f"{copy}/_manifest.json"
    manifest = json.loads(open(path).read())
    manifest["files"] = [{k: v for k, v in f.items() if k != "checksum"} for f in manifest["files"]]
    open(path, "w").write(json.dumps(manifest))
    docbeam.ReadBeamChunks(copy)  # as before checksums were recorded
    next(f for f in manifest["files"] if f["path"].startswith("embeddings/"))["size"] += 1
    open(path, "w").write(json.dumps(manifest))
    with pytest.raises(NotChunks, match="not the size its manifest says"):
        docbeam.ReadBeamChunks(copy)

    class Hostile(dict):
        def get(self, *args):
            raise RuntimeError("boom")

    assert other_fields(Hostile(id="a", text="t"), "id", "text") == []  # an error row elsewhere, never a crash
