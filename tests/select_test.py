"""output.select: a curation job's kept set. The expression's grammar (docbeam/selection.py), what the
plan refuses (columns the rows lack, labels the classifier lacks), and a run whose selected/ is exactly the
documents that meet it, committed with the run."""

from __future__ import annotations

import glob
import json

import pytest

from docbeam.selection import SelectionError, evaluate, parse

ROW = {"id": "a", "label": "en", "score": 3.5, "scores": [0.1, 0.9], "num_tokens": 80, "truncated": False, "lang": None}


@pytest.mark.parametrize(
    "where, selected",
    [
        ("score >= 3", True),
        ("score < 3", False),
        ("label in [en, de]", True),
        ("label not in ['en']", False),
        ("label == en and num_tokens > 50", True),
        ("label == fr or scores[pos] > 0.5", True),
        ("not truncated", True),
        ("truncated", False),
        ("score > 1 and score < 4", True),
        ("lang == en", False),  # a null value meets no comparison, as in SQL
        ("lang != en", False),
        ("num_tokens == 'eighty'", False),  # another type: not selected, never a crash
    ],
)
def test_an_expression_selects_the_rows_that_meet_it(where, selected):
    assert evaluate(parse(where), ROW, labels=("neg", "pos")) is selected


@pytest.mark.parametrize(
    "where, named",
    [
        ("score >=", "is not an expression"),
        ("__import__('os').system('x')", "is not a condition"),
        ("score + 1 > 2", "the left of a comparison is a column"),
        ("score > len(x)", "is not a value"),
        ("score is None", "Is is not a comparison"),
        ("1 < score < 4", "one comparison at a time"),
    ],
)
def test_what_is_not_a_selection_is_refused_naming_the_part(where, named):
    with pytest.raises(SelectionError, match=named):
        parse(where)


NULL_LANG = {**ROW, "lang": None}


@pytest.mark.parametrize(
    "where, selected",
    [
        ("not lang == en", False),  # unknown, as lang != en is: a null meets neither
        ("not lang != en", False),
        ("not lang in [en, de]", False),
        ("not (lang == en or label == fr)", False),  # unknown or false is unknown
        ("lang == en or label == en", True),  # unknown or true is true
        ("not (lang == en and label == fr)", True),  # unknown and false is false
        ("not label == fr", True),
        ("lang == null", True),  # SQL's IS NULL
        ("lang != null", False),
        ("label != null", True),
        ("truncated == false", True),  # a typed literal, not the word "false"
        ("truncated == true", False),
        ("not truncated == 'false'", False),  # a bool against a word: unknown, so is its not
        ("not num_tokens == 'eighty'", False),
    ],
)
def test_not_follows_sqls_three_valued_logic_and_true_false_null_are_values(where, selected):
    assert evaluate(parse(where), NULL_LANG, labels=("neg", "pos")) is selected


def test_a_bare_word_is_compared_as_written_not_folded_by_pythons_parser():
    ligature = "\ufb01ne"  # 'ﬁne': one character, which NFKC folds to 'fine'
    tree = parse(f"label == {ligature}")
    assert evaluate(tree, {**ROW, "label": ligature}) is True
    assert evaluate(tree, {**ROW, "label": "fine"}) is False
    assert evaluate(parse(f"scores[{ligature}] > 0.5"), {**ROW, "scores": [0.1, 0.9]}, labels=("x", ligature))


@pytest.mark.parametrize(
    "where", ["not " * 3000 + "truncated", "(" * 3000 + "truncated" + ")" * 3000, "x == 1 or " * 2000 + "x == 1"]
)
def test_a_deeply_nested_or_huge_expression_is_refused_quickly_naming_the_limit(where):
    with pytest.raises(SelectionError, match="nested|characters, more than") as refused:
        parse(where)
    assert len(str(refused.value)) < 400  # the message names the limit, it does not repeat the expression


