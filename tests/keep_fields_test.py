"""input.keep_fields: the chosen JSONL fields reach every output row with their JSON types, a column's type is
inferred from a sample and never bent to fit a later record, and a field named like an output column is refused
at start."""

from __future__ import annotations

import glob
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config

from docbeam.config import ConfigError
from docbeam.errors import Refused
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.records import Document, Rejected
from docbeam.pipeline.stages import keep
from docbeam.pipeline.stages.keep import KeptColumn, KeptFields, infer_type, value_problem
from docbeam.pipeline.stages.parse import parse_jsonl_line

TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "rain fell on the old town",
    "ships sail across the sea",
    "bread is baked every morning",
    "stars shine over the hills",
    "the river runs to the sea",
]
# One value of each JSON kind per field; "year" gets a string in the last record, past the sample of 5.
FIELDS = [
    {
        "topic": "pets",
        "year": 2021,
        "rating": 0.5,
        "public": True,
        "note": None,
        "tags": ["a", "b"],
        "meta": {"lang": "en", "pages": 3, "refs": [1, 2]},
        "mixed": "x",
    },
    {
        "topic": "pets",
        "year": -7,
        "rating": 2,
        "public": False,
        "note": None,
        "tags": [],
        "meta": {"pages": 10, "lang": "fr", "refs": []},
        "mixed": 7,
    },
    {"year": 1999, "rating": 1e-3, "public": None, "tags": ["c", None], "meta": None, "mixed": [1, {"k": "v"}]},
    {
        "topic": "städte ☂",
        "year": 2**40,
        "rating": -3.25,
        "public": True,
        "note": None,
        "tags": ["d"],
        "meta": {"lang": "de", "pages": 0, "refs": [5]},
        "mixed": None,
    },
    {
        "topic": "sea",
        "year": 0,
        "rating": 4,
        "public": True,
        "note": None,
        "tags": ["e"],
        "meta": {"lang": "it", "pages": 1, "refs": []},
        "mixed": True,
    },
    {
        "topic": "food",
        "year": 3,
        "rating": 0.0,
        "public": False,
        "tags": ["f"],
        "meta": {"lang": "es", "pages": 2, "refs": [7]},
        "mixed": {"a": 1},
    },
    {"topic": "sky", "year": "2020", "rating": 1.5, "public": True, "tags": [], "meta": None, "mixed": 1.5},
]
KEPT = ["topic", "year", "rating", "public", "note", "tags", "meta", "mixed"]
EXPECTED_TYPES = {
    "topic": "string",
    "year": "int64",
    "rating": "double",
    "public": "bool",
    "note": "json",
    "tags": "list<element: string>",
    "mixed": "json",
    "meta": "struct<lang: string, pages: int64, refs: list<element: int64>>",
}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return str(path)


def read_rows(output: str) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(glob.glob(f"{output}/embeddings/*.parquet")).to_pylist()}


def same_json(read, written) -> bool:
    """Equal as JSON values, kinds included (True is not 1, "1" is not 1); a float column reads an integer back as
    the equal float."""
    if isinstance(written, bool) or isinstance(read, bool):
        return read is written
    if isinstance(written, (int, float)):
        return (
            isinstance(read, (int, float))
            and read == written
            and (isinstance(written, float) or type(read) is int or read.is_integer())
        )
    if isinstance(written, list):
        return isinstance(read, list) and len(read) == len(written) and all(map(same_json, read, written))
    if isinstance(written, dict):
        return (
            isinstance(read, dict)
            and read.keys() == written.keys()
            and all(same_json(read[k], written[k]) for k in written)
        )
    return type(read) is type(written) and read == written


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_checkpoint_dir):
    """Seven documents, kept fields typed from the first five; the seventh's year is a string."""
    folder = tmp_path_factory.mktemp("keep")
    records = [{"id": f"d{i}", "text": text, **fields} for i, (text, fields) in enumerate(zip(TEXTS, FIELDS))]
    path = write_jsonl(folder / "a.jsonl", records)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keep, "SAMPLE_RECORDS", 5)
        summary = run_job(
            job_config(
                path,
                str(folder / "out"),
                tiny_checkpoint_dir,
                input={"keep_fields": KEPT, "max_rejected_fraction": 0.5},
                output={"granularity": "both"},
            )
        )
    return folder, records, summary


