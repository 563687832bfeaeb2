"""Vertex AI Vector Search's dense, sparse and hybrid JSON lines (pipeline/sinks/vertex_ai/writer.py ``vertex_record``): each
line is held to the input schema Google documents and parsed into aiplatform's own ``IndexDatapoint``, and a whole
sparse run with ``output.vertex_ai`` writes such lines for its rows."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest
from beam_chunks_test import hybrid_runs  # noqa: F401  the session's SPLADE and dense runs

from docbeam.pipeline.sinks.vertex_ai.writer import vertex_record

# The JSON record of https://cloud.google.com/vertex-ai/docs/vector-search/setup/format-structure ("Data file
# formats", JSON): an id, a dense "embedding" and/or a "sparse_embedding" of "values" and "dimensions" (a hybrid
# datapoint has both), "restricts" of a namespace with allow and deny tokens, "numeric_restricts", "crowding_tag".
VERTEX_RECORD = {
    "type": "object",
    "required": ["id"],
    "anyOf": [{"required": ["embedding"]}, {"required": ["sparse_embedding"]}],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "embedding": {"type": "array", "items": {"type": "number"}, "minItems": 1},
        "sparse_embedding": {
            "type": "object",
            "required": ["values", "dimensions"],
            "additionalProperties": False,
            "properties": {
                "values": {"type": "array", "items": {"type": "number"}},
                "dimensions": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            },
        },
        "restricts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["namespace"],
                "additionalProperties": False,
                "properties": {
                    "namespace": {"type": "string"},
                    "allow": {"type": "array", "items": {"type": "string"}},
                    "deny": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        "numeric_restricts": {"type": "array"},
        "crowding_tag": {"type": "string"},
    },
}


def check_record(record: dict) -> None:
    """The record against Google's documented schema, with as many values as dimensions."""
    import jsonschema

    jsonschema.validate(record, VERTEX_RECORD)
    sparse = record.get("sparse_embedding")
    assert sparse is None or len(sparse["values"]) == len(sparse["dimensions"])


def as_datapoint(record: dict):
    """The JSON line as aiplatform's IndexDatapoint (proto-plus refuses a field or a type it does not know)."""
    from google.cloud.aiplatform_v1.types import IndexDatapoint

    sparse = record.get("sparse_embedding")
    return IndexDatapoint(
        datapoint_id=record["id"],
        feature_vector=record.get("embedding", []),
        sparse_embedding=IndexDatapoint.SparseEmbedding(**sparse) if sparse else None,
        restricts=[
            IndexDatapoint.Restriction(namespace=r["namespace"], allow_list=r["allow"])
            for r in record.get("restricts", [])
        ],
    )


DENSE = [0.1, -0.25, 1 / 3]
SPARSE = {"indices": [3, 1017, 29999], "values": [0.7, 1 / 7, 2.5]}


@pytest.mark.parametrize(
    "columns",
    [
        {"embedding": DENSE},
        {"sparse_embedding": SPARSE},
        {"embedding": DENSE, "sparse_embedding": SPARSE},
        {"embedding": DENSE, "sparse_embedding": SPARSE, "multi_vector": [[0.6, 0.8]]},
    ],
    ids=["dense", "sparse", "hybrid", "bge-m3"],
)
def test_a_rows_vectors_become_vertex_json_by_its_columns(columns):
    row = {"id": "doc-7", **columns, "num_tokens": 9, "lang": "en", "tags": '["a", 3]'}
    record = json.loads(json.dumps(vertex_record(row, ("lang", "tags"), json_fields=("tags",))))
    check_record(record)
    datapoint = as_datapoint(record)
    assert datapoint.datapoint_id == "doc-7"
    assert [(r.namespace, list(r.allow_list)) for r in datapoint.restricts] == [("lang", ["en"]), ("tags", ["a", "3"])]
    # Each value is the float32 written, through the JSON and into the proto's float fields.
    assert list(datapoint.feature_vector) == list(np.float32(columns.get("embedding", [])))
    assert ("embedding" in record) == ("embedding" in columns) and "multi_vector" not in record  # no place in Vertex
    if "sparse_embedding" in columns:
        assert list(datapoint.sparse_embedding.dimensions) == SPARSE["indices"]
        assert list(datapoint.sparse_embedding.values) == list(np.float32(SPARSE["values"]))
    else:
        assert "sparse_embedding" not in record


@pytest.mark.parametrize(
    "broken",
    [
        lambda r: r["sparse_embedding"].update(indices=r["sparse_embedding"].pop("dimensions")),  # docbeam's own names
        lambda r: r["sparse_embedding"].update(
            dimensions=[float(d) + 0.5 for d in r["sparse_embedding"]["dimensions"]]
        ),
        lambda r: r.pop("sparse_embedding"),  # no vector at all
        lambda r: r.update(sparse=r.pop("sparse_embedding")),
    ],
    ids=["indices-not-dimensions", "float-dimensions", "no-vector", "misnamed"],
)
def test_the_schema_catches_a_record_written_wrong(broken):
    import jsonschema

    record = vertex_record({"id": "d", "sparse_embedding": SPARSE}, ())
    check_record(record)
    broken(record)
    with pytest.raises(jsonschema.ValidationError):
        check_record(record)


@pytest.mark.slow
def test_a_sparse_run_writes_vertex_lines_of_its_rows(hybrid_runs):
    """output.vertex_ai on a SPLADE run: one sparse line per embeddings/ row, the same terms, the restricts."""
    import pyarrow.parquet as pq

    out = hybrid_runs["sparse"]
    rows = {r["id"]: r for f in glob.glob(f"{out}/embeddings/*.parquet") for r in pq.read_table(f).to_pylist()}
    lines = [json.loads(line) for f in sorted(glob.glob(f"{out}/vertex_ai/*.json")) for line in open(f)]
    manifest = json.load(open(f"{out}/_manifest.json"))
    assert sorted(f"{out}/{f['path']}" for f in manifest["files"] if f["path"].startswith("vertex_ai/")) == sorted(
        glob.glob(f"{out}/vertex_ai/*.json")
    )
    assert sorted(r["id"] for r in lines) == sorted(rows) and len(rows) == len(hybrid_runs["texts"])
    for record in lines:
        check_record(record)
        datapoint, row = as_datapoint(record), rows[record["id"]]
        assert "embedding" not in record
        assert list(datapoint.sparse_embedding.dimensions) == row["sparse_embedding"]["indices"]
        assert list(datapoint.sparse_embedding.values) == list(np.float32(row["sparse_embedding"]["values"]))
        assert record["restricts"] == [{"namespace": "lang", "allow": [row["lang"]]}]
