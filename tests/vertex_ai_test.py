"""output.vertex_ai: Vector Search's batch layout (JSON lines under vertex_ai/, removed ids under
vertex_ai/delete/), committed with the run."""

from __future__ import annotations

import glob
import gzip
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, job_config

from docbeam.config import ConfigError
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.sinks.removed import removed_ids
from docbeam.pipeline.sinks.vertex_ai.writer import restrict_values, vertex_record


def test_restrict_values_are_strings_one_per_list_element():
    assert restrict_values("news") == ["news"]
    assert restrict_values(["en", "de"]) == ["en", "de"]
    assert restrict_values(3) == ["3"] and restrict_values(True) == ["true"]
    assert restrict_values(None) == [] and restrict_values([]) == [] and restrict_values(["a", None]) == ["a"]


def test_a_vertex_record_carries_the_float32_vector_exactly_and_a_restrict_per_field_with_a_value():
    vector = np.random.default_rng(0).normal(size=8).astype(np.float32)
    row = {"id": "d1", "embedding": vector.tolist(), "lang": "en", "tags": ["a", "b"], "empty": None}
    record = json.loads(json.dumps(vertex_record(row, ("lang", "tags", "empty"))))
    assert record["id"] == "d1"
    assert np.array_equal(np.asarray(record["embedding"], np.float32), vector)
    assert record["restricts"] == [{"namespace": "lang", "allow": ["en"]}, {"namespace": "tags", "allow": ["a", "b"]}]
    assert "restricts" not in vertex_record(row, ())


def test_a_kept_field_of_json_text_gives_the_values_it_holds():
    row = {"id": "d1", "embedding": [0.5], "tags": '["a", 2]', "title": '["not", "json"]'}
    assert vertex_record(row, ("tags", "title"), json_fields=("tags",))["restricts"] == [
        {"namespace": "tags", "allow": ["a", "2"]},
        {"namespace": "title", "allow": ['["not", "json"]']},
    ]


def test_an_id_is_removed_only_when_the_source_had_it_and_this_run_read_nothing_under_it():
    assert removed_ids(("gone", {"previous": [None], "present": []})) == ["gone"]
    assert removed_ids(("kept", {"previous": [None], "present": [None]})) == []
    assert removed_ids(("new", {"previous": [], "present": [None]})) == []


def test_a_restrict_on_a_field_not_kept_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"output.vertex_ai.restricts names \['lang'\].*input.keep_fields"):
        job_config("in.jsonl", str(tmp_path / "out"), "model", output={"vertex_ai": {"restricts": ["lang"]}})
    job_config(
        "in.jsonl",
        str(tmp_path / "out"),
        "model",
        output={"vertex_ai": {"restricts": ["lang"]}},
        input={"keep_fields": ["lang"]},
    )
    job_config(
        "in.jsonl",
        str(tmp_path / "out"),
        "model",
        output={"vertex_ai": {"restricts": ["lang"]}},
        input={"keep_fields": "*"},
    )


def test_sinks_refuse_vectors_that_are_not_floats(tmp_path):
    with pytest.raises(ConfigError, match="output.vertex_ai loads float vectors.*binary"):
        job_config("in.jsonl", str(tmp_path / "out"), "model", output={"vertex_ai": True, "vector_dtype": "binary"})


def lines(pattern: str) -> list[str]:
    return [line for path in sorted(glob.glob(pattern)) for line in open(path).read().splitlines() if line]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint_dir, tmp_path_factory):
    """Run A (30 documents), then an incremental run B from A: 3 documents gone, 1 now rejected (empty), 2 new."""
    with gzip.open(SAMPLE, "rt") as f:
        sample = [json.loads(line) for line in f]
    sample = [{**d, "lang": ["en", "de"][i % 2], "tags": [f"t{i % 3}", "all"]} for i, d in enumerate(sample)]
    a = sample[:30]
    gone, rejected = {d["id"] for d in a[:3]}, a[3]["id"]
    b = [{**d, "text": " "} if d["id"] == rejected else d for d in a if d["id"] not in gone] + sample[30:32]
    root = tmp_path_factory.mktemp("vertex")
    for name, docs in (("a.jsonl", a), ("b.jsonl", b)):
        (root / name).write_text("".join(json.dumps(d) + "\n" for d in docs))
    kept, vertex = ["lang", "tags"], {"restricts": ["lang", "tags"]}
    full = run_job(
        job_config(
            str(root / "a.jsonl"),
            str(root / "a"),
            tiny_checkpoint_dir,
            input={"keep_fields": kept},
            output={"vertex_ai": vertex},
        )
    )
    incremental = run_job(
        job_config(
            str(root / "b.jsonl"),
            str(root / "b"),
            tiny_checkpoint_dir,
            input={"reuse_from": str(root / "a"), "keep_fields": kept},
            output={"vertex_ai": vertex},
        )
    )
    return root, full, incremental, gone, rejected


@pytest.mark.slow
def test_the_vertex_files_hold_exactly_the_committed_rows(runs):
    root, *_ = runs
    for out in ("a", "b"):
        parquet = {
            r["id"]: r["embedding"] for r in pq.read_table(glob.glob(f"{root}/{out}/embeddings/*.parquet")).to_pylist()
        }
        records = [json.loads(line) for line in lines(f"{root}/{out}/vertex_ai/*.json")]
        assert sorted(r["id"] for r in records) == sorted(parquet)
        for r in records:
            assert np.array_equal(np.asarray(r["embedding"], np.float32), np.asarray(parquet[r["id"]], np.float32))
        manifest = json.load(open(f"{root}/{out}/_manifest.json"))
        listed = {f["path"] for f in manifest["files"]}
        on_disk = {p[len(f"{root}/{out}/") :] for p in glob.glob(f"{root}/{out}/vertex_ai/**/*.*", recursive=True)}
        assert on_disk and on_disk <= listed


@pytest.mark.slow
def test_restricts_come_from_the_kept_fields_of_each_document_reused_or_encoded(runs):
    root, *_ = runs
    with open(root / "b.jsonl") as f:
        source = {d["id"]: d for d in map(json.loads, f)}
    records = [json.loads(line) for line in lines(f"{root}/b/vertex_ai/*.json")]
    assert records
    for r in records:
        doc = source[r["id"]]
        assert r["restricts"] == [
            {"namespace": "lang", "allow": [doc["lang"]]},
            {"namespace": "tags", "allow": doc["tags"]},
        ], r["id"]


@pytest.mark.slow
def test_an_incremental_run_lists_exactly_the_documents_gone_from_the_input_under_delete(runs):
    root, full, incremental, gone, rejected = runs
    assert sorted(lines(f"{root}/b/vertex_ai/delete/*.txt")) == sorted(gone)
    assert rejected not in lines(f"{root}/b/vertex_ai/delete/*.txt")  # rejected this run is not deleted
    assert incremental["docs_rejected"] == 1 and incremental["docs_reused"] > 0
    assert not glob.glob(f"{root}/a/vertex_ai/delete")  # a full run knows of nothing removed