# --- inference and checks, as pure functions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, expected",
    [
        (["a", None, "b"], pa.string()),
        ([1, -2, 2**62], pa.int64()),
        ([1, 2.5], pa.float64()),
        ([True, False], pa.bool_()),
        ([[1], [], [2, None]], pa.list_(pa.int64())),
        ([0.5, 1.5, None, -2.25], pa.float64()),
        ([[0.5], [1.5, 2]], pa.list_(pa.float64())),
        ([{"a": 1, "b": "x"}, {"b": "y", "a": 2}], pa.struct([("a", pa.int64()), ("b", pa.string())])),
    ],
)
def test_a_column_gets_the_one_arrow_type_that_holds_every_sampled_value(values, expected):
    assert infer_type(values) == expected


@pytest.mark.parametrize(
    "values",
    [
        [None, None],
        [[], []],
        ["a", 1],
        [True, 1],
        [2**63],
        [2**60, 0.5],
        [{"a": 1}, {"b": 1}],
        [{}],
        [{"a": None}],
        [[1, "a"]],
    ],
    ids=[
        "only-nulls",
        "only-empty-lists",
        "string-and-number",
        "bool-and-number",
        "past-int64",
        "integer-a-double-cannot-hold",
        "objects-with-other-keys",
        "empty-object",
        "object-key-only-null",
        "list-of-mixed-kinds",
    ],
)
def test_where_no_arrow_type_holds_every_value_the_column_is_json_text(values):
    assert infer_type(values) is None


def test_a_value_that_does_not_fit_its_column_is_named_not_converted():
    meta = pa.struct([("lang", pa.string()), ("refs", pa.list_(pa.int64()))])
    assert value_problem("2020", pa.int64()) == 'is a string ("2020")'
    assert value_problem(True, pa.int64()) == "is a boolean (true)"
    assert value_problem(1.5, pa.int64()) == "is a fraction (1.5)"
    assert value_problem({"lang": "en"}, meta) == "is an object with the keys ['lang'], not ['lang', 'refs']"
    assert value_problem({"lang": "en", "refs": [1, "2"]}, meta) == (
        "holds under 'refs' a value that holds an item that is a string (\"2\")"
    )
    assert value_problem(3, pa.float64()) is None and value_problem(None, meta) is None
    assert value_problem(["\ud800"], None).startswith("holds a lone UTF-16 surrogate")


def test_the_parser_keeps_the_fields_and_rejects_a_record_whose_value_does_not_fit():
    kept = KeptFields((KeptColumn("year", pa.int64()), KeptColumn("extra", None)), sampled=5)

    def parse(record):
        return parse_jsonl_line(
            json.dumps(record).encode(),
            source="a.jsonl",
            line=3,
            id_field="id",
            text_field="text",
            cap=10_000,
            keep=kept,
        )

    doc = parse({"id": "d", "text": "t", "year": 2020, "extra": {"a": [1]}, "other": 1})
    assert isinstance(doc, Document) and doc.kept == (("year", 2020), ("extra", '{"a": [1]}'))
    assert parse({"id": "d", "text": "t"}).kept == (("year", None), ("extra", None))
    bad = parse({"id": "d", "text": "t", "year": "2020"})
    assert isinstance(bad, Rejected) and (bad.kind, bad.id, bad.line) == ("kept_field_type", "d", 3)
    assert "field 'year' (input.keep_fields) is a string (\"2020\"), but its column is int64" in bad.reason
    assert "first 5 documents" in bad.reason


def nested(depth: int, leaf=1):
    """``leaf`` inside ``depth`` lists, built without recursion."""
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize(
    "value, problem",
    [
        (float("inf"), "is a number JSON text cannot hold (Infinity)"),
        (float("-inf"), "is a number JSON text cannot hold (-Infinity)"),
        (float("nan"), "is a number JSON text cannot hold (NaN)"),
        ({"a": [1.0, float("nan")]}, "is a number JSON text cannot hold (NaN)"),
        (
            nested(keep.MAX_DEPTH + 1),
            f"nests {keep.MAX_DEPTH + 1} lists or objects deep; a kept field may nest at most {keep.MAX_DEPTH}",
        ),
        (nested(100_000), "nests 100000 lists or objects deep"),  # measured without recursion
    ],
    ids=["inf", "minus-inf", "nan", "nan-inside", "one-too-deep", "far-too-deep"],
)
def test_a_non_finite_number_or_a_too_deep_value_is_a_rejection_in_any_column(value, problem):
    for column in (KeptColumn("f", None), KeptColumn("f", pa.float64())):  # JSON text, and typed
        reason = KeptFields((column,), sampled=5).take({"f": value})
        assert isinstance(reason, str) and f"field 'f' (input.keep_fields) {problem}" in reason, reason