def test_a_kept_field_written_as_json_text_is_compared_as_its_value():
    """A field with no one Arrow type over the sample is written as JSON text ('"en"'): lang != en must not select
    the English documents, as comparing the text would."""
    from docbeam.pipeline.stages.select_documents import _meets

    row = {**ROW, "lang": '"en"'}
    assert _meets(row, parse("lang == en"), (), ("lang",)) is True
    assert _meets(row, parse("lang != en"), (), ("lang",)) is False
    assert _meets(row, parse("not lang == en"), (), ("lang",)) is False
    assert _meets({**ROW, "lang": "{bad json"}, parse("lang != en"), (), ("lang",)) is False  # unknown


def test_null_is_only_compared_for_being_missing():
    with pytest.raises(SelectionError, match="null is only compared with == or !="):
        parse("score > null")


def test_the_config_refuses_a_bad_expression_naming_the_key():
    from docbeam.config import ConfigError
    from docbeam.config import parse as parse_config

    with pytest.raises(ConfigError, match="output.select.where"):
        parse_config(
            {"input": {"path": "x.jsonl"}, "output": {"path": "out", "select": {"where": "score >="}}}, base_dir="/tmp"
        )


def write_docs(tmp_path) -> str:
    docs = tmp_path / "docs.jsonl"
    langs = ["en", "de", "fr", None, "en", "it"]
    docs.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "text": f"document number {i} about rivers", "lang": lang}) + "\n"
            for i, lang in enumerate(langs)
        )
    )
    return str(docs)


@pytest.mark.parametrize(
    "where, match",
    [
        ("colour == red", r"reads \['colour'\], which the embeddings/ rows do not have"),
        ("score > 1", r"reads \['score'\]"),
        ("num_tokens == eighty", r"'num_tokens == eighty': num_tokens is a number column, 'eighty' is a string"),
        ("truncated == yes", r"truncated is a bool column, 'yes' is a string; .* write true or false"),
        ("lang in en", r"'lang in en': in takes a list"),
        ("lang == 5", r"lang is a string column, 5 is a number"),
    ],
)
def test_the_plan_refuses_a_column_the_rows_lack_or_a_value_it_can_never_hold(
    tmp_path, tiny_checkpoint_dir, where, match
):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    cfg = job_config(
        write_docs(tmp_path),
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        input={"keep_fields": ["lang"]},
        output={"select": {"where": where}},
    )
    with pytest.raises(ConfigError, match=match):
        make_plan(cfg, probe_backends=False)


def test_the_plan_refuses_a_label_the_classifier_lacks(tmp_path):
    from classifier_head_test import WINDOW, classifier_checkpoint
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    cfg = job_config(
        write_docs(tmp_path),
        str(tmp_path / "out"),
        folder,
        model={"max_seq_len": WINDOW},
        output={"select": {"where": "scores[toxic] < 0.5"}},
    )
    with pytest.raises(ConfigError, match=r"names labels \['toxic'\].*its labels: label_a, label_b, label_c"):
        make_plan(cfg, probe_backends=False)


@pytest.mark.slow
def test_selected_lists_exactly_the_documents_that_meet_where_with_their_text(tmp_path, tiny_checkpoint_dir):
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = write_docs(tmp_path)
    summary = run_job(
        job_config(
            docs,
            str(tmp_path / "out"),
            tiny_checkpoint_dir,
            input={"keep_fields": ["lang"]},
            output={"select": {"where": "lang in [en, de]", "with_text": True}},
        )
    )
    lines = [json.loads(line) for f in sorted(glob.glob(f"{tmp_path}/out/selected/*.jsonl")) for line in open(f)]
    assert sorted(line["id"] for line in lines) == ["d0", "d1", "d4"]
    assert {line["id"]: line["text"] for line in lines}["d1"] == "document number 1 about rivers"
    assert summary["docs_selected"] == 3 and summary["select"]["where"] == "lang in [en, de]"
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert sum(f["path"].startswith("selected/") for f in manifest["files"]) >= 1  # committed with the run
