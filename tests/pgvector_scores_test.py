"""output.pgvector with a classifier's run: scores/ rows loaded beside their ids into the real Postgres."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import job_config
from pgvector_test import query

from docbeam.pipeline.driver.run import run_job

pytestmark = pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")


@pytest.mark.slow
@pytest.mark.extra
def test_a_classifiers_run_loads_its_scores_beside_the_ids_and_an_incremental_run_keeps_them(tmp_path, postgres):
    """scores/ rows go into a table of their shape (label, score, every label's score, kept fields), one
    transaction per run, and a query can filter by them as output.select does."""
    from classifier_head_test import TEXTS, WINDOW, classifier_checkpoint, read_scores

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t, "lang": "en"}) + "\n" for i, t in TEXTS.items()))
    sections = dict(
        model={"max_seq_len": WINDOW},
        batching={"buckets": [32, 64], "tokens_per_batch": 512},
        input={"keep_fields": ["lang"]},
        output={"pgvector": {"dsn": postgres, "table": "scored"}},
    )
    summary = run_job(job_config(str(docs), str(tmp_path / "a"), folder, **sections))
    assert summary["pgvector"]["upserted"] == len(TEXTS)
    rows = read_scores(tmp_path / "a")
    loaded = query(postgres, "SELECT id, label, score, scores, fields FROM scored ORDER BY id")
    assert [r[0] for r in loaded] == sorted(rows)
    for doc_id, label, score, scores, fields in loaded:
        assert label == rows[doc_id]["label"] and fields == {"lang": "en"}
        assert np.allclose(scores, rows[doc_id]["scores"], atol=1e-7) and score == pytest.approx(rows[doc_id]["score"])
    top = max(rows, key=lambda i: rows[i]["score"])
    assert query(postgres, "SELECT id FROM scored ORDER BY score DESC LIMIT 1") == [(top,)]
    again = run_job(
        job_config(
            str(docs),
            str(tmp_path / "b"),
            folder,
            **{**sections, "input": {"keep_fields": ["lang"], "reuse_from": str(tmp_path / "a")}},
        )
    )
    assert again["docs_reused"] == len(TEXTS) and again["pgvector"]["applied"]
    assert query(postgres, "SELECT count(*) FROM scored") == [(len(TEXTS),)]