def test_a_value_at_the_depth_limit_is_kept_and_typed():
    value = nested(keep.MAX_DEPTH)
    column = infer_type([value])
    assert str(column).count("list<") == keep.MAX_DEPTH
    assert KeptFields((KeptColumn("f", column),), sampled=1).take({"f": value}) == (("f", value),)


def test_sampled_values_that_will_be_rejected_do_not_type_the_column(tiny_checkpoint_dir, tmp_path):
    sample = [{"n": 1}, {"n": float("inf")}, {"n": 2}, {"d": nested(450)}, {"d": "text"}]
    from docbeam.config import InputConfig

    kept = keep.plan_columns(InputConfig(path="x.jsonl", keep_fields=["n", "d"]), lambda: sample)
    assert kept.describe() == {"n": "int64", "d": "string"}


def test_every_column_docbeam_writes_is_a_name_no_kept_field_may_take():
    from docbeam.models.heads.embedding import EmbeddingHead
    from docbeam.pipeline.stages.write import rows_schema

    head = EmbeddingHead(
        name="embedding", pooling="mean", layers=(), width=8, folder="embeddings", normalize=False, truncate_dim=None
    )
    assert set(rows_schema(head).names) <= set(keep.OUTPUT_COLUMNS)


# --- refused at start ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, reason",
    [
        ("embedding", "'embedding' is the name of an output column"),
        ("chunk_text", "'chunk_text' is the name of an output column"),
        ("id", "'id' is the name of an output column"),
        ("doc_key", "'doc_key' is input.id_field"),
        ("body", "'body' is input.text_field"),
    ],
)
def test_a_kept_field_that_would_overwrite_a_column_or_is_the_id_or_text_is_refused_at_start(
    field, reason, tiny_checkpoint_dir, tmp_path
):
    path = write_jsonl(tmp_path / "in.jsonl", [{"doc_key": "a", "body": "some text", "embedding": [1.0]}])
    cfg = job_config(
        path,
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        input={"id_field": "doc_key", "text_field": "body", "keep_fields": ["topic", field]},
    )
    with pytest.raises(ConfigError, match=rf"input.keep_fields: {reason}.*Remove it from the list") as refused:
        run_job(cfg)
    assert isinstance(refused.value, Refused)  # exit 2 (docbeam/errors.py)
    assert not os.path.exists(tmp_path / "out")


def test_star_over_an_input_with_a_field_named_like_an_output_column_is_refused(tiny_checkpoint_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "t", "topic": "x", "truncated": False}])
    with pytest.raises(
        ConfigError,
        match=r"\"\*\" takes every field.*'truncated' is the name of an output column.*"
        r"List the fields to keep instead",
    ):
        run_job(job_config(path, str(tmp_path / "out"), tiny_checkpoint_dir, input={"keep_fields": "*"}))


def test_keep_fields_with_text_input_is_refused(tiny_checkpoint_dir, tmp_path):
    (tmp_path / "a.txt").write_text("a text file")
    with pytest.raises(ConfigError, match="input.format: text: a text file has no fields to keep"):
        run_job(
            job_config(
                str(tmp_path / "a.txt"),
                str(tmp_path / "out"),
                tiny_checkpoint_dir,
                input={"format": "text", "keep_fields": ["topic"]},
            )
        )


# --- whole runs ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kept_fields_read_back_with_their_values_and_json_types(first_run):
    folder, records, summary = first_run
    rows = read_rows(str(folder / "out"))
    assert sorted(rows) == [f"d{i}" for i in range(6)]
    for record in records[:6]:
        row = rows[record["id"]]
        for name in ("topic", "year", "rating", "public", "tags", "meta"):
            assert same_json(row[name], record.get(name)), (record["id"], name, row[name], record.get(name))
        for name in ("note", "mixed"):  # JSON-text columns: the text parses back to the value
            assert same_json(None if row[name] is None else json.loads(row[name]), record.get(name))
    assert type(rows["d0"]["year"]) is int and type(rows["d1"]["rating"]) is float and rows["d1"]["rating"] == 2
    assert rows["d2"]["topic"] is None  # a missing field is null


@pytest.mark.slow
def test_every_chunk_row_carries_its_documents_kept_fields_as_the_document_row_does(first_run):
    folder, _, _ = first_run
    documents = read_rows(str(folder / "out"))
    chunks = pq.read_table(glob.glob(f"{folder}/out/chunks/*.parquet"))
    assert [chunks.schema.field(name).type for name in KEPT] == [
        pq.read_schema(glob.glob(f"{folder}/out/embeddings/*.parquet")[0]).field(name).type for name in KEPT
    ]
    rows = chunks.to_pylist()
    assert {r["document_id"] for r in rows} == set(documents)
    for row in rows:
        assert {name: row[name] for name in KEPT} == {name: documents[row["document_id"]][name] for name in KEPT}


@pytest.mark.slow
def test_column_types_are_in_the_schema_the_manifest_and_the_summary(first_run):
    folder, _, summary = first_run
    schema = pq.read_schema(glob.glob(f"{folder}/out/embeddings/*.parquet")[0])
    assert schema.names[6:] == KEPT
    assert {n: str(schema.field(n).type) for n in KEPT} == {
        n: "string" if t == "json" else t for n, t in EXPECTED_TYPES.items()
    }
    manifest = json.load(open(folder / "out" / "_manifest.json"))
    assert manifest["kept_fields"] == summary["kept_fields"] == EXPECTED_TYPES  # (JSON written with sorted keys)


@pytest.mark.slow
def test_a_value_past_the_sample_that_does_not_fit_is_a_counted_rejection(first_run):
    folder, _, summary = first_run
    assert summary["rejected_by_kind"] == {"kept_field_type": 1} and summary["docs_embedded"] == 6
    (error,) = [json.loads(line) for p in glob.glob(f"{folder}/out/errors/*.jsonl") for line in open(p)]
    assert error["id"] == "d6" and "field 'year'" in error["reason"] and "column is int64" in error["reason"]


@pytest.mark.slow
def test_fractions_are_double_and_non_finite_or_deep_values_are_rejections_not_a_failed_run(
    tiny_checkpoint_dir, tmp_path
):
    deep = "[" * 450 + "1" + "]" * 450
    lines = [
        json.dumps({"id": "a", "text": "the cat sat", "rating": 0.5, "meta": {"k": [1]}}),
        json.dumps({"id": "b", "text": "a dog ran", "rating": 1.5, "meta": {"k": []}}),
        '{"id": "deep", "text": "rain fell", "rating": 2.5, "meta": ' + deep + "}",
        '{"id": "huge", "text": "ships sail", "rating": 1e400, "meta": {"k": [2]}}',
        '{"id": "nan", "text": "bread is baked", "rating": NaN}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run_job(
        job_config(
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            tiny_checkpoint_dir,
            input={"keep_fields": ["rating", "meta"], "max_rejected_fraction": 0.9},
        )
    )
    assert summary["kept_fields"] == {"rating": "double", "meta": "struct<k: list<element: int64>>"}
    assert summary["rejected_by_kind"] == {"kept_field_type": 3}
    rows = read_rows(str(tmp_path / "out"))
    assert {i: rows[i]["rating"] for i in rows} == {"a": 0.5, "b": 1.5}
    errors = {
        e["id"]: e["reason"]
        for path in glob.glob(f"{tmp_path}/out/errors/*.jsonl")
        for e in map(json.loads, open(path))
    }
    assert "field 'meta' (input.keep_fields) nests 450 lists or objects deep" in errors["deep"]
    assert "field 'rating' (input.keep_fields) is a number JSON text cannot hold (Infinity)" in errors["huge"]
    assert "(NaN)" in errors["nan"]


@pytest.mark.slow
def test_star_and_an_incremental_run_write_this_inputs_field_values_beside_reused_vectors(
    first_run, tiny_checkpoint_dir
):
    folder, records, _ = first_run
    changed = [{**r, "topic": "moved", "year": 1} if r["id"] == "d0" else r for r in records[:6]]
    changed[1] = {**changed[1], "added": ["new field"]}
    path = write_jsonl(folder / "b.jsonl", changed)
    summary = run_job(
        job_config(
            path, str(folder / "b"), tiny_checkpoint_dir, input={"keep_fields": "*", "reuse_from": str(folder / "out")}
        )
    )
    assert summary["docs_reused"] == 6 and summary["docs_encoded"] == 0
    assert summary["kept_fields"] == {**EXPECTED_TYPES, "added": "list<element: string>"}  # every field but id, text
    before, after = read_rows(str(folder / "out")), read_rows(str(folder / "b"))
    assert (after["d0"]["topic"], after["d0"]["year"]) == ("moved", 1)
    assert after["d0"]["embedding"] == before["d0"]["embedding"]
    assert after["d1"]["added"] == ["new field"] and after["d2"]["added"] is None
    assert all(after[i][n] == before[i][n] for i in before if i != "d0" for n in KEPT)
